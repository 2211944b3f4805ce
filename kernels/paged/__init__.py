"""Paged decode attention: one query token per row against a KV cache stored in fixed-size pages.

A *row* is one (sequence, KV head). Its cached keys / values live in pages shared by all rows, and its
row of the block table lists which pages hold them, in order (the layout of vLLM, FlashInfer and
flash-attn's ``flash_attn_with_kvcache``):

- q ``[R, G, d]``: the decode query of the row's G query heads (GQA: G query heads read one KV head).
- k_pages ``[num_pages, page_size, d]``, v_pages ``[num_pages, page_size, d_v]``.
- block_table ``[R, max_pages]`` int32 / int64: token i of row r is at
  ``k_pages[block_table[r, i // page_size], i % page_size]`` (same for v). Entries past the pages a
  row uses are ignored (may hold -1); so are the slots of its last page past ``seq_lens[r]``.
- seq_lens ``[R]`` int32 / int64: cached tokens of each row, ``1 <= seq_lens[r] <= max_pages * page_size``.

Every cached token is visible to the decode query (no causal mask). Rows may be ragged and their
pages in any order.

Public op: :func:`paged_attention` validates its inputs (``_checks.py``), then dispatches by device in
one place, ``_paged_impl`` below. Today the PyTorch implementation (``varlen.py``: flattened tokens,
segment softmax, cost proportional to the tokens cached) runs on every device; a Triton kernel for
CUDA tensors will be added beside it and chosen by the same dispatch.

Reference (``reference.py``, re-exported here): :func:`reference_paged_attention` (loop over rows and
tokens).

This package depends on torch only (it sits below ``dmc_train``).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from ._checks import check_paged_inputs
from .reference import reference_paged_attention
from .varlen import paged_attention_torch

__all__ = ["paged_attention", "reference_paged_attention"]


def _paged_impl(device: torch.device) -> Callable:
    """The implementation of :func:`paged_attention` for tensors on ``device``.

    Today the PyTorch implementation on every device; a Triton kernel for CUDA tensors will be chosen here.
    """
    return paged_attention_torch


def paged_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Decode attention of one query token per row over the row's paged KV cache.

    Args:
        q: queries ``[R, G, d]``; row r is one (sequence, KV head), its G query heads share that KV head.
        k_pages: key pages ``[num_pages, page_size, d]``.
        v_pages: value pages ``[num_pages, page_size, d_v]``.
        block_table: ``[R, max_pages]`` int32 / int64; token i of row r is in page
            ``block_table[r, i // page_size]`` at slot ``i % page_size``. Entries past the row's used
            pages are ignored; the used ones must be in ``[0, num_pages)``.
        seq_lens: ``[R]`` int32 / int64, cached tokens per row, in ``[1, max_pages * page_size]``.
        scale: score scale, default ``1 / sqrt(d)``.

    Returns:
        ``out [R, G, d_v]`` in q's dtype: ``softmax(q[r] K_r^T * scale) V_r`` over the row's
        ``seq_lens[r]`` cached tokens; computed in float32 (float64 stays float64). Inference only
        (gradients untested). Validation reads ``seq_lens`` and ``block_table`` on the host.
    """
    check_paged_inputs(q, k_pages, v_pages, block_table, seq_lens)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return _paged_impl(q.device)(q, k_pages, v_pages, block_table, seq_lens, float(scale))
