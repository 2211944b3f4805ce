"""Convert an MHA (or GQA) checkpoint to fewer query groups by averaging K/V heads (GQA up-training).

    python checkpoints_tools/convert_gqa.py --input runs/base_tiny --output runs/gqa_inits/base_tiny_g4 --groups 4
    python -m checkpoints_tools.convert_gqa ...     # same, from an installed package (or: dmc-convert-gqa)
    python launch/pretrain.py +recipe=gqa_tiny          # up-trains from that checkpoint

``--input``: a checkpoint directory, or a run directory / checkpoints root (its ``latest``), saved at
any TP/PP layout. ``--output``: a weights-only checkpoint loadable at any layout with
``checkpoint.init_from``. Logic: ``dmc_train/conversion/gqa.py``.
"""

import argparse
import os


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="checkpoint (or run directory) to convert")
    parser.add_argument("--output", required=True, help="directory for the converted weights-only checkpoint")
    parser.add_argument("--groups", type=int, required=True, help="query groups (KV heads) of the result")
    parser.add_argument("--overwrite", "--force", dest="force", action="store_true",
                        help="replace an existing --output")
    args = parser.parse_args()

    from dmc_train import cli, distributed
    from dmc_train.conversion.gqa import convert_gqa_checkpoint
    from dmc_train.errors import ConfigError

    def run():
        if os.path.exists(args.output) and not args.force:
            raise ConfigError(f"--output {args.output} exists; choose another directory or pass --force")
        out = convert_gqa_checkpoint(args.input, args.output, args.groups)
        print(f"wrote {out} ({args.groups} query groups)", flush=True)

    cli.run_reporting_errors(run)
    distributed.shutdown()


if __name__ == "__main__":
    main()
