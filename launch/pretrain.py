"""Train (pre-train, retrofit, up-train) a Llama model with megatron-core.

    torchrun --nproc_per_node=2 launch/pretrain.py +recipe=tiny_pretrain
    torchrun --nproc_per_node=8 launch/pretrain.py +recipe=dmc_7b parallel.tensor=4

Config: recipes/config.yaml + recipes/recipe/<name>.yaml + command-line overrides (Hydra).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hydra  # noqa: E402

from dmc_train import cli  # noqa: E402
from dmc_train.recipes import register_schema  # noqa: E402


@hydra.main(config_path="../recipes", config_name="config", version_base=None)
def main(cfg) -> None:
    from dmc_train import distributed
    from dmc_train.training.loop import train

    def run():
        summary = train(cfg)
        if distributed.is_rank0():
            print(f"done: {summary['steps']} steps; checkpoint {summary['checkpoint']}", flush=True)

    cli.run_reporting_errors(run)
    distributed.shutdown()


if __name__ == "__main__":
    register_schema()
    cli.precheck(sys.argv[1:])
    main()
