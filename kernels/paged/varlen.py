"""Paged decode attention in plain tensor ops (any device; the path on CPU).

Rows are grouped by the number of pages they use. Each group's pages are gathered into
``[rows, pages * page_size, d]`` and attended with one batched matmul, masking the unused tail of the
last page. The work is therefore the tokens the rows hold plus at most one page per row: it does not
grow with the block table's width (the model's maximum length) nor with the longest row of the batch
(a DMC head that kept 10 slots costs 10, not the 100 of its neighbour). The loop runs over distinct
page counts, at most ``max_pages``.
"""

from __future__ import annotations

import torch

from ._checks import work_dtype


def paged_attention_torch(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """:func:`kernels.paged.paged_attention` on validated inputs (same layouts); ``out [R, G, d_v]`` in q's dtype.

    Written for inference: it runs under autograd (plain tensor ops) but its gradients are not tested.
    """
    R, G, d = q.shape
    page_size, dv = k_pages.shape[1], v_pages.shape[2]
    wd = work_dtype(q)
    lens = seq_lens.long()
    used = (lens + page_size - 1) // page_size
    out = torch.empty(R, G, dv, dtype=q.dtype, device=q.device)
    for n_pages in torch.unique(used).tolist():
        rows = (used == n_pages).nonzero().squeeze(1)
        pages = block_table[rows, :n_pages].long()  # [r, n_pages]
        width = n_pages * page_size
        k = k_pages[pages].reshape(len(rows), width, d).to(wd)
        v = v_pages[pages].reshape(len(rows), width, dv).to(wd)
        scores = (q[rows].to(wd) @ k.transpose(1, 2)) * scale  # [r, G, width]
        tail = torch.arange(width, device=q.device) >= lens[rows, None]  # past the row's last entry
        scores = scores.masked_fill(tail[:, None, :], float("-inf"))
        out[rows] = (torch.softmax(scores, dim=-1) @ v).to(q.dtype)
    return out
