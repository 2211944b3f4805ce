"""The public DMC ops pick the Triton kernels when the backend says so (CUDA, or forced here under the
interpreter), the PyTorch paths otherwise, with the same results."""

import pytest
import torch

from kernels import backend
from kernels.dmc import OPS, dmc_attention, partial_accumulation
from tests.helpers import TRITON_RUNS

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not TRITON_RUNS, reason="needs a GPU or TRITON_INTERPRET=1 on CPU")


def run_ops(name: str, device: torch.device):
    backend.set_backend(name)
    try:
        g = torch.Generator().manual_seed(0)
        k, v = torch.randn(1, 2, 9, 16, generator=g), torch.randn(1, 2, 9, 16, generator=g)
        q = torch.randn(1, 4, 9, 16, generator=g)
        alpha, omega = torch.rand(1, 2, 9, generator=g), torch.rand(1, 2, 9, generator=g) + 0.1
        k, v, alpha, omega = (x.to(device) for x in (k, v, alpha, omega))
        q = q.to(device).requires_grad_()
        k_t, v_t = partial_accumulation(k, v, alpha, omega, mode="window", window=3)
        out = dmc_attention(q, k_t, v_t, alpha, free_channel=15)
        (grad,) = torch.autograd.grad(out.sum(), q)
        return k_t, out, grad
    finally:
        backend.set_backend("auto")


def test_forced_triton_backend_gives_the_pytorch_results(device):
    for a, b in zip(run_ops("torch", device), run_ops("triton", device)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_backend_switch_validates(device):
    with pytest.raises(ValueError, match="backend must be one of auto, torch, triton, flash, cpu_compiled"):
        backend.set_backend("cuda")
    # auto: Triton for CUDA tensors (the accumulation's kernels there), the PyTorch scan for CPU tensors
    on_cuda = device.type == "cuda"
    k = torch.zeros(1, 1, 2, 4, device=device)
    alpha = torch.zeros(1, 1, 2, device=device)
    picked = OPS["partial_accumulation"].pick(k, k, alpha, alpha, "exact", 12, 32)
    assert (picked.backend == "triton") == on_cuda
