"""DMC ops: partial accumulation (Eq. 9), training attention (Fig. 3), inference simulation (Alg. 1)."""

import math
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dmc_train.methods.dmc_ops import (
    DMCHeadCache,
    dense_dmc_attention,
    dmc_attention,
    partial_accumulation,
    reference_partial_accumulation,
    simulate_dmc_inference,
)


def _inputs(b=2, hk=2, G=1, n=20, d=8, dv=None, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hk * G, n, d, generator=gen, dtype=dtype)
    k = torch.randn(b, hk, n, d, generator=gen, dtype=dtype)
    v = torch.randn(b, hk, n, dv or d, generator=gen, dtype=dtype)
    omega = torch.rand(b, hk, n, generator=gen, dtype=dtype) * 0.9 + 0.1
    return q, k, v, omega, gen


def _hard_alpha(shape, gen, p=0.6, max_segment=None):
    """Random {0, 1} decisions, first token appends; optionally no segment longer than max_segment."""
    alpha = (torch.rand(shape, generator=gen) < p).float()
    alpha[..., 0] = 0
    if max_segment is not None:
        run = torch.zeros(shape[:-1])
        for t in range(shape[-1]):
            run = torch.where(alpha[..., t] == 1, run + 1, torch.ones_like(run))
            too_long = run > max_segment
            alpha[..., t][too_long] = 0
            run = torch.where(too_long, torch.ones_like(run), run)
    return alpha


def _longest_segment(alpha):
    longest, run = 0, torch.zeros(alpha.shape[:-1])
    for t in range(alpha.shape[-1]):
        run = torch.where((alpha[..., t] == 1) & (torch.tensor(t) > 0), run + 1, torch.ones_like(run))
        longest = max(longest, int(run.max()))
    return longest


# ------------------------------------------------------------------------------------------------
# Training path with hard decisions == Algorithm 1
# ------------------------------------------------------------------------------------------------


IMPLS = ["fused_cpu", "blocked"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("G", [1, 2])
@pytest.mark.parametrize("seed", [0, 1])
def test_hard_training_equals_inference_simulation(G, seed, impl):
    q, k, v, omega, gen = _inputs(b=2, hk=2, G=G, n=29, d=8, dv=6, seed=seed)
    alpha = _hard_alpha(k.shape[:3], gen)
    alpha[..., 0] = 1  # ignored: the first token always appends
    expected, lengths = simulate_dmc_inference(q, k, v, alpha, omega)

    k_t, v_t = partial_accumulation(k, v, alpha, omega, mode="exact", chunk=8)
    out = dmc_attention(q, k_t, v_t, alpha, block=8, key_block=8, impl=impl)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)

    a = alpha.clone()
    a[..., 0] = 0
    torch.testing.assert_close(lengths[..., -1], (1 - a).sum(-1).long())  # l = sum_t (1 - alpha_t)


def test_window_mode_matches_inference_iff_segments_fit():
    w = 4
    q, k, v, omega, gen = _inputs(b=2, hk=2, G=2, n=40, seed=3)
    fits = _hard_alpha(k.shape[:3], gen, p=0.7, max_segment=w)
    assert _longest_segment(fits) == w
    expected, _ = simulate_dmc_inference(q, k, v, fits, omega)
    out = dmc_attention(q, *partial_accumulation(k, v, fits, omega, mode="window", window=w), fits, block=16)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)

    too_long = fits.clone()
    too_long[0, 0, 10 : 10 + w + 2] = 1  # a segment of at least w + 3 tokens
    expected, _ = simulate_dmc_inference(q, k, v, too_long, omega)
    out = dmc_attention(q, *partial_accumulation(k, v, too_long, omega, mode="window", window=w), too_long)
    assert (out - expected).abs().max() > 1e-3
    exact = dmc_attention(q, *partial_accumulation(k, v, too_long, omega, mode="exact"), too_long)
    torch.testing.assert_close(exact, expected, atol=1e-5, rtol=0)


def test_window_and_exact_agree_iff_segments_fit():
    w = 5
    _, k, v, omega, gen = _inputs(b=2, hk=3, n=50, seed=4)
    fits = _hard_alpha(k.shape[:3], gen, p=0.75, max_segment=w)
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


