"""Paged decode attention in plain tensor ops over the flattened cached tokens (any device).

All rows' tokens are laid end to end, ``T = sum(seq_lens)`` of them: token t belongs to row
``row[t]`` at in-row position ``pos[t]``, and its key / value is gathered from the pages. Scores
``[T, G]`` go through a segment softmax per row (segment max, exp, segment sum) and the weighted values
are summed per row. Time and memory are O(T G (d + d_v)), independent of ``max_pages`` and of how
uneven the rows are (no padding to the longest row).
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
    R, G, _ = q.shape
    page_size, dv = k_pages.shape[1], v_pages.shape[2]
    wd = work_dtype(q)
    device = q.device
    lens = seq_lens.long()
    T = int(lens.sum())
    rows = torch.arange(R, device=device)
    row = torch.repeat_interleave(rows, lens, output_size=T)  # [T]
    starts = torch.cumsum(lens, 0) - lens
    pos = torch.arange(T, device=device) - starts[row]  # [T]
    page = block_table[row, pos // page_size].long()
    slot = pos % page_size
    k = k_pages[page, slot].to(wd)  # [T, d]
    v = v_pages[page, slot].to(wd)  # [T, d_v]

    scores = (q.to(wd)[row] @ k[:, :, None]).squeeze(-1) * scale  # [T, G]
    row_g = row[:, None].expand(T, G)
    m = torch.full((R, G), float("-inf"), dtype=wd, device=device)
    m = m.scatter_reduce(0, row_g, scores, "amax", include_self=True)  # [R, G]
    p = torch.exp(scores - m[row])  # [T, G], the row's max token contributes exp(0) = 1
    denom = torch.zeros(R, G, dtype=wd, device=device).index_add_(0, row, p)  # >= 1 (seq_lens >= 1)
    out = torch.zeros(R, G, dv, dtype=wd, device=device).index_add_(0, row, p[:, :, None] * v[:, None, :])
    return (out / denom[:, :, None]).to(q.dtype)
