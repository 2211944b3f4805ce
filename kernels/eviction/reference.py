"""The eviction policies' ops in tensor ops (:func:`kernels.eviction.victims`, :func:`kernels.eviction.hamming_sums`
elsewhere than the compiled CPU kernel, and what it is tested against)."""

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


_POPCOUNT = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.int16)


def hamming(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Hamming distance of packed codes ``a [..., nbytes]`` and ``b [..., nbytes]`` (uint8, broadcast) -> ``[...]``."""
    popcount = _POPCOUNT if _POPCOUNT.device == a.device else _POPCOUNT.to(a.device)
    return popcount[(a ^ b).int()].sum(-1)


def hamming_sums_torch(queries: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """:func:`kernels.eviction.hamming_sums` in tensor ops."""
    return hamming(queries[:, :, None], codes[..., None, :, :]).sum(-2, dtype=torch.int32)
