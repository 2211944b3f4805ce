"""Reshard a full training checkpoint to another TP/PP/VPP layout offline (torchrun with the target world size).

    torchrun --nproc_per_node=2 checkpoints_tools/reshard.py --input runs/a --output runs/a_tp1 --tensor 1 --pipeline 1
    torchrun --nproc_per_node=2 checkpoints_tools/reshard.py --input runs/a --output runs/a_pp2 --tensor 1 --pipeline 2
    python launch/pretrain.py <the run's overrides> run_dir=runs/a_tp1 parallel.tensor=1   # continues training
    torchrun --nproc_per_node=2 -m checkpoints_tools.reshard ...      # same, from an installed package

``--input``: a checkpoint directory, or a run directory / checkpoints root (its ``latest``), saved at
any layout. ``--output``: a new run directory holding ``checkpoints/iter_<step>`` with model,
optimizer, scheduler, step and data position; with ``--weights-only``, a weights-only checkpoint
(start from it with ``checkpoint.init_from``). Logic: ``dmc_train/conversion/reshard.py``.
"""

import argparse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="checkpoint (or run directory) to reshard")
    parser.add_argument("--output", required=True, help="new run directory (or weights-only checkpoint)")
    parser.add_argument("--tensor", type=int, required=True, help="target tensor-parallel size")
    parser.add_argument("--pipeline", type=int, required=True, help="target pipeline-parallel size")
    parser.add_argument("--virtual-pipeline", type=int, default=None, help="target virtual pipeline stages")
    parser.add_argument("--distributed-optimizer", action=argparse.BooleanOptionalAction, default=None,
                        help="target distributed-optimizer setting (default: as saved; a change needs --weights-only)")
    parser.add_argument("--weights-only", action="store_true", help="write the model weights only (any layout)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    args = parser.parse_args()

    from dmc_train import cli

    def run():
        from dmc_train import distributed
        from dmc_train.conversion.reshard import reshard

        out = reshard(args.input, args.output, args.tensor, args.pipeline, args.virtual_pipeline,
                      args.distributed_optimizer, args.weights_only, args.overwrite)
        if distributed.is_rank0():
            print(f"wrote {out} (TP={args.tensor} PP={args.pipeline}"
                  f"{' VPP=' + str(args.virtual_pipeline) if args.virtual_pipeline else ''}"
                  f"{', weights only' if args.weights_only else ''})", flush=True)
        distributed.shutdown()

    cli.run_reporting_errors(run)


if __name__ == "__main__":
    main()
