"""The victim choice compiled for the CPU: ``cpu_kernel.c`` (built on first use, :mod:`kernels.compiled`)."""

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
    lib = compiled.load(SOURCE, "the CPU kernel of the eviction policies' victim choice")
    if lib is not None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.victims_f32.argtypes = lib.victims_f32_i32.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64, i64, ptr]
    return lib


def victims_cpu(priority, positions, newest, sink: int, recent: int) -> torch.Tensor:
    """:func:`kernels.eviction.victims` by the compiled kernel (fp32 priority, int64 or int32 positions, int64 newest,
    all contiguous)."""
    *lead, n, length = priority.shape
    out = torch.empty(*lead, n, dtype=torch.int64)
    op = library().victims_f32 if positions.dtype == torch.int64 else library().victims_f32_i32
    op(priority.data_ptr(), positions.data_ptr(), newest.data_ptr(), out.numel() // max(n, 1), n, length, sink, recent,
       out.data_ptr())
    return out
