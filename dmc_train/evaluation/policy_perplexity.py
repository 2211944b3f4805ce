"""Held-out perplexity under an eviction policy: teacher-forced with the policy's parallel form, which
gives what the engine computes when a sequence is decoded token by token with the budget
(``tests/inference/test_policy_caches.py`` checks the two agree within 1e-4)."""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from dmc_train.policies import Scorer


def policy_loss(model: Any, dataset, scorer: Scorer, budget: int, prompt_len: int = 1, batch_size: int = 8,
                max_sequences: int = 0, progress: Optional[Callable[[str], None]] = None,
                less: Any = None) -> dict[str, float]:
    """Mean per-token LM loss and perplexity of ``model`` (:class:`~dmc_train.inference.model.LlamaForInference`)
    on ``dataset`` (samples with ``tokens``, ``labels``, ``loss_mask`` ``[seq_length]``; the first
    ``max_sequences``, 0 = all) when each sequence's first ``prompt_len`` tokens are the prompt and the rest
    are decoded with ``budget`` entries per (sequence, layer, KV head). ``progress`` receives a line per batch.
    ``less``: LESS's kernels (:class:`~dmc_train.inference.caches.less.LESSWeights`): the evicted pairs then
    enter its state."""
    count = len(dataset) if not max_sequences else min(max_sequences, len(dataset))
    total, tokens, start = 0.0, 0, time.perf_counter()
    for first in range(0, count, batch_size):
        samples = [dataset[i] for i in range(first, min(count, first + batch_size))]
        x, labels, mask = (torch.stack([torch.as_tensor(s[key]) for s in samples]) for key in
                           ("tokens", "labels", "loss_mask"))
        logits = model.forward_with_policy(x.long(), scorer, budget, prompt_len, less=less)
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.long().flatten(), reduction="none")
        total += float((loss * mask.flatten().float()).sum())
        tokens += int(mask.sum())
        if progress is not None:
            elapsed = time.perf_counter() - start
            done = first + len(samples)
            progress(f"[{done}/{count}] {scorer.name} budget {budget}: loss {total / tokens:.4f}  "
                     f"{tokens / elapsed:,.0f} tok/s  eta {elapsed / done * (count - done):.0f}s")
    return {"loss": total / tokens, "ppl": math.exp(total / tokens), "tokens": tokens}
