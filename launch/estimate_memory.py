"""Estimate memory per GPU and checkpoint sizes for a config on N GPUs (no GPU needed).

    python launch/estimate_memory.py +recipe=dmc_7b parallel.tensor=2 --nodes 1 --gpus-per-node 8
    python launch/estimate_memory.py model=llama2_70b train.precision=bf16 train.seq_length=4096 \\
        parallel.tensor=8 parallel.pipeline=4 --world-size 32
    python launch/estimate_memory.py --doc-table      # the tables in docs/CLUSTER.md
    python -m launch.estimate_memory +recipe=dmc_7b    # same, from an installed package

Positional arguments are launch/pretrain.py's Hydra overrides. Logic and assumptions:
dmc_train/cluster/memory.py.
"""

import argparse
import sys

from dmc_train.cli import EXIT_USER_ERROR
from dmc_train.cluster import memory
from dmc_train.errors import one_line
from dmc_train.recipes import load_config


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="Hydra overrides (e.g. +recipe=dmc_7b parallel.tensor=2)")
    p.add_argument("--world-size", type=int, help="total GPUs (default: nodes x gpus-per-node)")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--doc-table", action="store_true", help="print the tables of docs/CLUSTER.md")
    args = p.parse_intermixed_args(argv)
    try:
        if args.doc_table:
            print(memory.doc_tables(load_config))
        else:
            world = args.world_size or args.nodes * args.gpus_per_node
            print(memory.describe(load_config(args.overrides), world))
    except Exception as e:  # config composition / layout problems: one line
        print(f"error: {one_line(e)}", file=sys.stderr)
        return EXIT_USER_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
