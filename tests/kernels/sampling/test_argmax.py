"""Greedy sampling (kernels/sampling): the compiled CPU kernel and the blockwise tensor ops give argmax's indices."""

import pytest
import torch

from kernels.sampling import argmax, cpu
from kernels.sampling.reference import argmax_torch


@pytest.mark.parametrize("vocab", [50, 128, 300, 4096])
def test_both_paths_give_argmax(vocab):
    """Ties to the first, across and inside the tensor ops' blocks, NaN first, rows of -inf, a vocabulary that is not a
    whole number of blocks, a sliced (non-contiguous) batch."""
    assert cpu.library() is not None, "the sampling kernel did not build (is a C compiler installed?)"
    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(vocab))
    top = logits.max() + 1
    logits[1, 3] = logits[1, vocab - 1] = top  # a tie across blocks
    logits[2, vocab // 2] = logits[2, vocab // 2 + 1] = top  # a tie inside a block
    logits[3] = float("-inf")
    logits[4, vocab - 2] = float("nan")
    logits[4, 0] = float("inf")
    logits[5] = 0.0
    logits[6, vocab - 1] = top  # the last id
    for x in (logits, logits[:, : vocab - 1]):
        want = x.argmax(-1).tolist()
        assert cpu.argmax_cpu(x).tolist() == want
        assert argmax_torch(x).tolist() == want
        assert argmax(x).tolist() == want  # what auto runs here


def test_other_dtypes_and_bad_shapes():
    logits = torch.randn(3, 200, dtype=torch.float64)
    assert argmax(logits).tolist() == logits.argmax(-1).tolist()
    with pytest.raises(ValueError, match=r"logits must be \[B, V\]"):
        argmax(logits[0])
