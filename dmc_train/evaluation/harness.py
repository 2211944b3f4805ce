"""One checkpoint x one cache, measured the ways a researcher compares KV-cache methods at equal memory.

For a :class:`~dmc_train.inference.model.LlamaForInference` and a cache of the engine's registry (``full``,
``dmc``, an eviction policy at a budget, ``lightcache``, ``less``), :func:`evaluate_cache` reports:

- ``budget_entries`` and ``budget_fraction``: a policy's (LESS's) budget, or LightCache's window, both ways: in
  entries per (sequence, layer, KV head) and as a fraction of the evaluated sequence length (a fractional budget
  is a fraction of that length, :class:`~dmc_train.policies.budget.Budget`);
- ``ppl``, ``loss``, ``accuracy`` (next-token, argmax): held-out sequences teacher-forced through the
  cache's parallel form (:func:`~dmc_train.inference.caches.teacher_forced`), the first ``prompt_len``
  tokens of each prefilled, the rest decoded with the cache; the tokens after the prompt are scored;
- ``incremental``: the first few of those sequences decoded for real, token by token, through the engine's
  cache (:func:`~dmc_train.evaluation.incremental.teacher_forced_decode`), beside the parallel form on the
  same sequences: the two perplexities agree (they are the same computation); ``incremental_sequences=0``
  decodes nothing token by token, and the measures below, which come from that pass, are left out;
- what the cache held at the end of those sequences: ``kv_bytes_per_token`` (K/V entries in use plus any
  per-row state: policy scores, DMC's open slot, LESS's ``H, z``; LightCache's projections), and
  ``compression`` = the bytes per token of the uncompressed multi-head cache of the same model
  (``2 * layers * query heads * head_dim`` elements: what GQA and every method are compared against) over
  that; ``entry_compression``: tokens / entries held (the DMC paper's CR, per KV head);
- ``decode``: decode throughput at a fixed KV budget: the engine holds ``kv_budget_seqs`` uncompressed
  multi-head sequences' worth of bytes, runs as many sequences as fit (the last 32 tokens of each
  sequence generated after a prompt of the rest) and reports the batch and tokens/s. Tokens/s are only
  comparable within one run of one process on a quiet machine (the study times its cells round robin).
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from dmc_train.evaluation.incremental import teacher_forced_decode
from dmc_train.inference.caches import cache_budget, for_context, teacher_forced

Progress = Optional[Callable[[str], None]]


def samples_of(dataset, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first ``count`` samples (0 = all) as ``tokens, labels, loss_mask``, each ``[count, seq_length]``."""
    count = len(dataset) if not count else min(count, len(dataset))
    samples = [dataset[i] for i in range(count)]
    return tuple(torch.stack([torch.as_tensor(s[key], device="cpu") for s in samples]).long()  # host: data
                 for key in ("tokens", "labels", "loss_mask"))


def vanilla_bytes_per_token(model) -> int:
    """K and V of every layer and query head: the uncompressed multi-head cache of one token."""
    s = model.shape
    return 2 * s.num_layers * s.num_heads * s.head_dim * model.dtype.itemsize


def teacher_forced_metrics(forward, tokens, labels, mask, prompt_len: int = 1, batch_size: int = 8,
                           progress: Progress = None, label: str = "") -> dict[str, float]:
    """Loss, perplexity and next-token accuracy of ``forward(tokens [b, n], prompt_len) -> logits`` on
    ``tokens [N, n]`` against ``labels`` where ``mask`` is set."""
    total, correct, count, start = 0.0, 0, 0, time.perf_counter()
    for first in range(0, len(tokens), batch_size):
        x, y, m = (t[first: first + batch_size] for t in (tokens, labels, mask))
        logits = forward(x, prompt_len).float()
        y, m = y.to(logits.device), m.to(logits.device)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
        total += float((loss * m.flatten()).sum())
        correct += int(((logits.argmax(-1) == y) & (m > 0)).sum())
        count += int(m.sum())
        if progress is not None:
            done, elapsed = first + len(x), time.perf_counter() - start
            progress(f"[{done}/{len(tokens)}] {label}: loss {total / count:.4f}  {count / elapsed:,.0f} tok/s  "
                     f"eta {elapsed / done * (len(tokens) - done):.0f}s")
    return {"loss": total / count, "ppl": math.exp(total / count), "accuracy": correct / count, "tokens": count}


