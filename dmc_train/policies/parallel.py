"""The parallel form of a policy: what every query of a whole sequence sees when the sequence is decoded
token by token under the budget (teacher-forced evaluation, LESS training, and the tests' reference
for the engine's incremental cache).

Loops over positions, vectorised over sequences and KV heads: the first ``prompt_len`` queries attend
causally over the whole prompt (the prefill), the prompt is compressed once into a row of slots, and every
later query t first evicts (``decode`` schedule) and then attends over the kept entries and itself. The keep rule
and the scores are the scorer's and :mod:`dmc_train.policies.base`'s, exactly as in the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from dmc_train.policies.base import Entries, Scorer, Step, aggregate, choose_victims, insert, select
from kernels.less import eviction_masks


@dataclass
class PolicyRun:
    """``out [b, H, n, d_v]``; ``evicted_at [b, H_kv, n]`` int64: the step (query position) from which
    entry j is no longer seen (-1: kept to the end). A prompt entry dropped by the compression has
    ``evicted_at = prompt_len``."""

    out: torch.Tensor
    evicted_at: torch.Tensor

    def visible(self) -> torch.Tensor:
        """``[b, H_kv, n, n]`` bool: query t sees entry j."""
        return eviction_masks(self.evicted_at)[0]


def prompt_keep(scorer: Scorer, budget: int, prompt_len: int) -> tuple[int, tuple[int, int]]:
    """Entries a prompt of ``prompt_len`` tokens is compressed to, and the fixed part used for it."""
    c = scorer.cfg
    keep = budget if c.schedule == "decode" else max(1, int(prompt_len * (1 - c.compression_ratio)))
    return min(keep, prompt_len), scorer.fixed(keep)


def compress_prompt(scorer: Scorer, prompt_scores: torch.Tensor, keep: int, fixed: tuple[int, int],
                    num_kv_heads: int) -> torch.Tensor:
    """Slots ``[N, keep]`` of the prompt entries that stay, from ``prompt_scores [N, P]`` (positions = slots)."""
    n_rows, p = prompt_scores.shape
    positions = torch.arange(p, device=prompt_scores.device).expand(n_rows, p)
    if keep >= p:
        return positions
    priority = aggregate(prompt_scores, scorer.cfg.aggregate, num_kv_heads)
    return select(priority, positions, keep, torch.full((n_rows,), p - 1, device=positions.device), *fixed)


@torch.no_grad()
def run_policy(scorer: Scorer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, budget: int, layer: int,
               prompt_len: int = 1, horizon: Optional[int] = None) -> PolicyRun:
    """Attention of ``q [b, H, n, d]`` over ``k [b, H_kv, n, d]``, ``v [b, H_kv, n, d_v]`` (RoPE applied)
    under the policy at ``budget`` entries per (sequence, KV head); ``horizon``: generation length for
    Keyformer's temperature (default ``n - prompt_len``).

    After the prompt, each row holds its kept entries in ``L`` slots, as the engine's cache does (``L``: the
    budget, or with the ``prefill`` schedule the kept prompt plus every decoded token): a decode step attends over
    those slots, not over the whole sequence. A full row's new token takes its victim's slot, any other row's the
    first free one."""
    b, h, n, _ = q.shape
    hk = k.shape[1]
    g, rows = h // hk, b * hk
    p = max(1, min(prompt_len, n))
    dev = q.device
    out = torch.empty(b, h, n, v.shape[-1], dtype=q.dtype, device=dev)
    out[:, :, :p] = F.scaled_dot_product_attention(q[:, :, :p], k[:, :, :p], v[:, :, :p], is_causal=True,
                                                   scale=scorer.scale, enable_gqa=g > 1)
    evicted_at = torch.full((rows, n), -1, dtype=torch.long, device=dev)
    qf, kf, vf = q.float(), k.float().reshape(rows, n, -1), v.float().reshape(rows, n, -1)
    prompt_scores = scorer.prompt_scores(q[:, :, :p], k[:, :, :p], layer).reshape(rows, p)
    keep, fixed = prompt_keep(scorer, budget, p)
    kept = compress_prompt(scorer, prompt_scores, keep, fixed, hk)  # [N, keep] positions, ascending
    evicting = scorer.cfg.schedule == "decode"  # prefill: decoded tokens are appended, nothing more is evicted
    width = max(keep, budget) if evicting else keep + n - p
    width = min(width, keep + n - p)
    entries = Entries(torch.full((rows, width), -1, dtype=torch.long, device=dev),
                      torch.zeros(rows, width, device=dev),
                      None if not scorer.code_bits else torch.zeros(rows, width, -(-scorer.code_bits // 8),
                                                                   dtype=torch.uint8, device=dev))
    entries.positions[:, :keep] = kept
    entries.scores[:, :keep] = prompt_scores.gather(1, kept)
    k_slots, v_slots = kf.new_zeros(rows, width, kf.shape[-1]), vf.new_zeros(rows, width, vf.shape[-1])
    k_slots[:, :keep], v_slots[:, :keep] = kf.gather(1, _per_channel(kept, kf)), vf.gather(1, _per_channel(kept, vf))
    if entries.codes is not None:
        entries.codes[:, :keep] = scorer.codes(k_slots[:, :keep])
    dropped = torch.ones(rows, p, dtype=torch.bool, device=dev)
    dropped.scatter_(1, kept, False)
    evicted_at[:, :p] = torch.where(dropped, p, -1)
    each = torch.arange(rows, device=dev)
    heads = torch.arange(hk, device=dev).repeat(b)
    horizon_t = torch.full((rows,), n - p if horizon is None else horizon, device=dev)
    for t in range(p, n):
        step = Step(layer, heads, torch.full((rows,), t, device=dev), torch.full((rows,), t - p, device=dev),
                    horizon_t, hk)
        q_t = qf[:, :, t].reshape(rows, g, -1)  # [N, G, d]
        slot = entries.valid.sum(-1)  # the first free slot
        if evicting:
            full, victim = choose_victims(scorer, entries, q_t, step, budget)
            r = full.nonzero()[:, 0]
            evicted_at[r, entries.positions[r, victim[r]]] = t
            entries.positions[r, victim[r]] = -1
            slot = torch.where(full, victim, slot)
        insert(scorer, entries, slot, kf[:, t], step.t)
        k_slots[each, slot], v_slots[each, slot] = kf[:, t], vf[:, t]
        valid = entries.valid  # [N, L]
        logits = (q_t @ k_slots.transpose(1, 2)) * scorer.scale  # [N, G, L]
        probs = torch.softmax(logits.masked_fill(~valid[:, None], float("-inf")), dim=-1)
        out[:, :, t] = (probs @ v_slots).reshape(b, h, -1).to(out.dtype)
        if scorer.attention is not None:
            summed = probs.sum(1) if scorer.attention == "probs" else logits.sum(1)
            scorer.update(entries, summed.masked_fill(~valid, 0.0), step)
        else:
            scorer.update(entries, None, step)
    return PolicyRun(out, evicted_at.view(b, hk, n))


def _per_channel(index: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``index [N, m]`` expanded over the channels of ``x [N, n, c]`` for a gather along its token axis."""
    return index[..., None].expand(-1, -1, x.shape[-1])
