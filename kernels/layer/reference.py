"""A Llama decoder layer's dense ops in tensor ops: what :mod:`kernels.layer` runs off the compiled CPU kernel
(other devices and dtypes, autograd), and what the kernel is tested against."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim, in fp32, back in ``x``'s dtype."""
    if x.dtype == weight.dtype == torch.float32:  # the same operations without the casts (each a no-op call)
        if not torch.is_grad_enabled():  # inference: torch's rms_norm, one call for the same operations (on CPU
            return torch.rms_norm(x, x.shape[-1:], weight, eps)  # bit for bit); its backward is not the same
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x [..., d]`` by ``cos`` and the signed ``sin`` (broadcast against ``x``;
    :func:`dmc_train.models.rope.rope_tables`): ``x * cos + roll(x, d / 2) * sin``."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


def rotate_heads(y: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], heads: int, head_dim: int) -> torch.Tensor:
    """``y [t, width]`` with its first ``heads`` heads of ``head_dim`` values rotated (:func:`rotate`) by the tables
    ``rope = (cos [t, d], sin [t, 1 or heads, d])``."""
    cos, sin = rope
    rotated = rotate(y[:, : heads * head_dim].view(len(y), heads, head_dim), cos[:, None], sin)
    return torch.cat([rotated.flatten(1), y[:, heads * head_dim:]], 1)


def rms_norm_matmul_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, w: torch.Tensor,
                          rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None, rope_heads: int = 0,
                          head_dim: int = 0,
                          channel: Optional[int] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """:func:`kernels.layer.rms_norm_matmul` in tensor ops."""
    y = torch.mm(rms_norm(x, weight, eps), w)
    channel_values = None if channel is None else y.view(len(y), -1, head_dim)[:, :rope_heads, channel]
    return (y if rope is None else rotate_heads(y, rope, rope_heads, head_dim)), channel_values


def layer_output_torch(x: torch.Tensor, attn: torch.Tensor, o_w: torch.Tensor, weight: torch.Tensor, eps: float,
                       gate_up_w: torch.Tensor, down_w: torch.Tensor, all_reduce=None) -> torch.Tensor:
    """:func:`kernels.layer.layer_output` in tensor ops (``all_reduce``: sums the two projections' partial results
    over tensor-parallel ranks)."""
    out = torch.mm(attn, o_w)
    x = x + (out if all_reduce is None else all_reduce(out))
    gate, up = torch.mm(rms_norm(x, weight, eps), gate_up_w).chunk(2, dim=-1)
    out = torch.mm(F.silu(gate) * up, down_w)
    return x + (out if all_reduce is None else all_reduce(out))
