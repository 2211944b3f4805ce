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

The backend :mod:`kernels.backend` chooses for the tensors' device picks the implementation (the table ``OPS``
below): under ``cpu_compiled``, for fp32 CPU tensors without autograd, the compiled kernel
(:mod:`kernels.layer.cpu`: the matrix products by PyTorch's own BLAS, the rest in loops over the rows: a decode
step's layer costs its products and two calls); for every other input and backend the tensor ops of
:mod:`kernels.layer.reference`. The two agree to float rounding: the products and RoPE bit for bit, RMSNorm's sum
and SwiGLU's exp within a few ulp. A backend adds its implementation of an op by a row in ``OPS``
(``docs/DESIGN.md``, "Adding a backend").
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch

from kernels.backend import Impl, Op

from .cpu import (
    layer_attend_output_cpu,
    layer_decode_cpu,
    layer_output_cpu,
    layer_output_fits,
    rms_norm_matmul_cpu,
    rms_norm_matmul_fits,
    takes,
)
from .reference import layer_output_torch, rms_norm, rms_norm_matmul_torch, rotate

__all__ = ["OPS", "CompiledAttention", "rms_norm", "rotate", "rms_norm_matmul", "layer_output", "layer_decode",
           "layer_attend_output", "compiled_runs"]

# Which backend takes which inputs (kernels.backend). "layer_decode" has no PyTorch implementation: it is the
# question :func:`compiled_runs` asks of the weights, and a caller that hears no runs its own tensor ops around the
# cache's attention.
OPS = {
    "rms_norm_matmul": Op({
        "cpu_compiled": Impl(rms_norm_matmul_cpu, fits=rms_norm_matmul_fits),
        "torch": Impl(rms_norm_matmul_torch),
    }),
    "layer_output": Op({
        "cpu_compiled": Impl(layer_output_cpu, fits=layer_output_fits),
        "torch": Impl(layer_output_torch),
    }),
    "layer_decode": Op({"cpu_compiled": Impl(layer_decode_cpu, fits=takes)}),
}


class CompiledAttention(Protocol):
    """An attention the layer kernel calls by address: ``function(context, heads [t, H + 2 H_kv, d], channel [t, H +
    H_kv] or NULL, out [t, width]) -> int`` (0, or a code :meth:`check` raises as the error), fp32 C arrays;
    ``channel``: the q and k heads' values at the decision channel before RoPE, when the layer call was given one."""

    function: int
    context: int
    width: int

    def check(self, code: int) -> None: ...


def compiled_runs(*tensors: torch.Tensor) -> bool:
    """True when the compiled kernel of the chosen backend takes these tensors (a layer's weights, its inputs): CPU,
    fp32, contiguous, none needing a gradient; then :func:`layer_decode` and :func:`layer_attend_output` run."""
    return OPS["layer_decode"].pick(*tensors) is not None


def rms_norm_matmul(x: torch.Tensor, weight: torch.Tensor, eps: float, w: torch.Tensor,
                    rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None, rope_heads: int = 0, head_dim: int = 0,
                    channel: Optional[int] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(y, channel_values)``: ``y = rms_norm(x, weight, eps) @ w`` ``[t, out]``, then (``rope``) its first
    ``rope_heads`` heads of ``head_dim`` values rotated by the tables (layouts: the module's docstring);
    ``channel_values [t, rope_heads]``: those heads' values at ``channel`` before RoPE (DMC's decision channel), or
    None without ``channel``."""
    return OPS["rms_norm_matmul"](x, weight, eps, w, rope, rope_heads, head_dim, channel)


def layer_output(x: torch.Tensor, attn: torch.Tensor, o_w: torch.Tensor, weight: torch.Tensor, eps: float,
                 gate_up_w: torch.Tensor, down_w: torch.Tensor, all_reduce=None) -> torch.Tensor:
    """A layer's output ``[t, hidden]`` from its input ``x`` and its attention's ``attn [t, H d]``: output projection ->
    residual -> RMSNorm -> SwiGLU ``down(silu(gate) * up)`` -> residual. ``all_reduce`` (tensor parallelism) sums the
    two projections' partial results over the ranks (then the tensor ops run)."""
    return OPS["layer_output"](x, attn, o_w, weight, eps, gate_up_w, down_w, all_reduce)


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
