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

Public ops (each validates its inputs, then picks an implementation in one place, ``_use_triton``
below, by :mod:`kernels.backend`: Triton for CUDA tensors, PyTorch elsewhere):

- :func:`paged_attention`: decode attention. PyTorch: ``varlen.py`` (rows grouped by page count, one
  batched matmul per group: cost ~ the tokens held plus a page per row); Triton: ``triton_kernels.py``
  (split-K over pages, G query heads per program, log-sum-exp merge); flash-attn's ``flash_attn_with_kvcache``
  (``flash.py``) when it is installed and fits (CUDA, fp16/bf16, page size divisible by 256).
- :func:`paged_write`: store entries at positions of rows (append; an eviction policy's in-place
  overwrite). PyTorch: ``writes.py``.
- :func:`dmc_cache_update`: one DMC decode step per row (merge into the open slot or append) and the
  open slot's normalised state into its page entry. PyTorch: ``writes.py``.

Reference (``reference.py``, re-exported here): :func:`reference_paged_attention` (loop over rows and
tokens).

This package depends on torch only (it sits below ``dmc_train``).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from kernels.backend import get_backend, use_triton

from ._checks import check_paged_inputs
from .flash import flash_fits, paged_attention_flash
from .reference import reference_paged_attention
from .varlen import paged_attention_torch
from .writes import dmc_cache_update_torch, paged_write_torch

__all__ = ["dmc_cache_update", "paged_attention", "paged_write", "reference_paged_attention"]


def _impl(name: str, device: torch.device) -> Callable:
    """The implementation of op ``name`` for tensors on ``device`` (the one dispatch of this family)."""
    if use_triton(device):
        from . import triton_kernels

        return getattr(triton_kernels, f"{name}_triton")
    return {"paged_attention": paged_attention_torch, "paged_write": paged_write_torch,
            "dmc_cache_update": dmc_cache_update_torch}[name]


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
    if get_backend() == "auto" and flash_fits(q, k_pages):
        return paged_attention_flash(q, k_pages, v_pages, block_table, seq_lens, float(scale))
    return _impl("paged_attention", q.device)(q, k_pages, v_pages, block_table, seq_lens, float(scale))


def paged_write(k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: torch.Tensor, rows: torch.Tensor,
                positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store ``k [N, d]``, ``v [N, d_v]`` at entry ``positions [N]`` of ``rows [N]`` (in place).

    The pages must already be assigned in ``block_table``; an existing entry is overwritten (how a
    fixed-budget policy replaces its victim). Values are cast to the pages' dtype.
    """
    if not (rows.shape == positions.shape == k.shape[:1] == v.shape[:1]):
        raise ValueError(f"rows {tuple(rows.shape)}, positions {tuple(positions.shape)}, k {tuple(k.shape)} and "
                         f"v {tuple(v.shape)} must agree on N")
    _impl("paged_write", k_pages.device)(k_pages, v_pages, block_table, rows, positions, k, v)


def dmc_cache_update(k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, rows: torch.Tensor, append: torch.Tensor, omega: torch.Tensor,
                     k: torch.Tensor, v: torch.Tensor, open_k: torch.Tensor, open_v: torch.Tensor,
                     open_w: torch.Tensor, open_tokens: torch.Tensor) -> None:
    """One DMC decode step (Algorithm 1) for ``rows [N]``, in place (see ``writes.py`` for the state layout).

    ``append [N]`` bool (True: close the open slot, start a new one with this token; False: merge it),
    ``omega [N]`` importances, ``k [N, d]``, ``v [N, d_v]``. ``seq_lens`` already counts the step (the
    caller grew appending rows by one and assigned their page); the open slot is entry
    ``seq_lens[row] - 1``. State: ``open_k [rows, ring, d]``, ``open_v [rows, ring, d_v]``,
    ``open_w [rows, ring]`` fp32, ``open_tokens [rows]`` int64; ``ring = 1`` exact, ``ring = w`` window.
    """
    if open_k.dtype != torch.float32 or open_tokens.dtype != torch.int64:
        raise ValueError("the open-slot state must be float32 (open_k/open_v/open_w) and int64 (open_tokens)")
    _impl("dmc_cache_update", k_pages.device)(k_pages, v_pages, block_table, seq_lens, rows, append, omega, k, v,
                                              open_k, open_v, open_w, open_tokens)
