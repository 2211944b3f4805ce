"""GQA conversion round trips under one 2-rank launch; writes observations as JSON for tests/test_gqa.py.

    torchrun --nproc_per_node=2 tests/scripts/gqa_checks.py OUT.json WORKDIR

  source      tiny MHA model trained 2 steps at TP=2 and saved; logits of a fixed batch
  groups8     converted to 8 groups (= heads), loaded at TP=2: logits (must equal the source's)
  groups2     converted to 2 groups, loaded at TP=1: its fused QKV weights vs the source's, split with
              dmc_train.models.llama_weights: query heads kept, K/V the means of each 4 old heads
              (exact, computed here independently of convert_qkv_weight), and logits (must differ)
  uptrain     GQA up-training from the 2-group checkpoint at TP=2: losses of 4 steps
"""

import json
import sys

import torch

COMMON = ["+recipe=tiny_pretrain", "train.eval_interval=0", "logging.progress=false", "checkpoint.save_interval=0",
          "optim.warmup_steps=0"]


def trainer_for(overrides):
    from dmc_train.recipes import load_config
    from dmc_train.training.loop import Trainer

    return Trainer(load_config(COMMON + overrides))


def fixed_logits(trainer):
    from dmc_train.training.forward import logits

    tokens = torch.arange(48).reshape(2, 24) * 5 % trainer.cfg.model.vocab_size
    out = logits(trainer.model, tokens)
    return out.tolist() if out is not None else None


def qkv_weights(trainer):
    return {name: p.detach().clone() for name, p in trainer.model[0].module.named_parameters()
            if name.endswith("linear_qkv.weight")}


def main(out_path: str, work: str) -> None:
    from dmc_train import distributed
    from dmc_train.conversion.gqa import convert_gqa_checkpoint
    from dmc_train.models.llama_weights import split_qkv
    from dmc_train.recipes import load_config
    from dmc_train.training.loop import train

    res = {}
    source = train(load_config(COMMON + [f"run_dir={work}/src", "parallel.tensor=2", "train.max_steps=2"]))
    res["source_logits"] = fixed_logits(source["trainer"])
    src_tp1 = trainer_for([f"run_dir={work}/src_tp1", f"checkpoint.init_from={work}/src", "checkpoint.resume=none"])
    source_qkv = qkv_weights(src_tp1)

    convert_gqa_checkpoint(f"{work}/src", f"{work}/g8", 8)
    convert_gqa_checkpoint(f"{work}/src", f"{work}/g2", 2)

    g8 = trainer_for([f"run_dir={work}/g8run", "parallel.tensor=2", f"checkpoint.init_from={work}/g8",
                      "checkpoint.resume=none"])
    res["g8_logits"] = fixed_logits(g8)
    g2 = trainer_for([f"run_dir={work}/g2run", "model.num_query_groups=2", f"checkpoint.init_from={work}/g2",
                      "checkpoint.resume=none"])
    res["g2_logits"] = fixed_logits(g2)
    errors = []
    for name, w in qkv_weights(g2).items():
        q0, k0, v0 = split_qkv(source_qkv[name], 8, 8)
        q, k, v = split_qkv(w, 8, 2)
        errors.append(float((q - q0).abs().max()))
        for new, old in ((k, k0), (v, v0)):  # group g averages old heads 4g .. 4g+3
            mean = old.double().reshape(2, 4, *old.shape[1:]).mean(dim=1).to(old.dtype)
            errors.append(float((new - mean).abs().max()))
    res["g2_qkv_max_error"] = max(errors)
    up = train(load_config(COMMON + [f"run_dir={work}/up", "parallel.tensor=2", "model.num_query_groups=2",
                                     f"checkpoint.init_from={work}/g2", "train.max_steps=4"]))
    res["uptrain_losses"] = [h["lm_loss"] for h in up["history"]]
    if distributed.is_rank0():
        with open(out_path, "w") as f:
            json.dump(res, f)
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
