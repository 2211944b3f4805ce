"""Greedy sampling: each row's first maximum.

    tokens = argmax(logits)    # [B, V] -> [B] int64: torch.argmax(-1)'s indices (ties to the lowest, NaN as the max)

On CPU for fp32 logits whose rows are contiguous the compiled kernel runs (:mod:`kernels.sampling.cpu`: one call, two
passes over each row); elsewhere the tensor ops (:mod:`kernels.sampling.reference`: a blockwise argmax). In a decode
step the kernel's one call costs what one small tensor op does; the blockwise form is six.
"""

from __future__ import annotations

import torch

from kernels.backend import get_backend

from .cpu import argmax_cpu, library
from .reference import argmax_torch

__all__ = ["argmax"]


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` of ``logits [B, V]`` (int64 ``[B]``; ties and NaN as ``argmax``: the first maximum)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got {tuple(logits.shape)}")
    if (get_backend() == "auto" and logits.is_cpu and logits.dtype == torch.float32 and logits.stride(-1) == 1
            and logits.shape[1] > 0 and library() is not None):
        return argmax_cpu(logits)
    return argmax_torch(logits)
