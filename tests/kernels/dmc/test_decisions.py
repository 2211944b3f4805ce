"""DMC decisions (kernels/dmc/decisions.py): exact hard values under autograd, and the training path
with straight-through decisions equal to Algorithm 1."""

import torch

from kernels.dmc import decisions, dmc_attention, partial_accumulation, simulate_dmc_inference


def test_hard_alpha_is_exactly_hard_under_autograd(device):
    logit = torch.linspace(-30, 30, 20001, dtype=torch.float32, device=device).requires_grad_()
    alpha = decisions.hard_alpha(logit)
    assert torch.equal(alpha.detach(), (logit > 0).float())  # not 1 - 2^-24 for any logit
    alpha.sum().backward()  # straight-through: the sigmoid's gradient
    s = torch.sigmoid(logit.detach())
    torch.testing.assert_close(logit.grad, s * (1 - s))


def test_straight_through_decisions_give_algorithm_1(device):
    # Three tokens, decisions [0, 1, 1]: one slot holds all three; the last query sees only it.
    # With these logits `hard + soft - soft.detach()` rounds 1 to 1 - 2^-24: merged states stayed visible.
    # The queries favour the first token's key by far more than the 16.6 a rounded bias would cost.
    q = torch.tensor([10.0, 0, 0, 0]).expand(1, 1, 3, 4)
    k = torch.tensor([[10.0, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0]]).view(1, 1, 3, 4)
    v = torch.randn(1, 1, 3, 4, generator=torch.Generator().manual_seed(1))
    logit = torch.tensor([[[-3.0, 0.25, 0.13]]], device=device, requires_grad=True)
    alpha = decisions.first_token_appends(decisions.hard_alpha(logit), seq_dim=-1)
    omega = torch.ones_like(alpha)
    q_d, k_d, v_d = q.to(device), k.to(device), v.to(device)
    k_t, v_t = partial_accumulation(k_d, v_d, alpha, omega, mode="exact")
    out = dmc_attention(q_d, k_t, v_t, alpha)
    # the reference (Algorithm 1, float64 token by token) on CPU
    expected, lengths = simulate_dmc_inference(q, k, v, alpha.detach().cpu(), omega.cpu())
    assert lengths.flatten().tolist() == [1, 1, 1]
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-6)


def test_omega_averages_the_query_heads_of_each_group(device):
    q_channel = torch.tensor([[1.0, 3.0, -2.0, 0.0]], device=device)  # 2 groups x 2 query heads
    w = decisions.omega(q_channel, num_groups=2, init_offset=5.0)
    expected = torch.sigmoid(torch.tensor([[2.0 + 5.0, -1.0 + 5.0]], device=device)) + decisions.OMEGA_EPS
    torch.testing.assert_close(w, expected)


def test_first_token_always_appends_and_fixed_pooling_pattern(device):
    alpha = torch.ones(2, 3, 5, device=device)
    assert decisions.first_token_appends(alpha, seq_dim=-1)[..., 0].eq(0).all()
    pooled = decisions.fixed_pooling_alpha(7, 3, device=device)
    assert pooled.device.type == device.type and pooled.tolist() == [0, 1, 1, 0, 1, 1, 0]
