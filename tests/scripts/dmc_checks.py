"""DMC training end to end in one process; writes observations as JSON for tests/test_dmc_training.py.

    python tests/scripts/dmc_checks.py OUT.json WORKDIR

Scenarios (tiny model, GQA 4 groups, zero-out 2 + ramp 2 + finetune 2 steps):
  full          uninterrupted 6 steps, checkpoints at steps 3 and 6: losses, stages, metadata, PNGs
  resumed       the same run stopped after 3 steps and resumed: losses of steps 4..6
  zeroed_rows   before step 2 (end of zero-out) the q/k decision-channel rows of W_qkv are zero
  fixed_pool    the Fixed Memory Pooling ablation trains and evaluates
"""

import json
import os
import sys

COMMON = ["+recipe=tiny_pretrain", "method=dmc", "model.num_query_groups=4", "train.max_steps=6",
          "train.eval_interval=3", "logging.progress=false", "checkpoint.save_interval=3", "optim.lr=3e-3",
          "optim.schedule=constant",
          "method.zero_out_steps=2", "method.ramp_steps=2", "method.finetune_steps=2", "method.target_cr=3",
          "method.init_offset=1.0"]


def run(overrides):
    from dmc_train.recipes import load_config
    from dmc_train.training.loop import train

    return train(load_config(COMMON + overrides))


def history(summary, key):
    return [h.get(key) for h in summary["history"]]


def main(out_path: str, work: str) -> None:
    import torch

    from dmc_train import distributed
    from dmc_train.models.dmc import DMCSelfAttention
    from dmc_train.models.llama_weights import split_qkv
    from dmc_train.recipes import load_config
    from dmc_train.training.checkpointing import read_meta
    from dmc_train.training.loop import Trainer

    res = {}
    full = run([f"run_dir={work}/full"])
    res["full"] = {k: history(full, k) for k in ("lm_loss", "cr_loss", "cr", "target_cr", "lr", "val_loss")}
    res["checkpoints"] = {}
    for step in (3, 6):
        ckpt = f"{work}/full/checkpoints/iter_{step:07d}"
        res["checkpoints"][step] = {"meta": read_meta(ckpt)["method_metadata"],
                                    "png": os.path.getsize(os.path.join(ckpt, "cr_heatmap.png"))}

    run([f"run_dir={work}/split", "train.max_steps_per_job=3"])
    res["resumed"] = history(run([f"run_dir={work}/split"]), "lm_loss")

    trainer = Trainer(load_config(COMMON + [f"run_dir={work}/rows", "checkpoint.resume=none"]))
    trainer.method.before_step(2, trainer.model)
    rows = []
    for module in trainer.model[0].module.modules():
        if isinstance(module, DMCSelfAttention):
            q, k, v = split_qkv(module.linear_qkv.weight, 8, 4)  # [heads or groups, head dim, hidden]
            qk = torch.cat([q, k])
            rows.append({"qk_decision": float(qk[:, -1].abs().max()), "v_decision": float(v[:, -1].abs().max()),
                         "other": float(qk[:, :-1].abs().min(dim=-1).values.max())})
    res["zeroed_rows"] = rows

    pool = run([f"run_dir={work}/pool", "method=fixed_pooling", "method.target_cr=2", "train.max_steps=3"])
    res["fixed_pool"] = {k: history(pool, k) for k in ("lm_loss", "val_loss", "cr")}

    with open(out_path, "w") as f:
        json.dump(res, f)
    torch.distributed.barrier()
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
