"""Paged decode attention in plain tensor ops (any device; the path on CPU).

Rows are sorted by the number of pages they use and cut into at most ``GROUPS`` groups of about equal
size, as many as pay for themselves (:func:`row_groups`). Each group's pages are gathered into
``[rows, pages * page_size, d]`` (pages = the group's largest count) and attended with one batched
matmul, masking each row's unused tail. The work is the tokens the rows hold plus the padding inside a
group: it does not grow with the block table's width (the model's maximum length) nor, when padding
costs more than a group, with the longest row of the batch (a DMC head that kept 10 slots is not padded
to the 100 of another group). Few groups keep the Python loop short: a decode step of a small model on
CPU is bound by per-call overhead.

The groups, their page ids and tail masks depend on the block table and lengths only: :func:`plan_decode`
computes them once (:class:`DecodePlan`, optionally for several layers' block tables at once) and
:func:`attend_planned` gathers and attends; :func:`paged_attention_torch` is the two in a row. When every row
uses the same pages (one group, rows in order) the outputs are the group's, with no scatter.

With ``scores`` the group's ``[rows, G, width]`` logits (or softmax probabilities) of that same
matmul are summed over G into the rows of ``s [R, L]`` (``L = max(seq_lens)``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ._checks import as_dtype, pack_outputs, work_dtype

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


@dataclass
class RowGroup:
    """Rows attended together: ``rows [r]`` (their indices among the plan's R; None: all R, in order), the pages
    they read ``pages [..., r, n_pages]`` int64 (a shorter row's unused entries clamped to page 0, masked), and
    ``tail [r, 1, n_pages * page_size]`` bool: the slots past each row's last entry."""

    rows: Optional[torch.Tensor]
    pages: torch.Tensor
    tail: torch.Tensor


@dataclass
class DecodePlan:
    """What paged decode attention needs beside q and the pages' contents (vLLM's attention metadata): built
    once from a block table and lengths, reused by every call on them. ``pages`` of each group may carry
    leading dims (e.g. ``[layers, ...]``: several layers whose rows hold equal lengths share one plan, and a
    call picks one with ``index``). ``max_len``: the longest row (the width of the scores); ``block_table``
    and ``lens``: what the plan was built from; ``groups`` None: a plan for a kernel that reads the block table
    itself (only the table, the lengths and ``max_len``, then a bound on the rows that the caller knew, or None:
    a kernel that needs the scores' width reads the longest row)."""

    rows: int
    max_len: Optional[int]
    lens: torch.Tensor
    groups: Optional[list[RowGroup]]
    block_table: torch.Tensor


def plan_decode(block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int, page_bytes: int) -> DecodePlan:
    """The :class:`DecodePlan` of rows with lengths ``seq_lens [R]`` and block table ``[..., R, max_pages]``
    (``page_bytes``: bytes of a K page plus a V page, which sets the row groups: :func:`row_groups`)."""
    lens = as_dtype(seq_lens, torch.int64)
    R = lens.shape[0]
    shortest, L = (int(t) for t in torch.aminmax(lens)) if R else (0, 0)
    n_max = -(-L // page_size)
    used = None
    if R and -(-shortest // page_size) == n_max:
        parts = [None]
    else:
        used = (lens + (page_size - 1)) // page_size
        parts = row_groups(used, page_bytes)
    if len(parts) == 1:  # one group: its rows in order (no gather of q, no scatter of the outputs)
        parts = [None]
    groups = []
    for rows in parts:
        if rows is None:
            n_pages, pages, group_lens = n_max, block_table[..., :n_max], lens
        else:
            n_pages = int(used[rows].max())
            pages, group_lens = block_table.index_select(-2, rows)[..., :n_pages], lens[rows]
        # [r, 1, n_pages * page_size]: past each row's last entry
        tail = torch.arange(n_pages * page_size, device=lens.device) >= group_lens[:, None, None]
        groups.append(RowGroup(rows, as_dtype(pages, torch.int64).clamp(min=0), tail))
    return DecodePlan(R, L, lens, groups, block_table)


def _attend_group(q, k_pages, v_pages, g: RowGroup, scale: float, max_len: int, scores, return_lse: bool, index):
    """One group's ``(out [r, G, d_v], s [r, min(width, L)] or None, lse [r, G] or None)``."""
    r, width = g.tail.shape[0], g.tail.shape[2]
    d, dv, wd = q.shape[2], v_pages.shape[2], work_dtype(q)
    pages = (g.pages if index is None else g.pages[index]).flatten()
    # index_select copies whole pages (memcpy); k_pages[pages] computes an offset per element, ~7x slower on CPU
    k = as_dtype(k_pages.index_select(0, pages).view(r, width, d), wd)
    v = as_dtype(v_pages.index_select(0, pages).view(r, width, dv), wd)
    logits = torch.bmm(as_dtype(q if g.rows is None else q[g.rows], wd), k.transpose(1, 2)) * scale  # [r, G, width]
    s = logits.sum(1).masked_fill(g.tail[:, 0], 0.0)[:, :max_len].float() if scores == "logits" else None
    logits = logits.masked_fill(g.tail, float("-inf"))
    lse = logits.logsumexp(-1).float() if return_lse else None
    probs = torch.softmax(logits, dim=-1)
    if scores == "probs":
        s = probs.sum(1)[:, :max_len].float()  # the tail's probabilities are 0
    return as_dtype(torch.bmm(probs, v), q.dtype), s, lse


def attend_planned(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, plan: DecodePlan, scale: float,
                   scores: str | None = None, return_lse: bool = False, index: int | None = None):
    """:func:`paged_attention_torch` over a :class:`DecodePlan` (its groups' pages ``[index]`` when they have a
    leading dim): the same outputs, without recomputing the plan."""
    parts = [_attend_group(q, k_pages, v_pages, g, scale, plan.max_len, scores, return_lse, index)
             for g in plan.groups]
    if len(plan.groups) == 1 and plan.groups[0].rows is None:  # every row, in order: no scatter
        return pack_outputs(*parts[0])
    R, G, _ = q.shape
    out = torch.empty(R, G, v_pages.shape[2], dtype=q.dtype, device=q.device)
    s = torch.zeros(R, plan.max_len, dtype=torch.float32, device=q.device) if scores is not None else None
    lse = torch.empty(R, G, dtype=torch.float32, device=q.device) if return_lse else None
    for g, (out_g, s_g, lse_g) in zip(plan.groups, parts):
        out[g.rows] = out_g
        if s is not None:
            s[g.rows, : s_g.shape[1]] = s_g
        if lse is not None:
            lse[g.rows] = lse_g
    return pack_outputs(out, s, lse)


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
    page_bytes = k_pages.shape[1] * (q.shape[2] + v_pages.shape[2]) * k_pages.element_size()
    plan = plan_decode(block_table, seq_lens, k_pages.shape[1], page_bytes)
    return attend_planned(q, k_pages, v_pages, plan, scale, scores=scores, return_lse=return_lse)