def test_paper_worked_example_cache_growth():
    """alphas (a1..a5) = (1, 1, 0, 1, 0): [k0] -> [k01] -> [k012] -> [k012, k3] -> [k012, k34] -> [k012, k34, k5]."""
    q, k, v, omega, _ = _inputs(b=1, hk=1, n=6, d=4, seed=5)
    alpha = torch.tensor([[[0.0, 1, 1, 0, 1, 0]]])
    _, lengths, caches = simulate_dmc_inference(q, k, v, alpha, omega, return_caches=True)
    assert lengths[0, 0].tolist() == [1, 1, 1, 2, 2, 3]

    def avg(x, idx):
        w = omega[0, 0, idx]
        return (w[:, None] * x[0, 0, idx]).sum(0) / w.sum()

    k64, v64 = k.double(), v.double()
    expected_steps = [[[0]], [[0, 1]], [[0, 1, 2]], [[0, 1, 2], [3]], [[0, 1, 2], [3, 4]], [[0, 1, 2], [3, 4], [5]]]
    cache = DMCHeadCache()
    for t, slots in enumerate(expected_steps):
        cache.update(k64[0, 0, t], v64[0, 0, t], float(alpha[0, 0, t]), omega[0, 0, t].double())
        assert len(cache) == len(slots)
        for got_k, got_v, idx in zip(cache.keys, cache.values, slots):
            torch.testing.assert_close(got_k, avg(k64, idx))
            torch.testing.assert_close(got_v, avg(v64, idx))
    final = caches[0][0]
    for got, other in zip(final.keys, cache.keys):
        torch.testing.assert_close(got, other)
    # The training states at the ends of the segments (2, 4, 5) are the final cache slots.
    k_t, v_t = partial_accumulation(k, v, alpha, omega)
    torch.testing.assert_close(k_t[0, 0, [2, 4, 5]].double(), torch.stack(final.keys), atol=1e-6, rtol=0)
    torch.testing.assert_close(v_t[0, 0, [2, 4, 5]].double(), torch.stack(final.values), atol=1e-6, rtol=0)


# ------------------------------------------------------------------------------------------------
# partial_accumulation vs the token loop: values and gradients
# ------------------------------------------------------------------------------------------------


def _grads(out, inputs, seed=7):
    gen = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() for o in out)
    return torch.autograd.grad(loss, inputs, materialize_grads=True)  # window=1 never reads alpha


@pytest.mark.parametrize(
    "mode, kwargs",
    [("exact", {"chunk": 32}), ("exact", {"chunk": 4}), ("exact", {"chunk": 2}), ("window", {"window": 1}),
     ("window", {"window": 5}), ("window", {"window": 100})],
)
@pytest.mark.parametrize("alpha_kind", ["soft", "hard", "near_one"])
def test_partial_accumulation_matches_loop(mode, kwargs, alpha_kind):
    _, k, v, omega, gen = _inputs(b=2, hk=2, n=23, d=4, dv=3, dtype=torch.float64, seed=8)
    if alpha_kind == "soft":
        alpha = torch.rand(k.shape[:3], generator=gen, dtype=torch.float64) * 0.98 + 0.01
    elif alpha_kind == "hard":
        alpha = _hard_alpha(k.shape[:3], gen).double()
    else:
        alpha = 1 - torch.rand(k.shape[:3], generator=gen, dtype=torch.float64) * 1e-3
    inputs = [t.clone().requires_grad_() for t in (k, v, alpha, omega)]
    got = partial_accumulation(*inputs, mode=mode, **kwargs)
    ref = reference_partial_accumulation(*inputs, window=kwargs.get("window"))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)
    for name, a, b in zip("k v alpha omega".split(), _grads(got, inputs), _grads(ref, inputs)):
        torch.testing.assert_close(a, b, msg=lambda m: f"d/d{name}: {m}")
        if name == "alpha":
            assert (a[..., 0] == 0).all()  # alpha_0 is forced to 0


def test_partial_accumulation_fp32_and_dtypes():
    _, k, v, omega, gen = _inputs(b=1, hk=2, n=300, d=8, seed=9)
    alpha = torch.rand(k.shape[:3], generator=gen)
    ref = reference_partial_accumulation(k.double(), v.double(), alpha.double(), omega.double())
    got = partial_accumulation(k, v, alpha, omega, chunk=16)  # three levels of chunking
    assert got[0].dtype == torch.float32
    torch.testing.assert_close(got[0].double(), ref[0], atol=1e-5, rtol=1e-5)
    for mode in ("exact", "window"):
        inputs = [t.bfloat16().requires_grad_() for t in (k, v, alpha, omega)]
        bf = partial_accumulation(*inputs, mode=mode)
        assert bf[0].dtype == torch.bfloat16 and bf[1].dtype == torch.bfloat16
        (bf[0].float().sum() + bf[1].float().sum()).backward()
        assert all(t.grad.dtype == torch.bfloat16 for t in inputs)
        torch.testing.assert_close(bf[0].float(), got[0], atol=0.05, rtol=0.05)


