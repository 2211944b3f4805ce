"""Offline resharding under one 2-rank launch; writes the observations as JSON for the test to assert.

    torchrun --nproc_per_node=2 tests/scripts/reshard_checks.py OUT.json WORKDIR

Hops (tiny model, stopped after 3 of 6 steps): A at TP=2 -> B at TP=1 (DP=2) -> C at PP=2 -> V at
PP=2 VPP=2. For each: the weights (loaded at TP=1) bitwise equal to A's, and the last 3 steps trained
from it equal those trained from A at the same layout. A distributed-optimizer checkpoint: the TP
change refused, then written with weights_only.
"""

import json
import os
import sys

COMMON = ["+recipe=tiny_pretrain", "train.max_steps=6", "train.eval_interval=0", "logging.progress=false",
          "checkpoint.save_interval=0", "optim.warmup_steps=1"]
LAYOUTS = {"B": ["parallel.tensor=1"], "C": ["parallel.pipeline=2"],
           "V": ["parallel.pipeline=2", "parallel.virtual_pipeline=2"]}


def train(overrides):
    from dmc_train.recipes import load_config
    from dmc_train.training.loop import train as train_run

    return [h["lm_loss"] for h in train_run(load_config(COMMON + overrides))["history"]]


def weights(ckpt):
    from dmc_train.training.model_loading import load_model

    loaded = load_model(ckpt)
    return {k: v.clone() for k, v in loaded.model[0].state_dict().items() if hasattr(v, "dtype")}, loaded.meta


def bitwise_equal(a, b):
    import torch

    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def main(out_path: str, work: str) -> None:
    from dmc_train import distributed
    from dmc_train.conversion.reshard import reshard
    from dmc_train.errors import CheckpointError
    from dmc_train.training.checkpoint_dirs import find_checkpoint

    res = {}
    train([f"run_dir={work}/A", "parallel.tensor=2", "train.max_steps_per_job=3"])
    src = {"A": find_checkpoint(f"{work}/A")}
    src["B"] = reshard(src["A"], f"{work}/B", tensor=1, pipeline=1)
    src["C"] = reshard(src["B"], f"{work}/C", tensor=1, pipeline=2)
    src["V"] = reshard(src["C"], f"{work}/V", tensor=1, pipeline=2, virtual_pipeline=2)
    ref, ref_meta = weights(src["A"])
    for hop in ("B", "C", "V"):
        got, meta = weights(src[hop])
        res[hop] = {"path": src[hop], "weights_equal": bitwise_equal(ref, got), "layout": meta["layout"],
                    "step": meta["step"], "consumed": meta["consumed_samples"],
                    "source_consumed": ref_meta["consumed_samples"]}
        res[hop]["from_original"] = train([f"run_dir={work}/cont_A_{hop}", f"checkpoint.resume={src['A']}",
                                           *LAYOUTS[hop]])
        res[hop]["from_resharded"] = train([f"run_dir={work}/{hop}", *LAYOUTS[hop]])

    train([f"run_dir={work}/D", "parallel.distributed_optimizer=true", "train.max_steps_per_job=1"])
    try:
        reshard(f"{work}/D", f"{work}/D_tp2", tensor=2, pipeline=1)
        res["distopt_refused"] = None
    except CheckpointError as e:
        res["distopt_refused"] = str(e)
    res["distopt_left_output"] = os.path.exists(f"{work}/D_tp2")
    written = reshard(f"{work}/D", f"{work}/D_tp2", tensor=2, pipeline=1, weights_only=True)
    got, meta = weights(written)
    res["weights_only"] = {"weights_equal": bitwise_equal(weights(f"{work}/D")[0], got),
                           "weights_only": meta.get("weights_only"), "layout": meta["layout"]}
    if distributed.is_rank0():
        with open(out_path, "w") as f:
            json.dump(res, f)
    distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
