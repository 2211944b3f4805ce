"""Training path with hard decisions == Algorithm 1 (simulate_dmc_inference / DMCHeadCache).

The training ops run on the ``device`` fixture's device; the references (float64, token by token) on CPU,
from the same CPU draws. The pre-RoPE test checks one reference against another: CPU only."""

import pytest
import torch
from dmc_inputs import IMPLS, hard_alpha, make_inputs

from kernels.dmc import (
    DMCHeadCache,
    dmc_attention,
    partial_accumulation,
    reference_pre_rope_dmc_attention,
    rotate_half_rope,
    simulate_dmc_inference,
)


def _longest_segment(alpha):
    longest, run = 0, torch.zeros(alpha.shape[:-1])
    for t in range(alpha.shape[-1]):
        run = torch.where((alpha[..., t] == 1) & (torch.tensor(t) > 0), run + 1, torch.ones_like(run))
        longest = max(longest, int(run.max()))
    return longest


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("G", [1, 2])
@pytest.mark.parametrize("seed", [0, 1])
def test_hard_training_equals_inference_simulation(G, seed, impl, device):
    q, k, v, omega, gen = make_inputs(b=2, hk=2, G=G, n=29, d=8, dv=6, seed=seed)
    alpha = hard_alpha(k.shape[:3], gen)
    alpha[..., 0] = 1  # ignored: the first token always appends
    expected, lengths = simulate_dmc_inference(q, k, v, alpha, omega)  # the reference, on CPU

    k_t, v_t = partial_accumulation(*(t.to(device) for t in (k, v, alpha, omega)), mode="exact", chunk=8)
    out = dmc_attention(q.to(device), k_t, v_t, alpha.to(device), block=8, key_block=8, impl=impl)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=0)

    a = alpha.clone()
    a[..., 0] = 0
    torch.testing.assert_close(lengths[..., -1], (1 - a).sum(-1).long())  # l = sum_t (1 - alpha_t)


def test_window_mode_matches_inference_iff_segments_fit(device):
    w = 4
    q, k, v, omega, gen = make_inputs(b=2, hk=2, G=2, n=40, seed=3)
    fits = hard_alpha(k.shape[:3], gen, p=0.7, max_segment=w)
    assert _longest_segment(fits) == w
    expected, _ = simulate_dmc_inference(q, k, v, fits, omega)  # the references, on CPU
    qd, kd, vd, omega_d = (x.to(device) for x in (q, k, v, omega))

    def training(alpha, **accumulation):
        alpha = alpha.to(device)
        return dmc_attention(qd, *partial_accumulation(kd, vd, alpha, omega_d, **accumulation), alpha,
                             block=16).cpu()

    torch.testing.assert_close(training(fits, mode="window", window=w), expected, atol=1e-5, rtol=0)

    too_long = fits.clone()
    too_long[0, 0, 10 : 10 + w + 2] = 1  # a segment of at least w + 3 tokens
    expected, _ = simulate_dmc_inference(q, k, v, too_long, omega)
    assert (training(too_long, mode="window", window=w) - expected).abs().max() > 1e-3
    torch.testing.assert_close(training(too_long, mode="exact"), expected, atol=1e-5, rtol=0)


def test_paper_worked_example_cache_growth(device):
    """alphas (a1..a5) = (1, 1, 0, 1, 0): [k0] -> [k01] -> [k012] -> [k012, k3] -> [k012, k34] -> [k012, k34, k5]."""
    q, k, v, omega, _ = make_inputs(b=1, hk=1, n=6, d=4, seed=5)
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
    k_t, v_t = (x.cpu() for x in partial_accumulation(k.to(device), v.to(device), alpha.to(device), omega.to(device)))
    torch.testing.assert_close(k_t[0, 0, [2, 4, 5]].double(), torch.stack(final.keys), atol=1e-6, rtol=0)
    torch.testing.assert_close(v_t[0, 0, [2, 4, 5]].double(), torch.stack(final.values), atol=1e-6, rtol=0)


def _rope_angles(n, d, base=10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.outer(torch.arange(n, dtype=torch.float64), inv_freq).repeat(1, 2)
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("G", [1, 2])
def test_pre_rope_reference_equals_inference_with_raw_slots(G):
    """rope_order=pre with hard decisions: a slot holds the raw average of its segment and is rotated at
    the position of the segment's newest token (the open slot at the current token); differs from post."""
    q, k, v, omega, gen = make_inputs(b=2, hk=2, G=G, n=17, d=8, dtype=torch.float64, seed=4)
    alpha = hard_alpha(k.shape[:3], gen).double()
    cos, sin = _rope_angles(17, 8)
    out = reference_pre_rope_dmc_attention(q, k, v, alpha, omega, cos, sin)

    def rope(x, t):
        return rotate_half_rope(x[None, None, None], cos[t: t + 1], sin[t: t + 1])[0, 0, 0]

    expected = torch.zeros_like(out)
    for bi in range(2):
        for h in range(2):
            cache, newest = DMCHeadCache(), []
            for t in range(17):
                cache.update(k[bi, h, t], v[bi, h, t], float(alpha[bi, h, t]), omega[bi, h, t])
                newest[len(cache) - 1:] = [t]  # the open slot's newest token is t
                keys = torch.stack([rope(key, p) for key, p in zip(cache.keys, newest)])
                for j in range(h * G, (h + 1) * G):
                    weights = torch.softmax(keys @ rope(q[bi, j, t], t) / 8 ** 0.5, dim=0)
                    expected[bi, j, t] = weights @ torch.stack(cache.values)
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=0)

    post, _ = simulate_dmc_inference(rotate_half_rope(q, cos, sin), rotate_half_rope(k, cos, sin), v, alpha, omega)
    assert (out - post).abs().max() > 1e-2
