"""DMC ops: partial accumulation (Eq. 9), training attention (Fig. 3), inference simulation (Alg. 1)."""

import math

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


@pytest.mark.parametrize("G", [1, 2])
@pytest.mark.parametrize("seed", [0, 1])
def test_hard_training_equals_inference_simulation(G, seed):
    q, k, v, omega, gen = _inputs(b=2, hk=2, G=G, n=29, d=8, dv=6, seed=seed)
    alpha = _hard_alpha(k.shape[:3], gen)
    alpha[..., 0] = 1  # ignored: the first token always appends
    expected, lengths = simulate_dmc_inference(q, k, v, alpha, omega)

    k_t, v_t = partial_accumulation(k, v, alpha, omega, mode="exact", chunk=8)
    out = dmc_attention(q, k_t, v_t, alpha, block=8, key_block=8)
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
    too_long[0, 0, 10 : 10 + w + 2] = 1  # one segment of w + 3 tokens
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
    [("exact", {"chunk": 64}), ("exact", {"chunk": 4}), ("exact", {"chunk": 2}), ("window", {"window": 1}),
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
    bf = partial_accumulation(k.bfloat16(), v.bfloat16(), alpha, omega)
    assert bf[0].dtype == torch.bfloat16 and bf[1].dtype == torch.bfloat16


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
def test_dmc_attention_matches_dense(n, G, block, key_block, alpha_kind):
    q, k, v, _, gen = _inputs(b=2, hk=2, G=G, n=n, d=8, dv=5, seed=11)
    shape = k.shape[:3]
    alpha = {
        "soft": lambda: torch.rand(shape, generator=gen),
        "append": lambda: torch.zeros(shape),
        "near_one": lambda: 1 - torch.rand(shape, generator=gen) * 1e-3,
        "hard": lambda: _hard_alpha(shape, gen),
    }[alpha_kind]()
    inputs = [t.clone().requires_grad_() for t in (q, k, v, alpha)]
    out = dmc_attention(*inputs, block=block, key_block=key_block)
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


def test_dmc_attention_alpha_grad_at_one():
    """At hard alpha = 1 the gradient is the one-sided derivative (finite), = the limit alpha -> 1."""
    q, k, v, _, gen = _inputs(b=1, hk=2, G=2, n=19, d=4, dtype=torch.float64, seed=12)
    alpha = _hard_alpha(k.shape[:3], gen).double()
    hard = alpha.clone().requires_grad_()
    near = (alpha * (1 - 1e-10)).requires_grad_()
    out = dmc_attention(q, k, v, hard, block=4, key_block=8)
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
    assert torch.autograd.gradcheck(lambda *x: dmc_attention(*x, block=2, key_block=2), inputs)
    assert torch.autograd.gradcheck(lambda *x: dmc_attention(*x, scale=0.7, block=4, key_block=1), inputs)


def test_dmc_attention_bf16_returns_input_dtype():
    q, k, v, _, gen = _inputs(b=1, hk=1, n=9, d=8, seed=14)
    alpha = torch.rand(k.shape[:3], generator=gen)
    out = dmc_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), alpha)
    assert out.dtype == torch.bfloat16
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


def test_dmc_attention_never_allocates_n_by_n():
    n, d = 2048, 16
    q, k, v, _, gen = _inputs(b=1, hk=1, n=n, d=d, seed=15)
    alpha = torch.rand(k.shape[:3], generator=gen)
    inputs = [t.clone().requires_grad_() for t in (q, k, v, alpha)]
    with _MaxNumel() as mode:
        out = dmc_attention(*inputs)
        out.sum().backward()
    assert all(t.grad is not None for t in inputs)
    assert mode.max_numel < n * n / 4, mode.max_numel
    # The accumulation is O(n (d + chunk)) as well.
    with _MaxNumel() as mode:
        k_t, v_t = partial_accumulation(*inputs[1:3], inputs[3], torch.ones_like(alpha))
        (k_t.sum() + v_t.sum()).backward()
    assert mode.max_numel < n * n / 4, mode.max_numel


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
