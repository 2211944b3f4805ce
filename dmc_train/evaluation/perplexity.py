"""Held-out perplexity of a trained checkpoint, next to the unigram baseline on the same tokens."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from dmc_train import distributed
from dmc_train.data.datasets import build_datasets
from dmc_train.errors import CheckpointError, ConfigError, DataError
from dmc_train.training.checkpoint_dirs import checkpoint_root, find_checkpoint, read_latest, read_meta
from dmc_train.training.forward import evaluate_loss
from dmc_train.training.model_loading import load_model


def resolve_checkpoint(cfg: Any) -> str:
    """``checkpoint.resume`` as a path: ``auto`` = the run's latest complete checkpoint, or a path."""
    resume = cfg.checkpoint.resume
    if resume == "none":
        raise CheckpointError("checkpoint.resume=none names no checkpoint to evaluate; use auto (the run's latest) "
                              "or a checkpoint directory")
    ckpt = read_latest(checkpoint_root(cfg)) if resume == "auto" else find_checkpoint(resume)
    if ckpt is None:
        raise CheckpointError(f"no checkpoint in {checkpoint_root(cfg)}; train first "
                              f"(launch/pretrain.py) or pass checkpoint.resume=<checkpoint dir>")
    return ckpt


def evaluate_checkpoint(cfg: Any) -> dict:
    """Perplexity on every full global batch of the valid and test splits; writes ``eval.json``.

    With ``eval.cache=<cache>`` (any cache of the inference engine, ``auto`` = the checkpoint's own) the
    evaluation harness runs instead (:func:`evaluate_with_cache`).

    Returns ``{"checkpoint", "step", "<split>_loss", "<split>_ppl", "<split>_unigram_ppl"}`` and the
    method's evaluation metrics per split (DMC: ``<split>_achieved_cr``, per layer and per head).
    The model is loaded alone (no optimizer) at the config's parallel layout.
    """
    ckpt = resolve_checkpoint(cfg)
    meta = read_meta(ckpt)
    check_eval_inputs(cfg, ckpt, meta)
    if cfg.eval.cache != "model":
        return evaluate_with_cache(cfg, ckpt, meta)
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


def check_eval_inputs(cfg: Any, ckpt: str, meta: dict) -> None:
    """One-line errors before anything is read or written: results never go into the checkpoint's directory, and
    random tokens are evaluated only for a checkpoint trained on them."""
    run_dir, where = os.path.realpath(cfg.run_dir), os.path.realpath(ckpt)
    if run_dir == where or run_dir.startswith(where + os.sep):
        raise ConfigError(f"run_dir={cfg.run_dir} is inside the checkpoint {ckpt}; results go to a run directory of "
                          f"their own: pass run_name=<name> (or run_dir=<dir>)")
    trained_on = meta.get("config", {}).get("data", {}).get("kind")
    if cfg.data.kind == "synthetic" and (meta.get("hf_source") or trained_on != "synthetic"):
        what = f"imported from {meta['hf_source']}" if meta.get("hf_source") else f"trained on data.kind={trained_on}"
        raise DataError(f"data.kind=synthetic would evaluate {ckpt} ({what}) on random tokens; give its held-out "
                        f"data (its recipe, e.g. +recipe=base_tiny, or data.kind=indexed data.valid_prefixes=[...] "
                        f"data.test_prefixes=[...]; docs/EVALUATION.md)")


def cache_options(e: Any, cache: str) -> dict[str, Any]:
    """The engine's options for ``cache`` from the ``eval`` config node: ``eval.options``, and for an eviction
    policy its budget (default 1/4 of the evaluated sequence) and schedule; LESS takes ``eval.budget`` when given."""
    from dmc_train.policies import POLICIES, Budget

    options = dict(e.options)
    if cache in POLICIES:
        options = {"budget": Budget.of(e.budget).value, "schedule": e.schedule, **options}
    elif cache == "less" and e.budget is not None:
        options = {"budget": e.budget, **options}
    return options


def evaluate_with_cache(cfg: Any, ckpt: str, meta: dict) -> dict:
    """The evaluation harness (:func:`~dmc_train.evaluation.harness.evaluate_cache`) for the checkpoint with
    the engine's cache ``cfg.eval.cache`` on the valid and test splits (one process, the inference model).
    Writes ``eval_<cache>[_<budget>].json``: the harness's measures per split under ``valid`` / ``test`` and
    ``<split>_loss``, ``<split>_ppl``, ``<split>_accuracy``, ``<split>_tokens`` beside them."""
    from dmc_train.evaluation.harness import evaluate_cache
    from dmc_train.inference.caches import CACHES, cache_budget, check_cache
    from dmc_train.inference.model import LlamaForInference

    e = cfg.eval
    model, _ = LlamaForInference.from_checkpoint(ckpt, device=e.device)
    cache = model.default_cache if e.cache == "auto" else e.cache
    if cache in CACHES and model.decisions is not None and cache not in ("dmc", "full"):
        raise CheckpointError(f"eval.cache={cache} is a cache for vanilla and GQA checkpoints; {ckpt} is a DMC model "
                              f"(evaluate it with eval.cache=model)")
    check_cache(cache, model)  # an unknown name: the line lists the caches
    options = cache_options(e, cache)
    budget = cache_budget(cache, model, options, cfg.train.seq_length)
    _, valid_data, test_data = build_datasets(cfg, num_train_samples=cfg.train.global_batch_size)
    result = {"checkpoint": ckpt, "step": meta["step"], "cache": cache, "budget": budget, "schedule": e.schedule,
              "prompt_len": e.prompt_len, "seq_length": cfg.train.seq_length}
    if budget is not None:
        result["budget_fraction"] = budget / cfg.train.seq_length
    for split, data in (("valid", valid_data), ("test", test_data)):
        if data is None:
            continue
        r = evaluate_cache(model, data, cache, options, e.prompt_len, e.max_sequences, cfg.train.micro_batch_size,
                           e.incremental_sequences, e.kv_budget_seqs if split == "test" else 0,
                           progress=lambda line: print(line, flush=True) if distributed.is_rank0() else None)
        result[split] = r
        for key in ("loss", "ppl", "accuracy", "tokens"):
            result[f"{split}_{key}"] = r[key]
    if distributed.is_rank0():
        _write_json(result, os.path.join(cfg.run_dir, f"eval_{cache}" + ("" if budget is None else f"_{budget}")
                                         + ".json"))
    return result


def _write_json(result: dict, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(path + ".tmp", path)
