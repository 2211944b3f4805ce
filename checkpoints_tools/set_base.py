"""Record where the base of a LESS run's checkpoints is now (the base was moved or copied elsewhere).

    python checkpoints_tools/set_base.py --input runs/less_tiny_h2o_0.1 --base /data/base_tiny/checkpoints/iter_0000600

A checkpoint of a method that freezes the base (LESS) holds only the method's parameters and names the
base checkpoint it was trained on (``meta.json``, ``base``). ``--input``: one such checkpoint, or a run
directory / checkpoints root (every complete checkpoint in it). ``--base``: the base at its new place (a
checkpoint directory, a run directory whose ``latest`` names it, or a Hugging Face directory); it must be
the base they were trained on (same shape and step), else nothing is changed. Each ``meta.json`` is
replaced atomically. Logic: ``dmc_train/training/base_reference.py``.
"""

import argparse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="checkpoint, run directory or checkpoints root")
    parser.add_argument("--base", required=True, help="the base (checkpoint or HF directory) at its new place")
    args = parser.parse_args()

    from dmc_train import cli

    def run():
        from dmc_train.training.base_reference import set_base

        for ckpt in set_base(args.input, args.base):
            print(f"{ckpt}: base {args.base}", flush=True)

    cli.run_reporting_errors(run)


if __name__ == "__main__":
    main()
