"""The plain form of paged decode attention that the tests trust: a Python loop over rows and tokens.

Layouts as in :func:`kernels.paged.paged_attention`: q ``[R, G, d]``, k_pages ``[num_pages, page_size, d]``,
v_pages ``[num_pages, page_size, d_v]``, block_table ``[R, max_pages]``, seq_lens ``[R]``.
"""

from __future__ import annotations

import math

import torch

from ._checks import check_paged_inputs, work_dtype


def reference_paged_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Reference for :func:`kernels.paged.paged_attention`: for each row r, collect its ``seq_lens[r]``
    tokens one by one (token i at ``k_pages[block_table[r, i // page_size], i % page_size]``), then
    ``softmax(q[r] K^T * scale) V``. Same layouts, dtypes and precision (float32, float64 stays float64);
    ``out [R, G, d_v]`` in q's dtype. Tests and small inputs only.
    """
    check_paged_inputs(q, k_pages, v_pages, block_table, seq_lens)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    wd = work_dtype(q)
    page_size = k_pages.shape[1]
    out = torch.empty(q.shape[0], q.shape[1], v_pages.shape[2], dtype=wd, device=q.device)
    for r in range(q.shape[0]):
        keys, values = [], []
        for i in range(int(seq_lens[r])):
            page, slot = int(block_table[r, i // page_size]), i % page_size
            keys.append(k_pages[page, slot])
            values.append(v_pages[page, slot])
        k, v = torch.stack(keys).to(wd), torch.stack(values).to(wd)
        weights = torch.softmax(q[r].to(wd) @ k.T * scale, dim=-1)  # [G, n]
        out[r] = weights @ v
    return out.to(q.dtype)
