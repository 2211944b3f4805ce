"""dmc_attention (Fig. 3) against the dense reference: values, gradients, dtypes, O(n) memory."""

import math
import os

import pytest
import torch
from dmc_inputs import IMPLS, hard_alpha, make_inputs, random_vjp
from torch.utils._python_dispatch import TorchDispatchMode

from kernels.dmc import dense_dmc_attention, dmc_attention, dmc_attention_bias, partial_accumulation


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
    q, k, v, _, gen = make_inputs(b=2, hk=2, G=G, n=n, d=8, dv=5, seed=11)
    shape = k.shape[:3]
    alpha = {
        "soft": lambda: torch.rand(shape, generator=gen),
        "append": lambda: torch.zeros(shape),
        "near_one": lambda: 1 - torch.rand(shape, generator=gen) * 1e-3,
        "hard": lambda: hard_alpha(shape, gen),
    }[alpha_kind]()
    inputs = [t.clone().requires_grad_() for t in (q, k, v, alpha)]
    out = dmc_attention(*inputs, block=block, key_block=key_block, impl=impl)
    ref = dense_dmc_attention(*inputs)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    if alpha_kind == "append":
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), is_causal=True)
        torch.testing.assert_close(out, sdpa, atol=1e-5, rtol=1e-5)
    got_grads, ref_grads = random_vjp([out], inputs), random_vjp([ref], inputs)
    for name, a, b in zip("q k v alpha".split(), got_grads, ref_grads):
        if name == "alpha" and alpha_kind == "hard":
            continue  # the dense reference gives 0 at alpha = 1; see test_dmc_attention_alpha_grad_at_one
        torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4, msg=lambda m: f"d/d{name}: {m}")
    assert torch.isfinite(got_grads[3]).all()


@pytest.mark.parametrize("b", [1, 2])
@pytest.mark.parametrize("impl", IMPLS)
def test_dmc_attention_output_in_query_layout(b, impl):
    """q a permuted view of megatron's [n, b, h, d]: the output's permute back and reshape to
    [n, b, h * dv] is a view of the output itself (no second copy for the next layer to keep), and
    the values and gradients are those of a contiguous q."""
    q, k, v, _, gen = make_inputs(b=b, hk=2, G=2, n=21, d=8, dv=5, seed=13)
    alpha = torch.rand(k.shape[:3], generator=gen)
    q_nbhd = q.permute(2, 0, 1, 3).contiguous().requires_grad_()
    out = dmc_attention(q_nbhd.permute(1, 2, 0, 3), k, v, alpha, block=8, key_block=8, impl=impl)
    flat = out.permute(2, 0, 1, 3).reshape(21, b, -1)
    assert flat.data_ptr() == out.data_ptr()
    q_plain = q.clone().requires_grad_()
    ref = dmc_attention(q_plain, k, v, alpha, block=8, key_block=8, impl=impl)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    dq, = random_vjp([out], [q_nbhd])
    dq_ref, = random_vjp([ref], [q_plain])
    torch.testing.assert_close(dq, dq_ref.permute(2, 0, 1, 3), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_dmc_attention_alpha_grad_at_one(impl):
    """At hard alpha = 1 the gradient is the one-sided derivative (finite), = the limit alpha -> 1."""
    q, k, v, _, gen = make_inputs(b=1, hk=2, G=2, n=19, d=4, dtype=torch.float64, seed=12)
    alpha = hard_alpha(k.shape[:3], gen).double()
    hard = alpha.clone().requires_grad_()
    near = (alpha * (1 - 1e-10)).requires_grad_()
    out = dmc_attention(q, k, v, hard, block=4, key_block=8, impl=impl)
    ref = dense_dmc_attention(q, k, v, near)
    torch.testing.assert_close(out, ref, atol=1e-8, rtol=0)
    got, = random_vjp([out], [hard])
    want, = random_vjp([ref], [near])
    torch.testing.assert_close(got, want, atol=1e-7, rtol=1e-6)
    assert got[alpha == 1].abs().max() > 0


def test_dmc_attention_gradcheck():
    q, k, v, _, gen = make_inputs(b=1, hk=2, G=2, n=6, d=3, dv=2, dtype=torch.float64, seed=13)
    alpha = torch.rand(k.shape[:3], generator=gen, dtype=torch.float64) * 0.9 + 0.05
    inputs = [t.clone().requires_grad_() for t in (q, k, v, alpha)]
    for kwargs in (
        {"block": 2, "key_block": 2, "impl": "blocked"},
        {"scale": 0.7, "block": 4, "key_block": 1, "impl": "blocked"},
        {"impl": "fused"},
        {"scale": 0.7, "free_channel": 1, "impl": "fused"},
    ):
        assert torch.autograd.gradcheck(lambda *x: dmc_attention(*x, **kwargs), inputs), kwargs


@pytest.mark.parametrize("impl", IMPLS)
def test_dmc_attention_free_channel_is_ignored(impl):
    """free_channel (DMC's decision channel) takes no part in attention, whatever it holds."""
    q, k, v, _, gen = make_inputs(b=2, hk=2, G=2, n=21, d=8, seed=17)
    alpha = torch.rand(k.shape[:3], generator=gen)
    inputs = [t.clone().requires_grad_() for t in (q, k, v, alpha)]
    out = dmc_attention(*inputs, free_channel=7, block=8, key_block=8, impl=impl)
    zeroed = [inputs[0].index_fill(-1, torch.tensor([7]), 0), inputs[1].index_fill(-1, torch.tensor([7]), 0)]
    ref = dense_dmc_attention(*zeroed, *inputs[2:])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    got_grads, ref_grads = random_vjp([out], inputs), random_vjp([ref], inputs)
    for name, a, b in zip("q k v alpha".split(), got_grads, ref_grads):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4, msg=lambda m: f"d/d{name}: {m}")
    assert (got_grads[0][..., 7] == 0).all() and (got_grads[1][..., 7] == 0).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_dmc_attention_extreme_scores_stay_finite(impl):
    """Score gaps of hundreds of nats, also on invisible keys (alpha = 1): no inf / NaN anywhere."""
    q, k, v, _, gen = make_inputs(b=1, hk=1, n=12, d=4, dtype=torch.float32, seed=18)
    k[0, 0, 3] = 0
    k[0, 0, 3, 0] = 40.0  # key 3 outscores everything by ~q[0] * 40 * scale
    q[0, 0, :, 0] = 30.0
    alpha = torch.rand(k.shape[:3], generator=gen) * 0.5
    alpha[0, 0, 4] = 1.0  # ... and is invisible from query 4 on
    inputs = [t.clone().requires_grad_() for t in (q, k, v, alpha)]
    out = dmc_attention(*inputs, scale=1.0, block=4, key_block=4, impl=impl)
    ref = dense_dmc_attention(*inputs, scale=1.0)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    got_grads, ref_grads = random_vjp([out], inputs), random_vjp([ref], inputs)
    for a in got_grads:
        assert torch.isfinite(a).all()
    for name, a, b in zip("q k v".split(), got_grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-4, msg=lambda m: f"d/d{name}: {m}")


