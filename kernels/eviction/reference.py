"""The eviction policies' victim choice in tensor ops (:func:`kernels.eviction.victims` elsewhere than the
compiled CPU kernel, and what it is tested against)."""

from __future__ import annotations

import torch


def victims_torch(priority: torch.Tensor, positions: torch.Tensor, newest: torch.Tensor, sink: int,
                  recent: int) -> torch.Tensor:
    """:func:`kernels.eviction.victims` in tensor ops."""
    # protected | ~valid in fewer calls: an empty slot (position -1) is below any sink count >= 0, and no entry
    # is newer than the incoming token (so without a recent window nothing more is protected)
    keep = positions < sink
    if recent:
        keep |= positions > (newest - recent)[:, None]
    ranked = priority.masked_fill(keep, float("inf"))
    not_lowest = ranked != ranked.amin(-1, keepdim=True)
    return positions.masked_fill(not_lowest, torch.iinfo(positions.dtype).max).argmin(-1)
