"""The eviction policies' per-step op: which entry of each row a new token replaces.

    slot = victims(priority, positions, newest, sink, recent)    # [..., N, L] -> [..., N]

Layouts: ``priority [..., N, L]`` (any float; higher stays), ``positions [..., N, L]`` int (the token each slot
holds, -1 empty), ``newest [N]`` int (the incoming token's position, above every entry's); leading dims (e.g. the
layers of a decode step) share ``newest``. The victim is the lowest priority among the entries outside the
protected part (the first ``sink`` positions and, with ``recent > 0``, those above ``newest - recent``; an empty
slot counts as protected), ties to the oldest position. On CPU for fp32 priorities and int64 or int32 positions the
compiled kernel runs (:mod:`kernels.eviction.cpu`), elsewhere the tensor ops (:mod:`kernels.eviction.reference`).
"""

from __future__ import annotations

import torch

from kernels.backend import get_backend

from .cpu import library, victims_cpu
from .reference import victims_torch

__all__ = ["victims"]


def victims(priority: torch.Tensor, positions: torch.Tensor, newest: torch.Tensor, sink: int,
            recent: int) -> torch.Tensor:
    """Slot ``[..., N]`` (int64) of each row's victim (the module's docstring)."""
    if (get_backend() == "auto" and priority.is_cpu and priority.dtype == torch.float32
            and positions.dtype in (torch.int64, torch.int32) and newest.dtype == torch.int64
            and priority.shape == positions.shape
            and priority.dim() >= 2 and newest.shape == priority.shape[-2:-1]
            and priority.is_contiguous() and positions.is_contiguous() and newest.is_contiguous()
            and library() is not None):
        return victims_cpu(priority, positions, newest, int(sink), int(recent))
    return victims_torch(priority, positions, newest, sink, recent)
