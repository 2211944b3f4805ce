"""DMC decisions as pure functions: accumulate probability ``alpha`` and importance ``omega``.

Shared by the training attention module, the inference cache and the exported model, so all three
decide identically. Inputs are the raw (pre-RoPE) decision channel of the projected keys/queries.

Layouts are free (any leading dims); the functions act elementwise except ``omega``, whose last dim
holds the ``G`` query heads of each KV head group (``[..., groups * G]`` -> ``[..., groups]``).
"""

from __future__ import annotations

from typing import Optional

import torch

OMEGA_EPS = 1e-6  # the project's default; the released code adds finfo(dtype).eps (bf16: 2^-7)


def alpha_logit(key_channel: torch.Tensor, init_offset: float) -> torch.Tensor:
    """``k[c] - c0`` in fp32: at ``c0 = 5`` a zeroed channel gives alpha = sigmoid(-5) ~ 0.0067."""
    return key_channel.float() - init_offset


def omega(query_channel: torch.Tensor, num_groups: int, init_offset: float, eps: float = OMEGA_EPS) -> torch.Tensor:
    """Importance ``sigmoid(mean over the group's query heads of q[c] + c0) + eps`` in fp32.

    ``query_channel [..., num_groups * G]`` -> ``[..., num_groups]``.
    """
    return importance(group_mean(query_channel, num_groups), init_offset, eps)


def importance(group_query_channel: torch.Tensor, init_offset: float, eps: float = OMEGA_EPS) -> torch.Tensor:
    """``sigmoid(x + c0) + eps`` of the group-averaged query channel (DMC-HardC averages it further
    over the layer's heads first). ``eps`` keeps the running normaliser ``z`` > 0."""
    return torch.sigmoid(group_query_channel + init_offset) + eps


def group_mean(query_channel: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Mean over the query heads of each group: ``[..., num_groups * G]`` -> ``[..., num_groups]`` (fp32)."""
    return query_channel.float().unflatten(-1, (num_groups, -1)).mean(-1)


def gumbel_difference(shape: tuple, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """``g1 - g2`` with g1, g2 ~ Gumbel(0, 1) i.i.d., fp32, drawn on ``generator``'s device (CPU without one)."""
    device = generator.device if generator is not None else None
    u = torch.rand((2, *shape), generator=generator, dtype=torch.float32, device=device).clamp_(1e-10, 1 - 1e-7)
    g = -torch.log(-torch.log(u))
    return g[0] - g[1]


def relaxed_alpha(logit: torch.Tensor, noise: torch.Tensor, tau: float) -> torch.Tensor:
    """Training: the Gumbel-sigmoid ``sigmoid((logit + g1 - g2) / tau)`` (Eq. 8)."""
    return torch.sigmoid((logit + noise) / tau)


def hard_alpha(logit: torch.Tensor, threshold: float = 0.0) -> torch.Tensor:
    """Evaluation / inference: ``[logit > threshold]``; at the default 0 that is ``round(sigmoid(logit))``.

    (The released code's bf16 inference rounds a bf16 sigmoid, which accumulates only from
    ``logit >= 0.00785``: ``threshold=0.00785`` reproduces it.)

    When ``logit`` requires grad (and grad mode is on) a straight-through estimator carries the
    sigmoid's gradient; the forward value stays *exactly* 0 or 1 (``hard + (soft - soft.detach())``:
    the bracket is exactly 0, whereas ``hard + soft - soft.detach()`` rounds 1 to 1 - 2^-24 for
    some logits, leaving a merged state visible with bias ~ -16.6 instead of -inf).
    """
    hard = (logit > threshold).to(logit.dtype)
    if not torch.is_grad_enabled() or not logit.requires_grad:
        return hard
    soft = torch.sigmoid(logit)
    return hard + (soft - soft.detach())


def first_token_appends(alpha: torch.Tensor, seq_dim: int) -> torch.Tensor:
    """``alpha`` with position 0 along ``seq_dim`` set to 0: the first token always opens a slot."""
    keep = torch.ones(alpha.shape[seq_dim], dtype=alpha.dtype, device=alpha.device)
    keep[0] = 0
    shape = [1] * alpha.dim()
    shape[seq_dim] = -1
    return alpha * keep.view(shape)


def fixed_pooling_alpha(length: int, pool: int, device=None) -> torch.Tensor:
    """Fixed Memory Pooling: ``alpha [length]`` = 1 except every ``pool``-th token (which appends)."""
    pos = torch.arange(length, device=device)
    return (pos % pool != 0).to(torch.float32)
