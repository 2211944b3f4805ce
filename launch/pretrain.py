"""Train (pre-train, retrofit, up-train) a Llama model with megatron-core.

    python launch/pretrain.py +recipe=tiny_pretrain            # from a checkout
    python -m launch.pretrain +recipe=tiny_pretrain            # anywhere dmc_train is installed
    torchrun --nproc_per_node=2 -m launch.pretrain +recipe=tiny_pretrain parallel.tensor=2
    torchrun --nproc_per_node=8 launch/pretrain.py +recipe=dmc_7b parallel.tensor=4

Config: <recipes>/config.yaml + <recipes>/recipe/<name>.yaml + command-line overrides (Hydra), where
<recipes> is dmc_train.recipes.recipes_dir() (the checkout's recipes/ or the installed copy).
"""

from dmc_train import cli
from dmc_train.training.preemption import catch_early  # light: torch is imported later


def train_app(cfg) -> None:
    from dmc_train import distributed
    from dmc_train.training.loop import train

    def run():
        summary = train(cfg)
        if distributed.is_rank0() and not summary.get("stopped_at_startup"):
            print(f"done: {summary['steps']} steps; checkpoint {summary['checkpoint']}", flush=True)

    cli.run_reporting_errors(run)
    distributed.shutdown()


def main() -> None:
    catch_early()  # first: a stop signal during the imports, config checks and model build is kept (docs/CLUSTER.md)
    cli.hydra_main(train_app, lock_run_dir=True)


if __name__ == "__main__":
    main()
