"""The plain forms of the paged ops that the tests trust: Python loops over rows, tokens and queries.

- :func:`reference_paged_attention`: layouts as in :func:`kernels.paged.paged_attention`: q ``[R, G, d]``,
  k_pages ``[num_pages, page_size, d]``, v_pages ``[num_pages, page_size, d_v]``, block_table
  ``[R, max_pages]``, seq_lens ``[R]``; with ``scores`` also ``s [R, max(seq_lens)]``.
- :func:`reference_attention_column_sums`: layouts as in :func:`kernels.paged.attention_column_sums`:
  q ``[b, H, n, d]``, k ``[b, H_kv, n, d]`` -> ``[b, H_kv, n]``.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from ._checks import check_column_sum_inputs, check_paged_inputs, check_scores, pack_outputs, work_dtype


def reference_paged_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    scores: str | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Reference for :func:`kernels.paged.paged_attention`: for each row r, collect its ``seq_lens[r]``
    tokens one by one (token i at ``k_pages[block_table[r, i // page_size], i % page_size]``), then
    ``softmax(q[r] K^T * scale) V``. Same layouts, dtypes and precision (float32, float64 stays float64);
    ``out [R, G, d_v]`` in q's dtype. With ``scores`` ("probs" / "logits") also ``s [R, max(seq_lens)]``
    float32: per entry, the softmax weights (or the logits ``q K^T * scale``) summed over the G heads,
    0 past the row's length. Tests and small inputs only.
    """
    check_scores(scores)
    check_paged_inputs(q, k_pages, v_pages, block_table, seq_lens)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    wd = work_dtype(q)
    page_size = k_pages.shape[1]
    out = torch.empty(q.shape[0], q.shape[1], v_pages.shape[2], dtype=wd, device=q.device)
    L = int(seq_lens.max()) if q.shape[0] else 0
    s = torch.zeros(q.shape[0], L, dtype=torch.float32, device=q.device)
    lse = torch.zeros(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
    for r in range(q.shape[0]):
        keys, values = [], []
        for i in range(int(seq_lens[r])):
            page, slot = int(block_table[r, i // page_size]), i % page_size
            keys.append(k_pages[page, slot])
            values.append(v_pages[page, slot])
        k, v = torch.stack(keys).to(wd), torch.stack(values).to(wd)
        logits = q[r].to(wd) @ k.T * scale  # [G, n]
        weights = torch.softmax(logits, dim=-1)
        lse[r] = logits.logsumexp(-1).float()
        out[r] = weights @ v
        for i in range(k.shape[0]):
            s[r, i] = (weights if scores == "probs" else logits)[:, i].sum()
    return pack_outputs(out.to(q.dtype), s if scores is not None else None, lse if return_lse else None)


def reference_attention_column_sums(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    tau: float = 1.0,
    noise: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Reference for :func:`kernels.paged.attention_column_sums`: one query at a time. For query i of
    head h (KV head ``h // G``) the causal weights ``softmax_j((q_i . k_j * scale + noise_ij) / tau)``,
    j <= i, are added to columns ``0..i`` of that KV head; ``noise`` is called per query with
    ``(tensor([i]), arange(i + 1))``. ``[b, H_kv, n]`` float32 (computed in float32). Tests only.
    """
    check_column_sum_inputs(q, k, tau, 1)
    b, H, n, _ = q.shape
    G = H // k.shape[1]
    qf, kf = q.float(), k.float()
    out = torch.zeros(b, k.shape[1], n, dtype=torch.float32, device=q.device)
    for i in range(n):
        pos = torch.arange(i + 1, device=q.device)
        extra = 0.0 if noise is None else torch.broadcast_to(noise(pos[i:], pos).float(), (b, H, 1, i + 1))
        for h in range(H):
            logits = (kf[:, h // G, : i + 1] @ qf[:, h, i, :, None])[..., 0] * scale  # [b, i + 1]
            if noise is not None:
                logits = logits + extra[:, h, 0]
            out[:, h // G, : i + 1] += torch.softmax(logits / tau, dim=-1)
    return out