def incremental_metrics(model, cache: str, options: dict, forward, tokens, labels, mask,
                        prompt_len: int = 1) -> dict[str, Any]:
    """``tokens [k, n]`` decoded through the engine's ``cache`` (teacher-forced, one token per step) and through
    the parallel ``forward``: both perplexities, the largest logit difference, and what the cache held at the
    end of each sequence (bytes and entries, summed over the sequences; ``head_compression [layers][H_kv]``:
    tokens / entries per KV head)."""
    from dmc_train.inference.engine import Engine

    engine = Engine(model, None, cache, max_batch=len(tokens), kv_bytes=Engine.kv_bytes_for(model, *tokens.shape),
                    **options)
    got = torch.stack(teacher_forced_decode(model, engine.cache, list(tokens), [prompt_len] * len(tokens)))
    want = forward(tokens, prompt_len)
    held = [engine.cache.bytes_held(i) for i in range(len(tokens))]
    per_head = sum(engine.cache.entries(i) for i in range(len(tokens)))  # [layers, H_kv]
    rows = engine.cache.rows[0].numel()
    for i in range(len(tokens)):
        engine.cache.release(i)

    def ppl(logits):
        y, m = labels.to(logits.device).flatten(), mask.to(logits.device).flatten()
        loss = F.cross_entropy(logits.float().flatten(0, 1), y, reduction="none")
        return math.exp(float((loss * m).sum() / m.sum()))

    n = tokens.numel()
    return {"sequences": len(tokens), "ppl_engine": ppl(got), "ppl_parallel": ppl(want),
            "max_logit_diff": float((got.float() - want.float()).abs().max()),
            "bytes": sum(h["total"] - h["pages"] + h["entries"] for h in held),
            "page_bytes": sum(h["total"] for h in held), "max_page_bytes": max(h["total"] for h in held),
            "entries": int(per_head.sum()), "rows": rows, "tokens": n,
            "head_compression": (n / per_head.double()).tolist()}


def decode_throughput(model, cache: str, options: dict, tokens, kv_bytes: int, per_sequence: int,
                      new_tokens: int = 32, page_size: int = 16) -> dict[str, Any]:
    """Decode tokens/s of the engine holding ``kv_bytes`` of K/V pages, running as many sequences at once as
    fit when each takes ``per_sequence`` bytes (pages and state at its end; a DMC sequence's own decisions may
    take more, and requests that run out of pages are counted in ``failed``): prompts are the rows of
    ``tokens [N, n]`` without their last ``new_tokens`` (rows reused when fewer than fit), generated greedily
    to ``n`` tokens, so that the steps timed are those of a full cache."""
    from dmc_train.inference.engine import Engine
    from dmc_train.inference.sampling import SamplingParams

    fits = max(1, kv_bytes // per_sequence)
    prompt_len = tokens.shape[1] - new_tokens
    engine = Engine(model, None, cache, page_size=page_size, kv_bytes=kv_bytes, max_batch=fits, **options)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    outputs = engine.generate([tokens[i % len(tokens), :prompt_len].tolist() for i in range(fits)], params)
    s = engine.stats
    return {"kv_budget_bytes": kv_bytes, "batch": fits, "decode_tokens_per_s": s["decode_tokens"] / s["decode_s"],
            "failed": sum(o.error is not None for o in outputs), "max_running": s["max_running"]}


def evaluate_cache(model, dataset, cache: str, options: dict[str, Any], prompt_len: int = 1, max_sequences: int = 0,
                   batch_size: int = 8, incremental_sequences: int = 4, kv_budget_seqs: int = 8,
                   progress: Progress = None) -> dict[str, Any]:
    """Every measure of the module docstring for ``model`` with ``cache`` (a registry name, after ``auto`` is
    resolved) and its ``options`` on ``dataset``'s first ``max_sequences`` sequences (0 = all)."""
    tokens, labels, mask = samples_of(dataset, max_sequences)
    mask[:, : prompt_len - 1] = 0  # the tokens after the prompt are scored (the prompt's own come from full attention)
    n = tokens.shape[1]
    budget = cache_budget(cache, model, options, n)
    options = for_context(cache, model, options, n)  # a fraction of the budget: of the evaluated sequence
    forward = teacher_forced(cache, model, options)
    result: dict[str, Any] = {"cache": cache, "options": dict(options), "prompt_len": prompt_len,
                              "sequences": len(tokens), "seq_length": n}
    if budget is not None:
        result.update(budget_entries=budget, budget_fraction=budget / n)
    result.update(teacher_forced_metrics(forward, tokens, labels, mask, prompt_len, batch_size, progress, cache))
    vanilla = vanilla_bytes_per_token(model)
    result["vanilla_bytes_per_token"] = vanilla
    if not incremental_sequences:
        return result
    k = min(incremental_sequences, len(tokens))
    inc = incremental_metrics(model, cache, options, forward, tokens[:k], labels[:k], mask[:k], prompt_len)
    result["incremental"] = inc
    result["kv_bytes_per_token"] = inc["bytes"] / inc["tokens"]
    result["compression"] = vanilla / result["kv_bytes_per_token"]
    result["entry_compression"] = inc["tokens"] * inc["rows"] / inc["entries"]
    if kv_budget_seqs:
        kv_bytes = kv_budget_seqs * vanilla * n
        result["decode"] = decode_throughput(model, cache, options, tokens[:k], kv_bytes, inc["max_page_bytes"])
    return result
