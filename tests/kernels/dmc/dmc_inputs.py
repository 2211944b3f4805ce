"""Shared inputs for the DMC op tests in this directory (not a test module)."""

import torch

# The dmc_attention implementations every attention test runs on ("auto" resolves to one of them).
IMPLS = ["fused", "blocked"]


def make_inputs(b=2, hk=2, G=1, n=20, d=8, dv=None, dtype=torch.float32, seed=0):
    """Random ``q [b, hk * G, n, d]``, ``k [b, hk, n, d]``, ``v [b, hk, n, dv]``, ``omega [b, hk, n]``
    in [0.1, 1), and the generator for further draws."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hk * G, n, d, generator=gen, dtype=dtype)
    k = torch.randn(b, hk, n, d, generator=gen, dtype=dtype)
    v = torch.randn(b, hk, n, dv or d, generator=gen, dtype=dtype)
    omega = torch.rand(b, hk, n, generator=gen, dtype=dtype) * 0.9 + 0.1
    return q, k, v, omega, gen


def hard_alpha(shape, gen, p=0.6, max_segment=None):
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


def random_vjp(out, inputs, seed=7):
    """Gradients w.r.t. ``inputs`` of a fixed random projection of the outputs ``out``."""
    gen = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() for o in out)
    return torch.autograd.grad(loss, inputs, materialize_grads=True)  # window=1 never reads alpha
