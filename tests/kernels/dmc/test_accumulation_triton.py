"""The Triton partial accumulation (Eq. 9) against the token loop: compiled on a GPU (``DMC_TEST_DEVICE=cuda``),
under the interpreter on CPU tensors otherwise. Inputs are drawn on CPU and moved to the ``device`` fixture's
device; the float64 reference runs on CPU."""

import pytest
import torch

pytest.importorskip("triton")

from dmc_inputs import make_inputs  # noqa: E402

from kernels.dmc import reference_partial_accumulation  # noqa: E402
from kernels.dmc.accumulation_triton import partial_accumulation_triton  # noqa: E402
from tests.helpers import TRITON_RUNS  # noqa: E402

pytestmark = pytest.mark.skipif(not TRITON_RUNS, reason="needs a GPU or TRITON_INTERPRET=1 on CPU")

MODES = [("exact", None), ("window", 1), ("window", 3), ("window", 12)]


def make_alpha(kind, shape, gen):
    if kind == "append":
        return torch.zeros(shape)
    if kind == "accumulate":  # alpha_0 = 1 too: it must be ignored
        return torch.ones(shape)
    if kind == "alternating":
        return (torch.arange(shape[-1]) % 2).float().expand(shape).contiguous()
    return torch.rand(shape, generator=gen)


def run(fn, inputs, seed=3):
    """Outputs of ``fn(*inputs)`` and the gradients of a fixed random projection of them (float64 draws)."""
    out = fn(*inputs)
    gen = torch.Generator().manual_seed(seed)
    ups = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device, o.dtype) for o in out]
    loss = sum((o * u).sum() for o, u in zip(out, ups))
    return out, torch.autograd.grad(loss, inputs, materialize_grads=True)  # the reference may not read alpha


def check_against_reference(device, k, v, alpha, omega, mode, window, block=None, tol=1e-5):
    """Triton (inputs as given, on ``device``) vs the token loop in float64 on CPU: values and d/dk, d/dv,
    d/dalpha, d/domega."""
    inputs = [t.to(device, copy=True).requires_grad_() for t in (k, v, alpha, omega)]
    out, grads = run(lambda *x: partial_accumulation_triton(*x, mode, window or 12, 32, block=block), inputs)
    ref_inputs = [t.detach().double().requires_grad_() for t in (k, v, alpha, omega)]
    ref_out, ref_grads = run(lambda *x: reference_partial_accumulation(*x, window=window), ref_inputs)
    # domega_j = <G_j, [k_j, v_j, 1]> cancels (to 0 when alpha = 0): its error scales with the terms
    g_k, g_v = (g / ref_inputs[3].detach()[..., None] for g in ref_grads[:2])  # G = dk / omega (same for v)
    terms = (g_k * ref_inputs[0]).abs().sum(-1) + (g_v * ref_inputs[1]).abs().sum(-1)
    names = ["k~", "v~", "dk", "dv", "dalpha", "domega"]
    for name, got, ref, like in zip(names, (*out, *grads), (*ref_out, *ref_grads), (k, v, k, v, alpha, omega)):
        assert got.dtype == like.dtype
        scale = max(1.0, ref.abs().max().item(), 2 * terms.max().item() if name == "domega" else 0.0)
        torch.testing.assert_close(got.cpu().double(), ref, rtol=tol, atol=tol * scale, msg=lambda m: f"{name}: {m}")
    assert (grads[2][..., 0] == 0).all()  # alpha_0 is forced to 0


@pytest.mark.parametrize("n", [1, 2, 17])
@pytest.mark.parametrize("alpha_kind", ["append", "accumulate", "alternating", "random"])
@pytest.mark.parametrize("mode, window", MODES, ids=["exact", "window1", "window3", "window12"])
def test_matches_reference_fp32(device, mode, window, alpha_kind, n):
    """d = d_v = 64 in one channel block of 128 (the k / v boundary inside the block); n = 17 spans two
    token tiles of 16. One sequence and head: the interpreter runs each program's scans in Python, and batch
    and head indexing are checked by the tests below (b = 2, hk = 2)."""
    _, k, v, omega, gen = make_inputs(b=1, hk=1, n=n, d=64, dv=64, seed=n)
    alpha = make_alpha(alpha_kind, k.shape[:3], gen)
    check_against_reference(device, k, v, alpha, omega, mode, window, block=128)


