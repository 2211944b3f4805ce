"""A Llama decoder layer's dense ops for inference: everything of a layer but its attention, in two calls.

    heads, _ = rms_norm_matmul(x, norm_in, eps, qkv_w, rope=(cos, sin), rope_heads=H + H_kv, head_dim=d)
    x = layer_output(x, attn, o_w, norm_mlp, eps, gate_up_w, down_w)

or, when the attention is itself a compiled function (:class:`CompiledAttention`: a cache's decode step,
:func:`kernels.paged.decode_attention`), the whole layer in one call, or from its heads on in one (CPU, fp32):

    x = layer_decode(x, norm_in, eps, qkv_w, (cos, sin), H + H_kv, d, attention, o_w, norm_mlp, gate_up_w, down_w)
    x = layer_attend_output(x, heads, attention, o_w, norm_mlp, eps, gate_up_w, down_w)  # heads: rms_norm_matmul's

``rms_norm`` and ``rotate`` (RoPE by the tables) are the tensor ops themselves, shared with training and the
engine's other paths.

Layouts: rows are tokens. ``x [t, hidden]``; weights stored ``[in, out]`` contiguous (``qkv_w [hidden, (H + 2 H_kv)
d]``, ``o_w [H d, hidden]``, ``gate_up_w [hidden, 2 ffn]`` gate then up, ``down_w [ffn, hidden]``); ``attn [t, H d]``;
the norm weights ``[hidden]``. ``rope``: the tables of rotate-half RoPE, ``cos [t, d]`` and the signed sine
``sin [t, 1 or rope_heads, d]`` (:func:`dmc_train.models.rope.rope_tables`), applied to the first ``rope_heads``
heads of the output.

On CPU in fp32 without autograd (``auto`` backend) the compiled kernel runs (:mod:`kernels.layer.cpu`: the
matrix products by PyTorch's own BLAS, the rest in loops over the rows: a decode step's layer costs its
products and two calls); elsewhere the tensor ops of :mod:`kernels.layer.reference`. The two agree to float
rounding: the products and RoPE bit for bit, RMSNorm's sum and SwiGLU's exp within a few ulp.
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch

from kernels.backend import get_backend

from .cpu import layer_attend_output_cpu, layer_decode_cpu, layer_output_cpu, library, rms_norm_matmul_cpu
from .reference import layer_output_torch, rms_norm, rms_norm_matmul_torch, rotate

__all__ = ["CompiledAttention", "rms_norm", "rotate", "rms_norm_matmul", "layer_output", "layer_decode",
           "layer_attend_output", "compiled_runs"]


class CompiledAttention(Protocol):
    """An attention the layer kernel calls by address: ``function(context, heads [t, H + 2 H_kv, d], channel [t, H +
    H_kv] or NULL, out [t, width]) -> int`` (0, or a code :meth:`check` raises as the error), fp32 C arrays;
    ``channel``: the q and k heads' values at the decision channel before RoPE, when the layer call was given one."""

    function: int
    context: int
    width: int

    def check(self, code: int) -> None: ...


def compiled_runs(*tensors: torch.Tensor) -> bool:
    """True when the compiled kernel takes these tensors: CPU, fp32, contiguous, none needing a gradient."""
    grad = torch.is_grad_enabled()
    return (get_backend() == "auto"
            and all(t.is_cpu and t.dtype == torch.float32 and t.is_contiguous() and not (grad and t.requires_grad)
                    for t in tensors)
            and library() is not None)  # last: a GPU run never builds it


def rms_norm_matmul(x: torch.Tensor, weight: torch.Tensor, eps: float, w: torch.Tensor,
                    rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None, rope_heads: int = 0, head_dim: int = 0,
                    channel: Optional[int] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(y, channel_values)``: ``y = rms_norm(x, weight, eps) @ w`` ``[t, out]``, then (``rope``) its first
    ``rope_heads`` heads of ``head_dim`` values rotated by the tables (layouts: the module's docstring);
    ``channel_values [t, rope_heads]``: those heads' values at ``channel`` before RoPE (DMC's decision channel), or
    None without ``channel``."""
    if compiled_runs(x, weight, w, *(rope or ())):
        return rms_norm_matmul_cpu(x, weight, eps, w, rope, rope_heads, head_dim, channel)
    return rms_norm_matmul_torch(x, weight, eps, w, rope, rope_heads, head_dim, channel)


def layer_output(x: torch.Tensor, attn: torch.Tensor, o_w: torch.Tensor, weight: torch.Tensor, eps: float,
                 gate_up_w: torch.Tensor, down_w: torch.Tensor, all_reduce=None) -> torch.Tensor:
    """A layer's output ``[t, hidden]`` from its input ``x`` and its attention's ``attn [t, H d]``: output projection ->
    residual -> RMSNorm -> SwiGLU ``down(silu(gate) * up)`` -> residual. ``all_reduce`` (tensor parallelism) sums the
    two projections' partial results over the ranks (then the tensor ops run)."""
    if all_reduce is None and compiled_runs(x, attn, o_w, weight, gate_up_w, down_w):
        return layer_output_cpu(x, attn, o_w, weight, eps, gate_up_w, down_w)
    return layer_output_torch(x, attn, o_w, weight, eps, gate_up_w, down_w, all_reduce)


def layer_decode(x: torch.Tensor, norm_in: torch.Tensor, eps: float, qkv_w: torch.Tensor,
                 rope: tuple[torch.Tensor, torch.Tensor], rope_heads: int, head_dim: int, attention: CompiledAttention,
                 o_w: torch.Tensor, norm_mlp: torch.Tensor, gate_up_w: torch.Tensor, down_w: torch.Tensor,
                 channel: Optional[int] = None) -> torch.Tensor:
    """A decode step's whole layer in one compiled call: :func:`rms_norm_matmul` (with RoPE of the first
    ``rope_heads`` heads), the ``attention`` over the heads (with ``channel``, also given those heads' values at that
    channel before RoPE: DMC's decision channel), :func:`layer_output`: the same arithmetic as the three calls. CPU,
    fp32, contiguous (:func:`compiled_runs`): the caller checks that it runs."""
    return layer_decode_cpu(x, norm_in, eps, qkv_w, rope, rope_heads, head_dim, attention, o_w, norm_mlp, gate_up_w,
                            down_w, channel)


def layer_attend_output(x: torch.Tensor, heads: torch.Tensor, attention: CompiledAttention, o_w: torch.Tensor,
                        weight: torch.Tensor, eps: float, gate_up_w: torch.Tensor,
                        down_w: torch.Tensor) -> torch.Tensor:
    """A decode step's layer from its projected ``heads [t, H + 2 H_kv, d]`` (:func:`rms_norm_matmul`'s, q and k
    rotated) on, in one compiled call: the ``attention`` over them, then :func:`layer_output` (for a cache whose
    step needs something between the two, DMC's decisions). CPU, fp32, contiguous: the caller checks that it
    runs."""
    return layer_attend_output_cpu(x, heads, attention, o_w, weight, eps, gate_up_w, down_w)
