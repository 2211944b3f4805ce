"""Paged decode attention in plain tensor ops (any device; the path on CPU).

Rows are sorted by the number of pages they use and cut into at most ``GROUPS`` groups of about equal
size, as many as pay for themselves (:func:`row_groups`). Each group's pages are gathered into
``[rows, pages * page_size, d]`` (pages = the group's largest count) and attended with one batched
matmul, masking each row's unused tail. The work is the tokens the rows hold plus the padding inside a
group: it does not grow with the block table's width (the model's maximum length) nor, when padding
costs more than a group, with the longest row of the batch (a DMC head that kept 10 slots is not padded
to the 100 of another group). Few groups keep the Python loop short: a decode step of a small model on
CPU is bound by per-call overhead.

With ``scores`` the group's ``[rows, G, width]`` logits (or softmax probabilities) of that same
matmul are summed over G into the rows of ``s [R, L]`` (``L = max(seq_lens)``).
"""

from __future__ import annotations

import torch

from ._checks import pack_outputs, work_dtype

GROUPS = 4
# What one more group costs, in bytes of padding it would have to save: its ~25 tensor calls take about as
# long on CPU as gathering and attending over 1 MB of pages (a decode step of a small model is bound by calls)
GROUP_COST_BYTES = 1 << 20


def row_groups(used: torch.Tensor, page_bytes: int) -> tuple[torch.Tensor, ...]:
    """Rows ``[R]`` cut into groups by pages used (ascending): the number of groups (<= ``GROUPS``) whose
    padded pages plus ``GROUP_COST_BYTES`` per group cost least. One group when the rows use equal pages."""
    order = used.argsort()
    counts = used[order].tolist()
    costs = []
    for k in range(1, min(GROUPS, len(set(counts))) + 1):
        size, extra = divmod(len(counts), k)  # tensor_split's parts: the first ``extra`` one row longer
        ends = [i * size + min(i, extra) for i in range(1, k + 1)]
        padded = sum((end - start) * counts[end - 1] for start, end in zip([0] + ends[:-1], ends))
        costs.append(padded * page_bytes + k * GROUP_COST_BYTES)
    return order.tensor_split(costs.index(min(costs)) + 1) if counts else ()


def paged_attention_torch(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    scores: str | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """:func:`kernels.paged.paged_attention` on validated inputs (same layouts); ``out [R, G, d_v]`` in q's dtype,
    then ``s [R, L] fp32`` when ``scores`` is ``"probs"`` / ``"logits"`` and ``lse [R, G] fp32`` with ``return_lse``.

    Written for inference: it runs under autograd (plain tensor ops) but its gradients are not tested.
    """
    R, G, d = q.shape
    page_size, dv = k_pages.shape[1], v_pages.shape[2]
    wd = work_dtype(q)
    lens = seq_lens.long()
    used = (lens + page_size - 1) // page_size
    out = torch.empty(R, G, dv, dtype=q.dtype, device=q.device)
    L = int(lens.max()) if R else 0
    s = torch.zeros(R, L, dtype=torch.float32, device=q.device) if scores is not None else None
    lse = torch.empty(R, G, dtype=torch.float32, device=q.device) if return_lse else None
    page_bytes = page_size * (d + dv) * k_pages.element_size()
    for rows in row_groups(used, page_bytes):
        n_pages = int(used[rows].max())
        # [r, n_pages]; a shorter row's unused entries (-1 or stale) read any page, masked below
        pages = block_table[rows, :n_pages].long().clamp(min=0)
        width = n_pages * page_size
        # index_select copies whole pages (memcpy); k_pages[pages] computes an offset per element, ~7x slower on CPU
        k = k_pages.index_select(0, pages.flatten()).view(len(rows), width, d).to(wd)
        v = v_pages.index_select(0, pages.flatten()).view(len(rows), width, dv).to(wd)
        logits = (q[rows].to(wd) @ k.transpose(1, 2)) * scale  # [r, G, width]
        tail = torch.arange(width, device=q.device) >= lens[rows, None]  # past the row's last entry
        if scores == "logits":
            s[rows, : min(width, L)] = logits.sum(1).masked_fill(tail, 0.0)[:, :L].float()
        logits = logits.masked_fill(tail[:, None, :], float("-inf"))
        if return_lse:
            lse[rows] = logits.logsumexp(-1).float()
        probs = torch.softmax(logits, dim=-1)
        if scores == "probs":
            s[rows, : min(width, L)] = probs.sum(1)[:, :L].float()  # the tail's probabilities are 0
        out[rows] = (probs @ v).to(q.dtype)
    return pack_outputs(out, s, lse)