@pytest.mark.parametrize("n, chunk", [(1, 4), (7, 8), (37, 4), (100, 3), (64, 8), (300, 16)])
def test_chunked_scans_match_loops(n, chunk):
    """The exact-mode scan and its adjoint (several levels of chunking, hard 0 / 1 gates included)."""
    from dmc_train.methods.dmc_ops.accumulation import _linear_scan, _linear_scan_reverse

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
    torch.testing.assert_close(_linear_scan(a, x, chunk), fwd)
    torch.testing.assert_close(_linear_scan_reverse(a, x, chunk), rev)


def test_partial_accumulation_gradcheck():
    _, k, v, omega, gen = _inputs(b=1, hk=2, n=7, d=3, dv=2, dtype=torch.float64, seed=10)
    alpha = torch.rand(k.shape[:3], generator=gen, dtype=torch.float64) * 0.9 + 0.05
    inputs = [t.clone().requires_grad_() for t in (k, v, alpha, omega)]
    assert torch.autograd.gradcheck(lambda *x: partial_accumulation(*x, mode="exact", chunk=2), inputs)
    assert torch.autograd.gradcheck(lambda *x: partial_accumulation(*x, mode="window", window=3), inputs)


# ------------------------------------------------------------------------------------------------
# dmc_attention vs the dense Fig. 3 reference
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n, G, block, key_block, alpha_kind",
    [
        (37, 1, 8, 8, "soft"),  # n not a multiple of the block, several key ranges
        (37, 2, 8, 16, "soft"),  # GQA
        (40, 2, 16, 1024, "soft"),  # one key range
        (1, 2, 128, 1024, "soft"),  # a single token
        (25, 1, 4, 8, "append"),  # alpha = 0: plain causal attention
        (25, 2, 8, 4, "near_one"),  # nearly all accumulate
        (25, 2, 8, 8, "hard"),  # -inf bias entries
    ],
)
@pytest.mark.parametrize("impl", IMPLS)
def test_dmc_attention_matches_dense(n, G, block, key_block, alpha_kind, impl):
    q, k, v, _, gen = _inputs(b=2, hk=2, G=G, n=n, d=8, dv=5, seed=11)
    shape = k.shape[:3]
    alpha = {
        "soft": lambda: torch.rand(shape, generator=gen),
        "append": lambda: torch.zeros(shape),
        "near_one": lambda: 1 - torch.rand(shape, generator=gen) * 1e-3,
        "hard": lambda: _hard_alpha(shape, gen),
    }[alpha_kind]()
    inputs = [t.clone().requires_grad_() for t in (q, k, v, alpha)]
    out = dmc_attention(*inputs, block=block, key_block=key_block, impl=impl)
    ref = dense_dmc_attention(*inputs)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    if alpha_kind == "append":
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), is_causal=True)
        torch.testing.assert_close(out, sdpa, atol=1e-5, rtol=1e-5)
    got_grads, ref_grads = _grads([out], inputs), _grads([ref], inputs)
    for name, a, b in zip("q k v alpha".split(), got_grads, ref_grads):
        if name == "alpha" and alpha_kind == "hard":
            continue  # the dense reference gives 0 at alpha = 1; see test_dmc_attention_alpha_grad_at_one
        torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4, msg=lambda m: f"d/d{name}: {m}")
    assert torch.isfinite(got_grads[3]).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_dmc_attention_alpha_grad_at_one(impl):
    """At hard alpha = 1 the gradient is the one-sided derivative (finite), = the limit alpha -> 1."""
    q, k, v, _, gen = _inputs(b=1, hk=2, G=2, n=19, d=4, dtype=torch.float64, seed=12)
    alpha = _hard_alpha(k.shape[:3], gen).double()
    hard = alpha.clone().requires_grad_()
    near = (alpha * (1 - 1e-10)).requires_grad_()
    out = dmc_attention(q, k, v, hard, block=4, key_block=8, impl=impl)
    ref = dense_dmc_attention(q, k, v, near)
    torch.testing.assert_close(out, ref, atol=1e-8, rtol=0)
    got, = _grads([out], [hard])
    want, = _grads([ref], [near])
    torch.testing.assert_close(got, want, atol=1e-7, rtol=1e-6)
    assert got[alpha == 1].abs().max() > 0


