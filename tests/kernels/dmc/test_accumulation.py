"""partial_accumulation (Eq. 9) against the token loop: values, gradients, dtypes, the chunked scans.

Inputs are drawn on CPU and moved to the ``device`` fixture's device (on a GPU the public op runs the
Triton kernels); the token loop runs on CPU."""

import pytest
import torch
from dmc_inputs import hard_alpha, make_inputs, random_vjp

from kernels.dmc import partial_accumulation, reference_partial_accumulation


@pytest.mark.parametrize(
    "mode, kwargs",
    [("exact", {"chunk": 32}), ("exact", {"chunk": 4}), ("exact", {"chunk": 2}), ("window", {"window": 1}),
     ("window", {"window": 5}), ("window", {"window": 100})],
)
@pytest.mark.parametrize("alpha_kind", ["soft", "hard", "near_one"])
def test_partial_accumulation_matches_loop(device, mode, kwargs, alpha_kind):
    _, k, v, omega, gen = make_inputs(b=2, hk=2, n=23, d=4, dv=3, dtype=torch.float64, seed=8)
    if alpha_kind == "soft":
        alpha = torch.rand(k.shape[:3], generator=gen, dtype=torch.float64) * 0.98 + 0.01
    elif alpha_kind == "hard":
        alpha = hard_alpha(k.shape[:3], gen).double()
    else:
        alpha = 1 - torch.rand(k.shape[:3], generator=gen, dtype=torch.float64) * 1e-3
    inputs = [t.to(device, copy=True).requires_grad_() for t in (k, v, alpha, omega)]
    ref_inputs = [t.clone().requires_grad_() for t in (k, v, alpha, omega)]
    got = partial_accumulation(*inputs, mode=mode, **kwargs)
    ref = reference_partial_accumulation(*ref_inputs, window=kwargs.get("window"))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.cpu(), b)
    got_grads = [g.cpu() for g in random_vjp([o.cpu() for o in got], inputs)]
    for name, a, b in zip("k v alpha omega".split(), got_grads, random_vjp(ref, ref_inputs)):
        torch.testing.assert_close(a, b, msg=lambda m: f"d/d{name}: {m}")
        if name == "alpha":
            assert (a[..., 0] == 0).all()  # alpha_0 is forced to 0


def test_partial_accumulation_fp32_and_dtypes(device):
    _, k, v, omega, gen = make_inputs(b=1, hk=2, n=300, d=8, seed=9)
    alpha = torch.rand(k.shape[:3], generator=gen)
    ref = reference_partial_accumulation(k.double(), v.double(), alpha.double(), omega.double())
    k, v, alpha, omega = (t.to(device) for t in (k, v, alpha, omega))
    got = partial_accumulation(k, v, alpha, omega, chunk=16)  # three levels of chunking
    assert got[0].dtype == torch.float32
    torch.testing.assert_close(got[0].cpu().double(), ref[0], atol=1e-5, rtol=1e-5)
    for mode in ("exact", "window"):
        inputs = [t.bfloat16().requires_grad_() for t in (k, v, alpha, omega)]
        bf = partial_accumulation(*inputs, mode=mode)
        assert bf[0].dtype == torch.bfloat16 and bf[1].dtype == torch.bfloat16
        (bf[0].float().sum() + bf[1].float().sum()).backward()
        assert all(t.grad.dtype == torch.bfloat16 for t in inputs)
        torch.testing.assert_close(bf[0].float(), got[0], atol=0.05, rtol=0.05)


@pytest.mark.parametrize("n, chunk", [(1, 4), (7, 8), (37, 4), (100, 3), (64, 8), (300, 16)])
def test_chunked_scans_match_loops(device, n, chunk):
    """The exact-mode scan and its adjoint (several levels of chunking, hard 0 / 1 gates included)."""
    from kernels.dmc.accumulation import _linear_scan, _linear_scan_reverse

    gen = torch.Generator().manual_seed(n)
    a = torch.rand(2, n, generator=gen, dtype=torch.float64)
    a[0, ::chunk] = 0  # hard appends on chunk boundaries
    a[1, ::5] = 1
    x = torch.randn(2, n, 3, generator=gen, dtype=torch.float64)
    fwd, rev = torch.zeros_like(x), torch.zeros_like(x)
    h = torch.zeros(2, 3, dtype=torch.float64)
    for i in range(n):  # h_i = a_i h_{i-1} + x_i
        h = a[:, i, None] * h + x[:, i]
        fwd[:, i] = h
    g = torch.zeros(2, 3, dtype=torch.float64)
    for i in reversed(range(n)):  # g_i = x_i + a_{i+1} g_{i+1}
        g = x[:, i] + (a[:, i + 1, None] * g if i + 1 < n else 0)
        rev[:, i] = g
    a, x = a.to(device), x.to(device)
    torch.testing.assert_close(_linear_scan(a, x, chunk).cpu(), fwd)
    torch.testing.assert_close(_linear_scan_reverse(a, x, chunk).cpu(), rev)


def test_partial_accumulation_gradcheck(device):
    _, k, v, omega, gen = make_inputs(b=1, hk=2, n=7, d=3, dv=2, dtype=torch.float64, seed=10)
    alpha = torch.rand(k.shape[:3], generator=gen, dtype=torch.float64) * 0.9 + 0.05
    inputs = [t.to(device, copy=True).requires_grad_() for t in (k, v, alpha, omega)]
    assert torch.autograd.gradcheck(lambda *x: partial_accumulation(*x, mode="exact", chunk=2), inputs)
    assert torch.autograd.gradcheck(lambda *x: partial_accumulation(*x, mode="window", window=3), inputs)


def test_window_and_exact_agree_iff_segments_fit(device):
    w = 5
    _, k, v, omega, gen = make_inputs(b=2, hk=3, n=50, seed=4)
    fits = hard_alpha(k.shape[:3], gen, p=0.75, max_segment=w)
    k, v, omega, fits = (t.to(device) for t in (k, v, omega, fits))
    for a, b in zip(
        partial_accumulation(k, v, fits, omega, mode="window", window=w),
        partial_accumulation(k, v, fits, omega, mode="exact", chunk=16),
    ):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    too_long = fits.clone()
    too_long[1, 2, 20 : 20 + w] = 1
    win, _ = partial_accumulation(k, v, too_long, omega, mode="window", window=w)
    exact, _ = partial_accumulation(k, v, too_long, omega, mode="exact")
    assert (win - exact).abs().max() > 1e-3
    assert (win[:, :, :20] - exact[:, :, :20]).abs().max() < 1e-5  # only the long segment differs
