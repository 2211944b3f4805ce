"""LESS checkpoints (the kernels plus a reference to the base) under one 2-rank launch; writes the observations
as JSON for tests/test_less_checkpoints.py to assert.

    torchrun --nproc_per_node=2 tests/scripts/less_checkpoint_checks.py OUT.json WORKDIR

Scenarios (tiny model; the base trained 4 steps at DP=2, then LESS for 6 steps, constant data):
  full_tp2        uninterrupted LESS run at TP=2: per-layer MSE of steps 1..6
  resume_tp2      TP=2 stopped after 3 steps (max_steps_per_job), resumed with resume=auto at TP=2
  resume_pp2      the TP=2 step-3 checkpoint resumed at PP=2 (kernels and Adam state resharded)
  full_dp2        uninterrupted LESS run at DP=2
  resume_distopt  DP=2 with the distributed optimizer, stopped after 3 steps and resumed
"""

import json
import sys

COMMON = ["+recipe=tiny_pretrain", "train.eval_interval=0", "logging.progress=false", "checkpoint.save_interval=0",
          "optim.warmup_steps=0"]
LESS = ["method=less", "method.budget=16", "method.hidden=32", "method.dropout=0.0", "optim.lr=1e-2",
        "train.max_steps=6"]


def run(overrides):
    from dmc_train.recipes import load_config
    from dmc_train.training.loop import train

    return train(load_config(COMMON + overrides))


def mse(summary):
    return [h["less_mse_layers"] for h in summary["history"]]


def main(out_path: str, work: str) -> None:
    from dmc_train import distributed

    base = f"{work}/base"
    run([f"run_dir={base}", "train.max_steps=4"])
    less = [*LESS, f"checkpoint.init_from={base}"]
    res = {"full_tp2": mse(run([*less, f"run_dir={work}/full_tp2", "parallel.tensor=2"]))}
    res["first_half"] = mse(run([*less, f"run_dir={work}/split", "parallel.tensor=2", "train.max_steps_per_job=3"]))
    res["resume_tp2"] = mse(run([*less, f"run_dir={work}/split", "parallel.tensor=2"]))
    step3 = f"{work}/split/checkpoints/iter_0000003"
    res["resume_pp2"] = mse(run([*less, f"run_dir={work}/pp2", "parallel.pipeline=2", f"checkpoint.resume={step3}"]))
    res["full_dp2"] = mse(run([*less, f"run_dir={work}/dp2"]))
    distopt = [*less, f"run_dir={work}/distopt", "parallel.distributed_optimizer=true"]
    run([*distopt, "train.max_steps_per_job=3"])
    res["resume_distopt"] = mse(run(distopt))
    if distributed.is_rank0():
        with open(out_path, "w") as f:
            json.dump(res, f)
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
