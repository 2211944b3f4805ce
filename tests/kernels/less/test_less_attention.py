"""LESS's attention: the parallel form against Eq. 3 written out per query, the empty-state bound, and the
decode-step combination against the parallel form."""

import torch

from kernels.less import EPS, eviction_masks, less_attention, less_combine


def case(device, b=2, h=4, hk=2, n=24, d=8, r=3, seed=0):
    """Drawn on CPU (the same values on every device), then moved to ``device``."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, x, n, d, generator=g, dtype=torch.float64) for x in (h, hk, hk))
    phi_q, phi_k = torch.rand(b, h, n, r, generator=g, dtype=torch.float64), torch.rand(b, hk, n, r, generator=g,
                                                                                           dtype=torch.float64)
    # a policy's log: each entry evicted at a random later step, or kept (-1); the prompt is the first 3 tokens
    evicted_at = torch.randint(3, n + 4, (b, hk, n), generator=g)
    evicted_at = torch.where(evicted_at > torch.arange(n), evicted_at, -1)
    evicted_at[evicted_at >= n] = -1
    return tuple(x.to(device) for x in (q, k, v, phi_q, phi_k, evicted_at))


def eq3(q, k, v, phi_q, phi_k, evicted_at, scale):
    """Eq. 3 per query head and query: kept entries' exp-weights plus phi_q(q) H / phi_q(q) z of the evicted."""
    b, h, n, _ = q.shape
    g = h // k.shape[1]
    out = torch.zeros(b, h, n, v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            kv = hi // g
            for t in range(n):
                ev = evicted_at[bi, kv]
                kept = [j for j in range(t + 1) if ev[j] < 0 or ev[j] > t]
                gone = [j for j in range(t + 1) if 0 <= ev[j] <= t]
                w = torch.exp(q[bi, hi, t] @ k[bi, kv, kept].T * scale)
                H = phi_k[bi, kv, gone].T @ v[bi, kv, gone] if gone else torch.zeros(phi_k.shape[-1], v.shape[-1],
                                                                                     dtype=torch.float64)
                z = phi_k[bi, kv, gone].sum(0)
                den = max(float(phi_q[bi, hi, t] @ z), EPS)
                out[bi, hi, t] = (w @ v[bi, kv, kept] + phi_q[bi, hi, t] @ H) / (w.sum() + den)
    return out


def test_parallel_form_is_eq3(device):
    inputs = case(device)
    visible, evicted = eviction_masks(inputs[-1])
    q, k, v, phi_q, phi_k, _ = inputs
    got = less_attention(q, k, v, visible, evicted, phi_q, phi_k, 0.35)
    want = eq3(*(x.cpu() for x in inputs), 0.35)  # the per-query loops on CPU
    torch.testing.assert_close(got.cpu(), want.to(got.dtype), rtol=1e-5, atol=1e-6)


def test_an_empty_state_is_the_policys_attention_within_the_clamp_bound(device):
    q, k, v, phi_q, _, evicted_at = case(device, seed=1)
    visible, evicted = eviction_masks(evicted_at)
    got = less_attention(q, k, v, visible, evicted, phi_q, torch.zeros_like(phi_q[:, :2]), 0.35).double()
    g = q.shape[1] // k.shape[1]
    logits = (q @ k.repeat_interleave(g, 1).transpose(2, 3) * 0.35).masked_fill(~visible.repeat_interleave(g, 1),
                                                                                 float("-inf"))
    sparse = torch.softmax(logits, -1) @ v.repeat_interleave(g, 1)
    bound = EPS * torch.exp(-logits.logsumexp(-1))[..., None] * sparse.abs()  # (1 - w) |sparse|
    assert ((got - sparse).abs() <= bound * 1.01 + 1e-7).all()


def test_the_decode_step_combination_equals_the_parallel_form(device):
    q, k, v, phi_q, phi_k, evicted_at = case(device, seed=2)
    visible, evicted = eviction_masks(evicted_at)
    want = less_attention(q, k, v, visible, evicted, phi_q, phi_k, 0.35)
    g, t = 2, 20
    kv = torch.arange(q.shape[1], device=device) // g
    keep, gone = visible[:, kv, t], evicted[:, kv, t]  # [b, H, n]
    logits = (torch.einsum("bhd,bhnd->bhn", q[:, :, t], k[:, kv]) * 0.35).masked_fill(~keep, float("-inf"))
    sparse = torch.einsum("bhn,bhnd->bhd", torch.softmax(logits, -1), v[:, kv])
    H = torch.einsum("bhnr,bhnd->bhrd", phi_k[:, kv] * gone[..., None], v[:, kv])
    z = (phi_k[:, kv] * gone[..., None]).sum(2)
    got = less_combine(sparse, logits.logsumexp(-1), torch.einsum("bhr,bhrd->bhd", phi_q[:, :, t], H),
                       (phi_q[:, :, t] * z).sum(-1))
    torch.testing.assert_close(got, want[:, :, t], rtol=1e-6, atol=1e-8)
