"""The victim choice and LSH-E's distances (kernels/eviction): the compiled CPU kernel against the tensor ops, edge
cases included."""

import pytest
import torch

from kernels.eviction import cpu, hamming_sums, victims
from kernels.eviction.reference import hamming_sums_torch, victims_torch


def case(lead: tuple, n: int, length: int, seed: int):
    """Random priorities with ties (values on a coarse grid), rows with empty slots, positions distinct per row."""
    g = torch.Generator().manual_seed(seed)
    priority = torch.randint(0, 4, (*lead, n, length), generator=g).float() / 4
    positions = torch.stack([torch.randperm(300, generator=g)[:length] for _ in range(max(1, torch.Size(lead).numel())
                                                                                        * n)])
    positions = positions.view(*lead, n, length)
    positions[..., 0, -3:] = -1  # empty slots
    newest = torch.full((n,), 300, dtype=torch.int64)
    return priority, positions, newest


@pytest.mark.parametrize("lead", [(), (3,)])
@pytest.mark.parametrize("sink, recent", [(0, 0), (4, 0), (4, 32), (0, 400)])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_the_kernel_chooses_what_the_tensor_ops_choose(lead, sink, recent, dtype):
    """int64 or int32 positions (the engine's decode step keeps the cache's int32)."""
    assert cpu.library() is not None, "the eviction kernel did not build (is a C compiler installed?)"
    priority, positions, newest = case(lead, 7, 40, seed=sink + recent)
    positions = positions.to(dtype)
    priority[..., 1, 5] = float("nan")  # a NaN among the ranked: slot 0, as the tensor ops
    got = cpu.victims_cpu(priority, positions, newest, sink, recent)
    assert torch.equal(got, victims_torch(priority, positions, newest, sink, recent))
    assert torch.equal(victims(priority, positions, newest, sink, recent), got)  # what auto runs here
    if recent == 400:  # everything protected: every priority ranks +inf, the oldest (an empty slot first) goes
        assert torch.equal(got[..., 0], torch.full(lead, 37))


def test_other_dtypes_take_the_tensor_ops():
    priority, positions, newest = case((), 5, 16, seed=9)
    got = victims(priority.double(), positions.short(), newest.int(), 2, 4)
    assert torch.equal(got, cpu.victims_cpu(priority, positions, newest, 2, 4))


@pytest.mark.parametrize("lead, nbytes", [((), 2), ((3,), 1), ((2,), 5)])
def test_hamming_sums_kernel_equals_the_tensor_ops_and_popcount(lead, nbytes):
    """LSH-E's distances: the compiled kernel, the tensor ops and a popcount by hand agree."""
    g = torch.Generator().manual_seed(nbytes)
    queries = torch.randint(0, 256, (6, 3, nbytes), generator=g, dtype=torch.uint8)
    codes = torch.randint(0, 256, (*lead, 6, 11, nbytes), generator=g, dtype=torch.uint8)
    got = cpu.hamming_sums_cpu(queries, codes)
    assert got.shape == (*lead, 6, 11) and got.dtype == torch.int32
    assert torch.equal(got, hamming_sums_torch(queries, codes))
    assert torch.equal(hamming_sums(queries, codes), got)  # what auto runs here
    r, j = 4, 7
    by_hand = sum(bin(int(a) ^ int(b)).count("1") for h in range(3)
                  for a, b in zip(queries[r, h], codes[(0,) * len(lead) + (r, j)]))
    assert int(got[(0,) * len(lead) + (r, j)]) == by_hand
    with pytest.raises(ValueError, match="queries must be"):
        hamming_sums(queries[:, 0], codes)
