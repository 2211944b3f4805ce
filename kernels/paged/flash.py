"""Paged decode attention through flash-attn's ``flash_attn_with_kvcache`` (GPU only, optional).

Every (sequence, KV head) row becomes one "sequence" of flash-attn's batch with a single KV head and
G query heads: ``q [R, 1, G, d]``, pages ``[num_pages, page_size, 1, d]``, ``cache_seqlens = seq_lens``,
``block_table`` as is. flash-attn needs CUDA, fp16/bf16 and a page size divisible by 256; the
dispatch in ``kernels/paged/__init__.py`` uses this path only then (flash-attn cannot be installed on
the project's CPU machines, so it is not exercised by the test suite there).
"""

from __future__ import annotations

import importlib.util

import torch


def flash_takes(device: torch.device, dtype) -> bool:
    """True when flash-attn takes pages of ``dtype`` on ``device`` (CUDA, fp16 / bf16, flash-attn installed)."""
    return (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
            and importlib.util.find_spec("flash_attn") is not None)


def flash_fits(q, k_pages, v_pages, block_table, seq_lens, scale, scores=None, return_lse=False) -> bool:
    """The fit of :func:`kernels.paged.paged_attention`'s inputs: no scores or log-sum-exps, q and the pages of one
    dtype flash-attn takes, pages of a multiple of 256 entries."""
    return (scores is None and not return_lse and k_pages.dtype == q.dtype and k_pages.shape[1] % 256 == 0
            and flash_takes(q.device, q.dtype))


def flash_planned_fits(q, k_pages, v_pages, plan, scale, scores=None, return_lse=False, *_) -> bool:
    """The fit of :func:`kernels.paged.paged_attention_planned`'s inputs (as :func:`flash_fits`)."""
    return flash_fits(q, k_pages, v_pages, None, None, scale, scores, return_lse)


def paged_attention_flash(q, k_pages, v_pages, block_table, seq_lens, scale: float, scores=None,
                          return_lse=False) -> torch.Tensor:
    """:func:`kernels.paged.paged_attention` by flash-attn (:func:`flash_fits`: without scores or log-sum-exps)."""
    from flash_attn import flash_attn_with_kvcache

    out = flash_attn_with_kvcache(q.unsqueeze(1), k_pages.unsqueeze(2), v_pages.unsqueeze(2),
                                  cache_seqlens=seq_lens.int(), block_table=block_table.clamp(min=0).int(),
                                  softmax_scale=scale, causal=False)
    return out.squeeze(1)
