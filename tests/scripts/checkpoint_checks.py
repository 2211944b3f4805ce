"""Checkpoint round trips under one 2-rank launch; writes the observations as JSON for the test to assert.

    torchrun --nproc_per_node=2 tests/scripts/checkpoint_checks.py OUT.json WORKDIR

Scenarios (tiny model, 6 steps, constant data):
  full_tp2      uninterrupted TP=2 run: losses of steps 1..6, logits of a fixed batch at the end
  resume_tp2    TP=2 stopped after 3 steps (max_steps_per_job), resumed with resume=auto at TP=2
  resume_tp1    the same step-3 checkpoint resumed at TP=1 (DP=2): optimizer state resharded
  logits_tp1    the final TP=2 checkpoint's weights loaded at TP=1: logits of the same batch
  resume_distopt DP=2 with the distributed optimizer, stopped after 3 steps and resumed
  distopt_to_tp2 that distributed-optimizer checkpoint loaded at TP=2 with its optimizer: the error
"""

import json
import sys

import torch

COMMON = ["+recipe=tiny_pretrain", "train.max_steps=6", "train.eval_interval=0", "logging.progress=false",
          "checkpoint.save_interval=0", "optim.warmup_steps=1"]


def run(overrides):
    from dmc_train.recipes import load_config
    from dmc_train.training.loop import train

    return train(load_config(COMMON + overrides))


def losses(summary):
    return [h["lm_loss"] for h in summary["history"]]


def fixed_logits(trainer):
    from dmc_train.training.forward import logits

    tokens = torch.arange(32).reshape(2, 16) * 7 % trainer.cfg.model.vocab_size
    out = logits(trainer.model, tokens)
    return out.tolist() if out is not None else None


def main(out_path: str, work: str) -> None:
    from dmc_train import distributed
    from dmc_train.errors import CheckpointError

    res = {}
    full = run([f"run_dir={work}/full", "parallel.tensor=2"])
    res["full_tp2"] = losses(full)
    res["logits_tp2"] = fixed_logits(full["trainer"])

    first = run([f"run_dir={work}/split", "parallel.tensor=2", "train.max_steps_per_job=3"])
    res["first_half"] = losses(first)
    res["resume_tp2"] = losses(run([f"run_dir={work}/split", "parallel.tensor=2"]))
    step3 = f"{work}/split/checkpoints/iter_0000003"
    res["resume_tp1"] = losses(run([f"run_dir={work}/tp1", f"checkpoint.resume={step3}"]))

    weights = run([f"run_dir={work}/logits", f"checkpoint.init_from={work}/full/checkpoints/iter_0000006",
                   "train.max_steps_per_job=0", "checkpoint.resume=none"])
    res["logits_tp1"] = fixed_logits(weights["trainer"])

    run([f"run_dir={work}/distopt", "parallel.distributed_optimizer=true", "train.max_steps_per_job=3"])
    res["resume_distopt"] = losses(run([f"run_dir={work}/distopt", "parallel.distributed_optimizer=true"]))
    res["full_dp2"] = losses(run([f"run_dir={work}/dp2_full", "checkpoint.save_at_end=false"]))
    try:
        run([f"run_dir={work}/distopt", "parallel.distributed_optimizer=true", "parallel.tensor=2"])
        res["distopt_to_tp2"] = "no error"
    except CheckpointError as e:
        res["distopt_to_tp2"] = str(e)
    if distributed.is_rank0():
        with open(out_path, "w") as f:
            json.dump(res, f)
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