@pytest.mark.parametrize("impl", IMPLS)
def test_dmc_attention_bf16_returns_input_dtype(impl):
    q, k, v, _, gen = make_inputs(b=1, hk=1, n=9, d=8, seed=14)
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
    q, k, v, _, gen = make_inputs(b=1, hk=1, n=n, d=d, seed=15)
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
    q, k, v, _, gen = make_inputs(b=1, hk=1, n=n, d=d, seed=19)
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


def test_dense_bias_is_fig3():
    alpha = torch.tensor([[[0.0, 0.5, 1.0, 0.25]]])
    inf = math.inf
    expected = torch.tensor([
        [0, -inf, -inf, -inf],
        [math.log(0.5), 0, -inf, -inf],
        [math.log(0.5), -inf, 0, -inf],
        [math.log(0.5), -inf, math.log(0.75), 0],
    ])
    torch.testing.assert_close(dmc_attention_bias(alpha)[0, 0], expected)


def _rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``|| got - ref || / || ref ||`` (relative to 1e-3 where the reference is ~0, e.g. dq of a lone token)."""
    return ((got.cpu().double() - ref).norm() / ref.norm().clamp(min=1e-3)).item()


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("G, n, free_channel", [(1, 37, 7), (4, 50, 7), (2, 33, None), (2, 1, 7)],
                         ids=["mha", "gqa4", "appended_channel", "one_token"])
def test_attention_chosen_on_the_device_matches_dense(device, dtype, tol, G, n, free_channel):
    """What ``impl="auto"`` runs on the test device (CPU: the fused CPU kernels; CUDA: cuDNN / FlashAttention-2
    in bf16, the memory-efficient kernel in fp32, compiled stages) against the dense float64 reference: the
    output and the gradients of q, k~, v~ and alpha, ragged n, GQA, with and without a free channel."""
    q, k, v, _, gen = make_inputs(b=2, hk=2, G=G, n=n, d=16, seed=23)
    alpha = torch.rand(k.shape[:3], generator=gen) * 0.98
    ups = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    inputs = [t.to(device, dtype if t is not alpha else torch.float32).requires_grad_() for t in (q, k, v, alpha)]
    out = dmc_attention(*inputs, free_channel=free_channel)
    got = [out, *torch.autograd.grad((out.double() * ups.to(device)).sum(), inputs)]

    ref_inputs = [t.detach().cpu().double().requires_grad_() for t in inputs]
    keep = torch.ones(16, dtype=torch.float64)
    if free_channel is not None:
        keep[free_channel] = 0
    q_r, k_r, v_r, a_r = ref_inputs
    ref_out = dense_dmc_attention(q_r * keep, k_r * keep, v_r, a_r)
    ref = [ref_out, *torch.autograd.grad((ref_out * ups).sum(), ref_inputs)]
    for name, g, r in zip(["out", "dq", "dk", "dv", "dalpha"], got, ref):
        assert g.device == inputs[0].device and g.dtype == (torch.float32 if name == "dalpha" else dtype)
        assert _rel_error(g, r) < tol, f"{name}: relative error {_rel_error(g, r):.2e}"
