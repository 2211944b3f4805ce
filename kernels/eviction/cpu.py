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
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    victims = [ptr, ptr, ptr, i64, i64, i64, i64, i64, ptr]
    return compiled.load(SOURCE, "the CPU kernel of the eviction policies' victim choice",
                         {"victims_f32": victims, "victims_f32_i32": victims,
                          "hamming_sums_u8": [ptr, ptr, i64, i64, i64, i64, i64, ptr]})


def victims_fits(priority, positions, newest, sink, recent) -> bool:
    """True when the compiled kernel takes :func:`kernels.eviction.victims`' inputs: CPU fp32 priorities, int64 or
    int32 positions of the same shape, int64 ``newest`` of the rows, all contiguous."""
    return (priority.is_cpu and priority.dtype == torch.float32 and positions.dtype in (torch.int64, torch.int32)
            and newest.dtype == torch.int64 and priority.shape == positions.shape
            and priority.dim() >= 2 and newest.shape == priority.shape[-2:-1]
            and priority.is_contiguous() and positions.is_contiguous() and newest.is_contiguous()
            and library() is not None)


def hamming_sums_fits(queries, codes) -> bool:
    """True when the compiled kernel takes :func:`kernels.eviction.hamming_sums`' inputs: CPU uint8, contiguous."""
    return (queries.is_cpu and codes.is_cpu and queries.dtype == codes.dtype == torch.uint8
            and queries.is_contiguous() and codes.is_contiguous() and library() is not None)


def hamming_sums_cpu(queries: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """:func:`kernels.eviction.hamming_sums` by the compiled kernel (uint8, contiguous)."""
    *lead, n, length, nbytes = codes.shape
    out = torch.empty(*lead, n, length, dtype=torch.int32, device="cpu")
    library().hamming_sums_u8(queries.data_ptr(), codes.data_ptr(), out.numel() // max(n * length, 1), n,
                              queries.shape[1], length, nbytes, out.data_ptr())
    return out


def victims_cpu(priority, positions, newest, sink: int, recent: int) -> torch.Tensor:
    """:func:`kernels.eviction.victims` by the compiled kernel (fp32 priority, int64 or int32 positions, int64 newest,
    all contiguous)."""
    *lead, n, length = priority.shape
    out = torch.empty(*lead, n, dtype=torch.int64, device="cpu")
    op = library().victims_f32 if positions.dtype == torch.int64 else library().victims_f32_i32
    op(priority.data_ptr(), positions.data_ptr(), newest.data_ptr(), out.numel() // max(n, 1), n, length, sink, recent,
       out.data_ptr())
    return out