def test_dmc_attention_gradcheck():
    q, k, v, _, gen = _inputs(b=1, hk=2, G=2, n=6, d=3, dv=2, dtype=torch.float64, seed=13)
    alpha = torch.rand(k.shape[:3], generator=gen, dtype=torch.float64) * 0.9 + 0.05
    inputs = [t.clone().requires_grad_() for t in (q, k, v, alpha)]
    for kwargs in (
        {"block": 2, "key_block": 2, "impl": "blocked"},
        {"scale": 0.7, "block": 4, "key_block": 1, "impl": "blocked"},
        {"impl": "fused_cpu"},
        {"scale": 0.7, "free_channel": 1, "impl": "fused_cpu"},
    ):
        assert torch.autograd.gradcheck(lambda *x: dmc_attention(*x, **kwargs), inputs), kwargs


@pytest.mark.parametrize("impl", IMPLS)
def test_dmc_attention_free_channel_is_ignored(impl):
    """free_channel (DMC's decision channel) takes no part in attention, whatever it holds."""
    q, k, v, _, gen = _inputs(b=2, hk=2, G=2, n=21, d=8, seed=17)
    alpha = torch.rand(k.shape[:3], generator=gen)
    inputs = [t.clone().requires_grad_() for t in (q, k, v, alpha)]
    out = dmc_attention(*inputs, free_channel=7, block=8, key_block=8, impl=impl)
    zeroed = [inputs[0].index_fill(-1, torch.tensor([7]), 0), inputs[1].index_fill(-1, torch.tensor([7]), 0)]
    ref = dense_dmc_attention(*zeroed, *inputs[2:])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    got_grads, ref_grads = _grads([out], inputs), _grads([ref], inputs)
    for name, a, b in zip("q k v alpha".split(), got_grads, ref_grads):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4, msg=lambda m: f"d/d{name}: {m}")
    assert (got_grads[0][..., 7] == 0).all() and (got_grads[1][..., 7] == 0).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_dmc_attention_extreme_scores_stay_finite(impl):
    """Score gaps of hundreds of nats, also on invisible keys (alpha = 1): no inf / NaN anywhere."""
    q, k, v, _, gen = _inputs(b=1, hk=1, n=12, d=4, dtype=torch.float32, seed=18)
    k[0, 0, 3] = 0
    k[0, 0, 3, 0] = 40.0  # key 3 outscores everything by ~q[0] * 40 * scale
    q[0, 0, :, 0] = 30.0
    alpha = torch.rand(k.shape[:3], generator=gen) * 0.5
    alpha[0, 0, 4] = 1.0  # ... and is invisible from query 4 on
    inputs = [t.clone().requires_grad_() for t in (q, k, v, alpha)]
    out = dmc_attention(*inputs, scale=1.0, block=4, key_block=4, impl=impl)
    ref = dense_dmc_attention(*inputs, scale=1.0)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    got_grads, ref_grads = _grads([out], inputs), _grads([ref], inputs)
    for a in got_grads:
        assert torch.isfinite(a).all()
    for name, a, b in zip("q k v".split(), got_grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-4, msg=lambda m: f"d/d{name}: {m}")


@pytest.mark.parametrize("impl", IMPLS)
def test_dmc_attention_bf16_returns_input_dtype(impl):
    q, k, v, _, gen = _inputs(b=1, hk=1, n=9, d=8, seed=14)
    alpha = torch.rand(k.shape[:3], generator=gen)
    inputs = [t.bfloat16().requires_grad_() for t in (q, k, v, alpha)]
    out = dmc_attention(*inputs, impl=impl)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert all(t.grad.dtype == torch.bfloat16 for t in inputs)
    torch.testing.assert_close(out.float(), dense_dmc_attention(q, k, v, alpha), atol=3e-2, rtol=3e-2)


