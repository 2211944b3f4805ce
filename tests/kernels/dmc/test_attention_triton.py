"""The Triton DMC attention (attention_triton.py) under the Triton interpreter on CPU: forward and
gradients against the dense reference (soft alpha) and the blocked implementation (hard alpha, where
the alpha-gradient at alpha = 1 is the one-sided derivative)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on CPU

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from dmc_inputs import hard_alpha, make_inputs, random_vjp  # noqa: E402

from kernels.dmc import dense_dmc_attention  # noqa: E402
from kernels.dmc.attention_blocked import BlockedDMCAttention  # noqa: E402
from kernels.dmc.attention_triton import dmc_attention_triton  # noqa: E402

NAMES = ("q", "k", "v", "alpha")


def _tol(dtype):
    return {"atol": 1e-10, "rtol": 1e-10} if dtype == torch.float64 else {"atol": 2e-5, "rtol": 2e-5}


def _zero_channel(t, c):
    return t if c is None else t.index_fill(-1, torch.tensor([c]), 0)


@pytest.mark.parametrize(
    "n, hk, G, d, dv, free_channel, dtype, blocks",
    [
        (1, 2, 1, 64, 64, None, torch.float32, (32, 32)),  # a single token
        (5, 1, 2, 64, 64, 63, torch.float64, (16, 32)),  # GQA 2, free channel
        (33, 1, 4, 64, 32, None, torch.float32, (32, 16)),  # d_v != d, several tiles, ragged edge
        (33, 1, 8, 64, 64, 63, torch.float32, (32, 32)),  # GQA 8, free channel
        (33, 1, 1, 128, 128, None, torch.float64, (32, 32)),  # d = 128
    ],
)
def test_triton_attention_matches_dense(n, hk, G, d, dv, free_channel, dtype, blocks):
    q, k, v, _, gen = make_inputs(b=2 if n == 1 else 1, hk=hk, G=G, n=n, d=d, dv=dv, dtype=dtype, seed=21)
    alpha = (torch.rand(k.shape[:3], generator=gen) * 0.9 + 0.05).to(dtype)
    inputs = [t.clone().requires_grad_() for t in (q, k, v, alpha)]
    scale = 1 / math.sqrt(d)
    out = dmc_attention_triton(*inputs, scale, free_channel, *blocks)
    zeroed = [_zero_channel(inputs[0], free_channel), _zero_channel(inputs[1], free_channel)]
    ref = dense_dmc_attention(*zeroed, *inputs[2:], scale=scale)
    assert out.dtype == dtype and out.shape == (q.shape[0], q.shape[1], n, dv)
    torch.testing.assert_close(out, ref, **_tol(dtype))
    got, want = random_vjp([out], inputs), random_vjp([ref], inputs)
    for name, a, b in zip(NAMES, got, want):
        torch.testing.assert_close(a, b, **_tol(dtype), msg=lambda m: f"d/d{name}: {m}")
    if free_channel is not None:
        assert (got[0][..., free_channel] == 0).all() and (got[1][..., free_channel] == 0).all()


def _hard(kind, shape, gen):
    if kind == "append":
        return torch.zeros(shape)
    if kind == "accumulate":
        alpha = torch.ones(shape)
        alpha[..., 0] = 0
        return alpha
    if kind == "alternating":
        return (torch.arange(shape[-1]) % 2).float().expand(shape).clone()
    return hard_alpha(shape, gen)


@pytest.mark.parametrize(
    "kind, n, G",
    [("append", 33, 2), ("accumulate", 33, 1), ("alternating", 5, 4), ("random", 33, 2)],
)
def test_triton_attention_hard_alpha_matches_blocked(kind, n, G):
    """alpha in {0, 1}: -inf biases; the alpha-gradient at alpha = 1 is the blocked version's one-sided
    derivative (the dense reference gives 0 there), everything else also matches the dense reference."""
    q, k, v, _, gen = make_inputs(b=1, hk=2, G=G, n=n, d=64, dtype=torch.float64, seed=22)
    alpha = _hard(kind, k.shape[:3], gen).double()
    inputs = [t.clone().requires_grad_() for t in (q, k, v, alpha)]
    out = dmc_attention_triton(*inputs, 0.125, None, 32, 16)
    blocked = BlockedDMCAttention.apply(*inputs, 0.125, 8, 8)
    dense = dense_dmc_attention(*inputs, scale=0.125)
    tol = _tol(torch.float64)
    torch.testing.assert_close(out, blocked, **tol)
    torch.testing.assert_close(out, dense, **tol)
    if kind == "append":
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), is_causal=True, scale=0.125)
        torch.testing.assert_close(out, sdpa, **tol)
    got, want, want_dense = random_vjp([out], inputs), random_vjp([blocked], inputs), random_vjp([dense], inputs)
    for name, a, b, c in zip(NAMES, got, want, want_dense):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, **tol, msg=lambda m: f"d/d{name}: {m}")
        if name != "alpha":
            torch.testing.assert_close(a, c, **tol, msg=lambda m: f"d/d{name} (dense): {m}")
    if kind != "append":
        assert got[3][alpha == 1].abs().max() > 0  # one-sided derivative, not the dense reference's 0


def test_triton_attention_alpha_grad_at_one_is_the_limit():
    q, k, v, _, gen = make_inputs(b=1, hk=1, G=2, n=17, d=16, dtype=torch.float64, seed=23)
    alpha = hard_alpha(k.shape[:3], gen).double()
    hard = alpha.clone().requires_grad_()
    near = (alpha * (1 - 1e-10)).requires_grad_()
    out = dmc_attention_triton(q, k, v, hard, 0.25, None, 16, 16)
    ref = dense_dmc_attention(q, k, v, near, scale=0.25)
    torch.testing.assert_close(out, ref, atol=1e-8, rtol=0)
    (got,), (want,) = random_vjp([out], [hard]), random_vjp([ref], [near])
    torch.testing.assert_close(got, want, atol=1e-7, rtol=1e-6)


def test_triton_attention_bf16():
    q, k, v, _, gen = make_inputs(b=1, hk=1, G=2, n=20, d=64, seed=24)
    alpha = torch.rand(k.shape[:3], generator=gen)
    inputs = [t.bfloat16().requires_grad_() for t in (q, k, v, alpha)]
    out = dmc_attention_triton(*inputs, 0.125, None, 16, 16)
    assert out.dtype == torch.bfloat16
    ref = dense_dmc_attention(*(t.detach().float() for t in inputs), scale=0.125)
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)
    grads = random_vjp([out], inputs)
    assert all(g.dtype == torch.bfloat16 and torch.isfinite(g).all() for g in grads)
    ref_inputs = [t.detach().float().requires_grad_() for t in inputs]
    ref_grads = random_vjp([dense_dmc_attention(*ref_inputs, scale=0.125)], ref_inputs)
    for name, a, b in zip(NAMES, grads, ref_grads):
        torch.testing.assert_close(a.float(), b, atol=5e-2, rtol=5e-2, msg=lambda m: f"d/d{name}: {m}")


def test_triton_attention_extreme_scores_stay_finite():
    """Score gaps of hundreds of nats, also on a key that becomes invisible (alpha = 1)."""
    q, k, v, _, gen = make_inputs(b=1, hk=1, n=12, d=16, seed=25)
    k[0, 0, 3] = 0
    k[0, 0, 3, 0] = 40.0
    q[0, 0, :, 0] = 30.0
    alpha = torch.rand(k.shape[:3], generator=gen) * 0.5
    alpha[0, 0, 4] = 1.0
    inputs = [t.clone().requires_grad_() for t in (q, k, v, alpha)]
    out = dmc_attention_triton(*inputs, 1.0, None, 16, 16)
    ref = dense_dmc_attention(*inputs, scale=1.0)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    got, want = random_vjp([out], inputs), random_vjp([ref], inputs)
    assert all(torch.isfinite(g).all() for g in got)
    for name, a, b in zip(NAMES[:3], got, want):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-4, msg=lambda m: f"d/d{name}: {m}")


def test_triton_attention_layouts_blocks_and_no_alpha_grad():
    """Non-contiguous inputs, block sizes other than the defaults, alpha without gradient."""
    q, k, v, _, gen = make_inputs(b=1, hk=2, G=2, n=21, d=32, dv=16, seed=26)
    alpha = torch.rand(k.shape[:3], generator=gen)
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()  # [b, n, h, d] storage
    k_r, v_r = k.clone().requires_grad_(), v.clone().requires_grad_()
    ref = dense_dmc_attention(q_t, k_r, v_r, alpha, scale=0.3)
    want = random_vjp([ref], [q_t, k_r, v_r])
    for blocks in ((16, 64), (64, 16), (None, None)):
        out = dmc_attention_triton(q_t, k_r, v_r, alpha, 0.3, None, *blocks)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
        got = random_vjp([out], [q_t, k_r, v_r])
        for name, a, b in zip(NAMES, got, want):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5, msg=lambda m: f"{blocks} d/d{name}: {m}")
    with pytest.raises(ValueError, match="block_m"):
        dmc_attention_triton(q, k, v, alpha, 0.3, None, 24, 16)
