"""The eviction policies' per-step ops: which entry of each row a new token replaces, and LSH-E's distances.

    slot = victims(priority, positions, newest, sink, recent)    # [..., N, L] -> [..., N]
    dist = hamming_sums(query_codes, codes)                      # [N, G, nbytes], [..., N, L, nbytes] -> [..., N, L]
    dist = hamming(a, b)                                         # [..., nbytes] (broadcast) -> [...]: tensor ops

Layouts: ``priority [..., N, L]`` (any float; higher stays), ``positions [..., N, L]`` int (the token each slot
holds, -1 empty), ``newest [N]`` int (the incoming token's position, above every entry's); leading dims (e.g. the
layers of a decode step) share ``newest``. The victim is the lowest priority among the entries outside the
protected part (the first ``sink`` positions and, with ``recent > 0``, those above ``newest - recent``; an empty
slot counts as protected), ties to the oldest position. Under the ``cpu_compiled`` backend
(:mod:`kernels.backend`; the table ``OPS`` below), for CPU fp32 priorities and int64 or int32 positions (uint8 codes),
the compiled kernel runs (:mod:`kernels.eviction.cpu`); elsewhere the tensor ops (:mod:`kernels.eviction.reference`).
A backend adds its implementation of an op by a row in ``OPS`` (``docs/DESIGN.md``, "Adding a backend").
"""

from __future__ import annotations

import torch

from kernels.backend import Impl, Op

from .cpu import hamming_sums_cpu, hamming_sums_fits, victims_cpu, victims_fits
from .reference import hamming, hamming_sums_torch, victims_torch

__all__ = ["OPS", "hamming", "hamming_sums", "victims"]

# Which backend takes which inputs (kernels.backend)
OPS = {
    "victims": Op({
        "cpu_compiled": Impl(victims_cpu, fits=victims_fits),
        "torch": Impl(victims_torch),
    }),
    "hamming_sums": Op({
        "cpu_compiled": Impl(hamming_sums_cpu, fits=hamming_sums_fits),
        "torch": Impl(hamming_sums_torch),
    }),
}


def victims(priority: torch.Tensor, positions: torch.Tensor, newest: torch.Tensor, sink: int,
            recent: int) -> torch.Tensor:
    """Slot ``[..., N]`` (int64) of each row's victim (the module's docstring)."""
    return OPS["victims"](priority, positions, newest, int(sink), int(recent))


def hamming_sums(queries: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """``[..., N, L]`` int32: for each row and entry, the Hamming distance between the entry's packed code and each of
    the row's G query codes, summed over the G (LSH-E's distance). ``queries [N, G, nbytes]``, ``codes [..., N, L,
    nbytes]`` uint8 (leading dims, e.g. the layers of a step, share the queries)."""
    if (queries.dim() != 3 or codes.dim() < 3 or codes.shape[-3] != queries.shape[0]
            or codes.shape[-1] != queries.shape[-1]):
        raise ValueError(f"queries must be [N, G, nbytes] and codes [..., N, L, nbytes], got {tuple(queries.shape)} "
                         f"and {tuple(codes.shape)}")
    return OPS["hamming_sums"](queries, codes)
