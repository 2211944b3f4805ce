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

    With ``eval.cache=<policy>`` (an eviction policy of ``dmc_train.policies``) the perplexity is that of
    decoding every sequence token by token at ``eval.budget`` (teacher-forced with the policy's parallel
    form, :func:`evaluate_with_policy`) and the file is ``eval_<policy>_<budget>.json``. With
    ``eval.cache=lightcache`` (options in ``eval.options``; ``eval.budget`` unused) the budget in the file
    name is LightCache's window.

    Returns ``{"checkpoint", "step", "<split>_loss", "<split>_ppl", "<split>_unigram_ppl"}`` and the
    method's evaluation metrics per split (DMC: ``<split>_achieved_cr``, per layer and per head).
    The model is loaded alone (no optimizer) at the config's parallel layout.
    """
    ckpt = resolve_checkpoint(cfg)
    meta = ckpt_mod.read_meta(ckpt)
    if cfg.eval.cache != "model":
        return evaluate_with_policy(cfg, ckpt, meta)
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
        _write_json(result, out_path)
    return result


def evaluate_with_policy(cfg: Any, ckpt: str, meta: dict) -> dict:
    """Held-out perplexity under the eviction policy ``cfg.eval.cache`` (one process, the inference model)."""
    from dmc_train.evaluation.policy_perplexity import policy_loss
    from dmc_train.inference.model import LlamaForInference
    from dmc_train.policies import build_scorer

    e = cfg.eval
    model, _ = LlamaForInference.from_checkpoint(ckpt)
    s = model.shape
    if model.dmc is not None:
        raise CheckpointError(f"eval.cache={e.cache} is an eviction policy for vanilla and GQA checkpoints; {ckpt} "
                              f"is a DMC model (evaluate it with eval.cache=model)")
    if e.cache == "lightcache":  # not an eviction scorer: its own parallel form, its window as the budget
        from dmc_train.inference.caches.lightcache import lightcache_for

        scorer = lightcache_for(model, dict(e.options))
        budget = scorer.settings.window
    else:
        options = {"budget": e.budget, "schedule": e.schedule, **dict(e.options)}
        scorer = build_scorer(e.cache, options, s.head_dim, s.num_heads // s.num_kv_heads, model.scale)
        budget = scorer.budget(s.max_positions)
    _, valid_data, test_data = build_datasets(cfg, num_train_samples=cfg.train.global_batch_size)
    result = {"checkpoint": ckpt, "step": meta["step"], "cache": e.cache, "budget": budget,
              "schedule": e.schedule, "prompt_len": e.prompt_len}
    for split, data in (("valid", valid_data), ("test", test_data)):
        if data is None:
            continue
        r = policy_loss(model, data, scorer, budget, e.prompt_len, cfg.train.micro_batch_size, e.max_sequences,
                        progress=lambda line: print(line, flush=True) if distributed.is_rank0() else None)
        result[f"{split}_loss"], result[f"{split}_ppl"], result[f"{split}_tokens"] = r["loss"], r["ppl"], r["tokens"]
    if distributed.is_rank0():
        _write_json(result, os.path.join(cfg.run_dir, f"eval_{e.cache}_{budget}.json"))
    return result


def _write_json(result: dict, path: str) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(path + ".tmp", path)
