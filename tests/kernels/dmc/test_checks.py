"""Input validation of the public DMC ops and the inference simulation."""

import pytest
import torch
from dmc_inputs import make_inputs

from kernels.dmc import dmc_attention, partial_accumulation, simulate_dmc_inference


def test_invalid_inputs_raise(device):
    q, k, v, omega = (x.to(device) for x in make_inputs(b=1, hk=2, G=1, n=5, d=4, seed=16)[:4])
    alpha = torch.zeros(k.shape[:3], device=device)
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
    q3 = torch.randn(1, 3, 5, 4, device=device)
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
    with pytest.raises(ValueError, match="impl must be one of auto, fused"):
        dmc_attention(q, k, v, alpha, impl="flex")
    with pytest.raises(ValueError, match="only 0 and 1"):
        simulate_dmc_inference(q, k, v, alpha + 0.5, omega)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        simulate_dmc_inference(q3, k, v, alpha, omega)
