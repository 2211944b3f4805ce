"""Greedy sampling compiled for the CPU: ``cpu_kernel.c`` (built on first use, :mod:`kernels.compiled`)."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Optional

import torch

from kernels import compiled

SOURCE = Path(__file__).with_name("cpu_kernel.c")


@functools.cache
def library() -> Optional[ctypes.CDLL]:
    """The compiled op, or None (with one warning) when it cannot be built here."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return compiled.load(SOURCE, "the CPU kernel of greedy sampling", {"argmax_f32": [ptr, i64, i64, i64, ptr]})


def argmax_fits(logits: torch.Tensor) -> bool:
    """True when the compiled kernel takes ``logits [B, V]``: CPU, fp32, rows with a unit stride, ``V > 0``."""
    return (logits.is_cpu and logits.dtype == torch.float32 and logits.stride(-1) == 1 and logits.shape[1] > 0
            and library() is not None)


def argmax_cpu(logits: torch.Tensor) -> torch.Tensor:
    """:func:`kernels.sampling.argmax` by the compiled kernel (fp32, rows with a unit stride along the vocabulary)."""
    out = torch.empty(logits.shape[0], dtype=torch.int64, device="cpu")
    library().argmax_f32(logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0), out.data_ptr())
    return out
