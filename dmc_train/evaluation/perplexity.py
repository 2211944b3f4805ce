"""Held-out perplexity of a trained checkpoint, next to the unigram baseline on the same tokens."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from omegaconf import open_dict

from dmc_train import distributed
from dmc_train.training import checkpointing as ckpt_mod


def resolve_checkpoint(cfg: Any) -> str:
    """``checkpoint.resume`` as a path: ``auto`` = the run's latest complete checkpoint."""
    resume = cfg.checkpoint.resume
    ckpt = ckpt_mod.read_latest(ckpt_mod.checkpoint_root(cfg)) if resume in ("auto", "none") else resume
    if ckpt is None:
        raise ckpt_mod.CheckpointError(f"no checkpoint in {ckpt_mod.checkpoint_root(cfg)}; train first "
                                       f"(launch/pretrain.py) or pass checkpoint.resume=<checkpoint dir>")
    return ckpt


def evaluate_checkpoint(cfg: Any) -> dict:
    """Perplexity on every full global batch of the valid and test splits; writes ``eval.json``.

    Returns ``{"checkpoint", "step", "<split>_loss", "<split>_ppl", "<split>_unigram_ppl"}`` and the
    method's evaluation metrics per split (DMC: ``<split>_achieved_cr``, per layer and per head).
    """
    from dmc_train.training.loop import Trainer

    ckpt = resolve_checkpoint(cfg)
    meta = ckpt_mod.read_meta(ckpt)
    out_path = os.path.join(cfg.run_dir, "eval.json")
    if os.path.exists(out_path):
        with open(out_path) as f:
            previous = json.load(f)
        if previous.get("checkpoint") == ckpt:
            return previous  # this checkpoint was evaluated already (delete eval.json to redo)
    with open_dict(cfg):
        cfg.checkpoint.init_from, cfg.checkpoint.resume = ckpt, "none"
    trainer = Trainer(cfg)
    result = {"checkpoint": ckpt, "step": meta["step"]}
    for split, data, prefixes in (("valid", trainer.valid_data, cfg.data.valid_prefixes),
                                  ("test", trainer.test_data, cfg.data.test_prefixes)):
        if data is None:
            continue
        loss = trainer.evaluate(data, batches=-1)["lm_loss"]
        result[f"{split}_loss"], result[f"{split}_ppl"] = loss, math.exp(loss)
        for key, value in trainer.method.evaluation_metrics().items():  # e.g. DMC's achieved CR
            result[f"{split}_{key}"] = value
        if cfg.data.kind == "indexed" and len(prefixes) == 1 and len(cfg.data.prefixes) == 1:
            from dmc_train.data.unigram import prefix_unigram_perplexity

            result[f"{split}_unigram_ppl"] = prefix_unigram_perplexity(cfg.data.prefixes[0], prefixes[0])
    if distributed.is_rank0():
        with open(out_path + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(out_path + ".tmp", out_path)
    return result
