"""Greedy sampling: each row's first maximum.

    tokens = argmax(logits)    # [B, V] -> [B] int64: torch.argmax(-1)'s indices (ties to the lowest, NaN as the max)

Under the ``cpu_compiled`` backend (:mod:`kernels.backend`; the table ``OPS`` below), for fp32 CPU logits whose rows
are contiguous, the compiled kernel runs (:mod:`kernels.sampling.cpu`: one call, two passes over each row);
elsewhere the tensor ops (:mod:`kernels.sampling.reference`: a blockwise argmax). In a decode step the kernel's one
call costs what one small tensor op does; the blockwise form is six. A backend adds its implementation of an op by a
row in ``OPS`` (``docs/DESIGN.md``, "Adding a backend").
"""

from __future__ import annotations

import torch

from kernels.backend import Impl, Op

from .cpu import argmax_cpu, argmax_fits
from .reference import argmax_torch

__all__ = ["OPS", "argmax"]

# Which backend takes which inputs (kernels.backend)
OPS = {
    "argmax": Op({
        "cpu_compiled": Impl(argmax_cpu, fits=argmax_fits),
        "torch": Impl(argmax_torch),
    }),
}


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` of ``logits [B, V]`` (int64 ``[B]``; ties and NaN as ``argmax``: the first maximum)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got {tuple(logits.shape)}")
    return OPS["argmax"](logits)