@pytest.mark.parametrize("mode, window", [("exact", None), ("window", 4)])
def test_several_channel_blocks(device, mode, window):
    """d = 128, d_v = 64 over several channel blocks (default sizes: 16 channels in exact mode for so few
    heads, 64 in window mode): dalpha / domega summed across blocks."""
    _, k, v, omega, gen = make_inputs(b=1, hk=1, n=9, d=128, dv=64, seed=5)
    alpha = torch.rand(k.shape[:3], generator=gen)
    check_against_reference(device, k, v, alpha, omega, mode, window)


@pytest.mark.parametrize("n", [70, 130])
@pytest.mark.parametrize("mode, window", [("exact", None), ("window", 3), ("window", 12)],
                         ids=["exact", "window3", "window12"])
def test_several_token_tiles(device, mode, window, n):
    """Three token tiles (32 or 64 tokens), the last one partial: the state carried from tile to tile (exact)
    and windows reaching into the previous tile; hard 0 / 1 decisions among soft ones, some on tile edges."""
    _, k, v, omega, gen = make_inputs(b=1, hk=2, n=n, d=24, dv=8, seed=n)
    alpha = torch.rand(k.shape[:3], generator=gen)
    alpha[0, 0, ::5] = 0
    alpha[0, 1, 20:50] = 1  # one segment across the first tile edge
    alpha[0, 1, 63:66] = 0
    check_against_reference(device, k, v, alpha, omega, mode, window)


@pytest.mark.parametrize("mode, window", [("exact", None), ("window", 3)])
def test_float64_and_partial_grads(device, mode, window):
    """float64 runs in float64 (tight match); an unused output (v~) gives a None upstream gradient."""
    _, k, v, omega, gen = make_inputs(b=2, hk=2, n=7, d=5, dv=3, dtype=torch.float64, seed=6)
    alpha = torch.rand(k.shape[:3], generator=gen, dtype=torch.float64)
    check_against_reference(device, k, v, alpha, omega, mode, window, tol=1e-12)
    inputs = [t.to(device, copy=True).requires_grad_() for t in (k, v, alpha, omega)]
    got = torch.autograd.grad(partial_accumulation_triton(*inputs, mode, window or 12, 32)[0].sum(), inputs)
    ref_inputs = [t.clone().requires_grad_() for t in (k, v, alpha, omega)]
    ref_k = reference_partial_accumulation(*ref_inputs, window=window)[0]
    ref = torch.autograd.grad(ref_k.sum(), ref_inputs, allow_unused=True)
    assert ref[1] is None and (got[1] == 0).all()
    for i in (0, 2, 3):
        torch.testing.assert_close(got[i].cpu(), ref[i], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode, window", [("exact", None), ("window", 3)])
def test_bfloat16(device, mode, window):
    """bf16 k / v (non-contiguous) with fp32 alpha / omega: outputs and gradients in the input dtypes."""
    _, k, v, omega, gen = make_inputs(b=2, hk=2, n=17, d=16, dv=16, seed=7)
    alpha = torch.rand(k.shape[:3], generator=gen)
    k_bf = k.bfloat16().to(device).transpose(0, 1).contiguous().transpose(0, 1)  # non-contiguous view, same values
    inputs = [t.to(device).requires_grad_() for t in (k_bf, v.bfloat16(), alpha, omega)]
    out, grads = run(lambda *x: partial_accumulation_triton(*x, mode, window or 12, 32), inputs)
    assert [t.dtype for t in (*out, *grads)] == [torch.bfloat16] * 4 + [torch.float32] * 2
    ref_inputs = [t.detach().cpu().double().requires_grad_() for t in inputs]
    ref_out, ref_grads = run(lambda *x: reference_partial_accumulation(*x, window=window), ref_inputs)
    for got, ref in zip(out, ref_out):
        torch.testing.assert_close(got.cpu().double(), ref, rtol=2e-2, atol=2e-2)
    for got, ref in zip(grads, ref_grads):  # dalpha uses the saved bf16 k~, v~ (as the PyTorch path)
        torch.testing.assert_close(got.cpu().double(), ref, rtol=5e-2, atol=5e-2 * ref.abs().max().item())
