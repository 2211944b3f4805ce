"""Held-out perplexity of a trained checkpoint, next to the unigram baseline on the same tokens."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from dmc_train import distributed
from dmc_train.data.datasets import build_datasets
from dmc_train.errors import CheckpointError
from dmc_train.training import checkpointing as ckpt_mod
from dmc_train.training.forward import evaluate_loss
from dmc_train.training.model_loading import load_model


def resolve_checkpoint(cfg: Any) -> str:
    """``checkpoint.resume`` as a path: ``auto`` = the run's latest complete checkpoint, or a path."""
    resume = cfg.checkpoint.resume
    if resume == "none":
        raise CheckpointError("checkpoint.resume=none names no checkpoint to evaluate; use auto (the run's latest) "
                              "or a checkpoint directory")
    ckpt = ckpt_mod.read_latest(ckpt_mod.checkpoint_root(cfg)) if resume == "auto" else resume
    if ckpt is None:
        raise CheckpointError(f"no checkpoint in {ckpt_mod.checkpoint_root(cfg)}; train first "
                              f"(launch/pretrain.py) or pass checkpoint.resume=<checkpoint dir>")
    return ckpt


def evaluate_checkpoint(cfg: Any) -> dict:
    """Perplexity on every full global batch of the valid and test splits; writes ``eval.json``.

    Returns ``{"checkpoint", "step", "<split>_loss", "<split>_ppl", "<split>_unigram_ppl"}`` and the
    method's evaluation metrics per split (DMC: ``<split>_achieved_cr``, per layer and per head).
    The model is loaded alone (no optimizer) at the config's parallel layout.
    """
    ckpt = resolve_checkpoint(cfg)
    meta = ckpt_mod.read_meta(ckpt)
    out_path = os.path.join(cfg.run_dir, "eval.json")
    if os.path.exists(out_path):
        with open(out_path) as f:
            previous = json.load(f)
        if previous.get("checkpoint") == ckpt:
            return previous  # this checkpoint was evaluated already (delete eval.json to redo)
    loaded = load_model(ckpt, cfg=cfg)
    t = cfg.train
    _, valid_data, test_data = build_datasets(cfg, num_train_samples=t.global_batch_size)
    result = {"checkpoint": ckpt, "step": meta["step"]}
    for split, data, prefixes in (("valid", valid_data, cfg.data.valid_prefixes),
                                  ("test", test_data, cfg.data.test_prefixes)):
        if data is None:
            continue
        loss = evaluate_loss(loaded.model, data, -1, t.global_batch_size, t.micro_batch_size, t.seq_length)["lm_loss"]
        result[f"{split}_loss"], result[f"{split}_ppl"] = loss, math.exp(loss)
        for key, value in loaded.method.evaluation_metrics().items():  # e.g. DMC's achieved CR
            result[f"{split}_{key}"] = value
        if cfg.data.kind == "indexed" and len(prefixes) == 1 and len(cfg.data.prefixes) == 1:
            from dmc_train.data.unigram import prefix_unigram_perplexity

            result[f"{split}_unigram_ppl"] = prefix_unigram_perplexity(cfg.data.prefixes[0], prefixes[0])
    if distributed.is_rank0():
        with open(out_path + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(out_path + ".tmp", out_path)
    return result
