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


def flash_fits(q: torch.Tensor, k_pages: torch.Tensor) -> bool:
    return (q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and k_pages.dtype == q.dtype
            and k_pages.shape[1] % 256 == 0 and importlib.util.find_spec("flash_attn") is not None)


def paged_attention_flash(q, k_pages, v_pages, block_table, seq_lens, scale: float) -> torch.Tensor:
    from flash_attn import flash_attn_with_kvcache

    out = flash_attn_with_kvcache(q.unsqueeze(1), k_pages.unsqueeze(2), v_pages.unsqueeze(2),
                                  cache_seqlens=seq_lens.int(), block_table=block_table.clamp(min=0).int(),
                                  softmax_scale=scale, causal=False)
    return out.squeeze(1)