class _MaxNumel(TorchDispatchMode):
    """Records the largest tensor produced by any aten op."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in result if isinstance(result, (tuple, list)) else [result]:
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return result


@pytest.mark.parametrize("impl", IMPLS)
def test_dmc_attention_never_allocates_n_by_n(impl):
    """No tensor created by any aten op (Python-visible) has n*n/4 elements or more."""
    n, d = 2048, 16
    q, k, v, _, gen = _inputs(b=1, hk=1, n=n, d=d, seed=15)
    alpha = torch.rand(k.shape[:3], generator=gen)
    inputs = [t.clone().requires_grad_() for t in (q, k, v, alpha)]
    with _MaxNumel() as mode:
        out = dmc_attention(*inputs, impl=impl)
        out.sum().backward()
    assert all(t.grad is not None for t in inputs)
    assert mode.max_numel < n * n / 4, mode.max_numel
    with _MaxNumel() as mode:  # the accumulation is O(n (d + chunk)) as well
        k_t, v_t = partial_accumulation(*inputs[1:3], inputs[3], torch.ones_like(alpha))
        (k_t.sum() + v_t.sum()).backward()
    assert mode.max_numel < n * n / 4, mode.max_numel


def _peak_rss_growth(fn) -> float:
    """Bytes by which the resident set peaks above its level before ``fn()`` (Linux: VmHWM reset)."""

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    before = status("VmRSS")
    fn()
    return status("VmHWM") - before


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux /proc/self/clear_refs")
def test_dmc_attention_peak_memory_is_linear():
    """Includes allocations inside the fused kernels, which a dispatch mode does not see. At n = 4096
    an n x n float32 tensor is 64 MiB; forward + backward must stay far below that."""
    n, d = 4096, 16
    q, k, v, _, gen = _inputs(b=1, hk=1, n=n, d=d, seed=19)
    alpha = torch.rand(k.shape[:3], generator=gen)
    inputs = [t.clone().requires_grad_() for t in (q, k, v, alpha)]
    assert _peak_rss_growth(lambda: torch.ones(n, n).add_(1)) > 0.9 * n * n * 4  # the probe sees n x n
    for impl in IMPLS:
        for t in inputs:
            t.grad = None

        def step():
            dmc_attention(*inputs, impl=impl).sum().backward()

        step()  # warm up thread pools and caches
        for t in inputs:
            t.grad = None
        growth = _peak_rss_growth(step)
        assert growth < n * n * 4 / 4, (impl, growth)


# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------


def test_invalid_inputs_raise():
    q, k, v, omega, _ = _inputs(b=1, hk=2, G=1, n=5, d=4, seed=16)
    alpha = torch.zeros(k.shape[:3])
    with pytest.raises(ValueError, match="window"):
        partial_accumulation(k, v, alpha, omega, mode="window", window=0)
    with pytest.raises(ValueError, match="mode must be one of exact, window"):
        partial_accumulation(k, v, alpha, omega, mode="sliding")
    with pytest.raises(ValueError, match="alpha"):
        partial_accumulation(k, v, alpha[..., :-1], omega)
    with pytest.raises(ValueError, match="omega"):
        partial_accumulation(k, v, alpha, omega[:, :1])
    with pytest.raises(ValueError, match=r"\[b, h_kv, n\]"):
        partial_accumulation(k, v[:, :, :-1], alpha, omega)
    with pytest.raises(ValueError, match="chunk"):
        partial_accumulation(k, v, alpha, omega, chunk=0)
    q3 = torch.randn(1, 3, 5, 4)
    with pytest.raises(ValueError, match=r"query heads \(3\) must be a multiple of KV heads \(2\)"):
        dmc_attention(q3, k, v, alpha)
    with pytest.raises(ValueError, match="alpha"):
        dmc_attention(q, k, v, alpha[:, :1])
    with pytest.raises(ValueError, match="block"):
        dmc_attention(q, k, v, alpha, block=0)
    with pytest.raises(ValueError, match="layout"):
        dmc_attention(q[0], k, v, alpha)
    with pytest.raises(ValueError, match="free_channel"):
        dmc_attention(q, k, v, alpha, free_channel=4)
    with pytest.raises(ValueError, match="impl must be one of auto, fused_cpu, blocked"):
        dmc_attention(q, k, v, alpha, impl="flex")
    with pytest.raises(ValueError, match="only 0 and 1"):
        simulate_dmc_inference(q, k, v, alpha + 0.5, omega)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        simulate_dmc_inference(q3, k, v, alpha, omega)


def test_dense_bias_is_fig3():
    alpha = torch.tensor([[[0.0, 0.5, 1.0, 0.25]]])
    from dmc_train.methods.dmc_ops import dmc_attention_bias

    inf = math.inf
    expected = torch.tensor([
        [0, -inf, -inf, -inf],
        [math.log(0.5), 0, -inf, -inf],
        [math.log(0.5), -inf, 0, -inf],
        [math.log(0.5), -inf, math.log(0.75), 0],
    ])
    torch.testing.assert_close(dmc_attention_bias(alpha)[0, 0], expected)
