"""One Llama decoder layer in plain torch with the attention core passed in: the inference model's and the
importer's reference forward (:mod:`dmc_train.models.llama_reference`) both run it.

    layer = LlamaLayer(i, weight, head_dim, norm_eps)   # weight(hf_name) -> tensor, in the dtype to compute in
    x = layer(x, attend)                                # [b, n, hidden] -> [b, n, hidden]
    heads = layer.attention_input(x)                    # or in two halves, tokens as rows: [t, hidden] -> [t, C, d]
    x = layer.attention_output(x, out)                  # out [t, H d] (the attention between) -> [t, hidden]

RMSNorm (fp32 inside) -> q, k, v projections (one matmul over the stacked weights) -> ``attend(i, q, k, v)``
-> output projection -> residual -> RMSNorm -> SwiGLU ``down(silu(gate h) * up h)`` -> residual, as
transformers' ``LlamaDecoderLayer`` without biases; the parts around the attention are :mod:`kernels.layer`'s
two ops (compiled on CPU in fp32 at inference: a decode step's layer is then its products and two calls).
q and k reach ``attend`` before RoPE, or rotated by the tables the caller hands to ``attention_input``
(:mod:`dmc_train.models.rope`): what happens there differs (the reference rotates both at ``0..n-1``; the engine
reads DMC's decisions from the un-rotated q and k, and some caches rotate the keys themselves). The inference
model runs the two halves itself (:meth:`LlamaLayer.attention_input`, :meth:`LlamaLayer.attention_output`,
tokens as rows ``[t, ...]``), so that a decode step's heads reach the cache in its layout without transposes.
Layouts: hidden ``[b, n, hidden]``; ``attend`` takes ``q [b, H, n, d]``, ``k, v [b, H_kv, n, d]`` and returns
``[b, H, n, d]``. Under tensor parallelism the weights are one rank's shard (its heads, its part of the MLP) and
``all_reduce`` sums the output and down projections' partial results over the ranks.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from kernels.layer import (
    CompiledAttention,
    compiled_runs,
    layer_attend_output,
    layer_decode,
    layer_output,
    rms_norm_matmul,
)

__all__ = ["LlamaLayer", "layer_names"]

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (layer, q, k, v) -> out
_TENSORS = ("input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
            "self_attn.o_proj.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
            "mlp.up_proj.weight", "mlp.down_proj.weight")


def layer_names(i: int) -> list[str]:
    """The Hugging Face names of layer ``i``'s nine tensors."""
    return [f"model.layers.{i}.{n}" for n in _TENSORS]


class LlamaLayer:
    """Layer ``index``'s weights, read by Hugging Face name, and its forward.

    The projections are stored transposed, ``[in, out]`` contiguous: ``qkv_t [hidden, (H + 2 H_kv) d]`` (q_proj,
    k_proj, v_proj stacked), ``o_t [H d, hidden]``, ``gate_up_t [hidden, 2 ffn]`` (gate_proj, up_proj stacked),
    ``down_t [ffn, hidden]``; beside them ``norm_in`` and ``norm_mlp [hidden]``. ``x @ w_t`` of a few rows (a
    decode step) runs 1.5-2.5x faster on CPU than ``x @ w.T`` of the Hugging Face layout, and as fast for many
    rows. ``qkv`` is the stacked projections' Hugging Face layout (a view; LightCache reads its key rows)."""

    def __init__(self, index: int, weight: Callable[[str], torch.Tensor], head_dim: int, eps: float):
        p = f"model.layers.{index}."
        q, k, v = (weight(p + f"self_attn.{n}_proj.weight") for n in "qkv")
        self.index, self.head_dim, self.eps = index, head_dim, eps
        self.heads = (len(q) // head_dim, len(k) // head_dim, len(v) // head_dim)
        self.qkv_t = torch.cat([q, k, v]).T.contiguous()
        self.o_t = weight(p + "self_attn.o_proj.weight").T.contiguous()
        gate_up = torch.cat([weight(p + "mlp.gate_proj.weight"), weight(p + "mlp.up_proj.weight")])
        self.gate_up_t = gate_up.T.contiguous()
        self.down_t = weight(p + "mlp.down_proj.weight").T.contiguous()
        self.norm_in = weight(p + "input_layernorm.weight")
        self.norm_mlp = weight(p + "post_attention_layernorm.weight")

    @property
    def qkv(self) -> torch.Tensor:
        """The stacked q, k, v projections in the Hugging Face layout ``[(H + 2 H_kv) d, hidden]`` (a view)."""
        return self.qkv_t.T

    def attention_input(self, x: torch.Tensor, rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                        channel: Optional[int] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(heads, channel_values)``: the q, k and v heads of the tokens ``x [t, hidden]`` (rows = tokens):
        RMSNorm, then one matmul over the stacked projections; ``heads [t, H + 2 H_kv, d]``, the query heads first,
        then the key and the value heads, before RoPE, or with q and k rotated by ``rope``'s tables (``cos [t, d]``,
        signed ``sin [t, 1 or H + H_kv, d]``, :func:`~dmc_train.models.rope.rope_tables`) in the same call
        (:func:`kernels.layer.rms_norm_matmul`). ``channel_values [t, H + H_kv]``: the q and k heads' values at
        ``channel`` before RoPE (DMC's decisions), None without ``channel``."""
        h, g, _ = self.heads
        heads, channel_values = rms_norm_matmul(x, self.norm_in, self.eps, self.qkv_t, rope, h + g, self.head_dim,
                                                channel)
        return heads.view(len(x), -1, self.head_dim), channel_values

    def attention_output(self, x: torch.Tensor, out: torch.Tensor,
                         all_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
        """The layer's output ``[t, hidden]`` of its input ``x [t, hidden]`` and the attention's ``out [t, H d]``
        (rows = tokens, each token's heads side by side): output projection -> residual -> RMSNorm -> SwiGLU ->
        residual (:func:`kernels.layer.layer_output`)."""
        return layer_output(x, out, self.o_t, self.norm_mlp, self.eps, self.gate_up_t, self.down_t, all_reduce)

    def runs_compiled(self) -> bool:
        """True when this layer's weights take the compiled CPU kernel (fp32, :func:`kernels.layer.compiled_runs`):
        then :meth:`decode_with` runs."""
        return compiled_runs(self.norm_in, self.qkv_t, self.o_t, self.norm_mlp, self.gate_up_t, self.down_t)

    def decode_with(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attention: CompiledAttention,
                    channel: Optional[int] = None) -> torch.Tensor:
        """The layer's output ``[t, hidden]`` of a decode step's tokens ``x [t, hidden]`` in one compiled call, its
        attention a compiled function over the projected heads (a cache's: ``KVCache.compiled_attention``; q and k
        rotated by ``rope``'s tables first; ``channel``: the attention also gets the q and k heads' values there before
        RoPE, DMC's decision channel): :meth:`attention_input`, the attention and :meth:`attention_output`'s
        arithmetic (:func:`kernels.layer.layer_decode`; only where :meth:`runs_compiled`)."""
        h, g, _ = self.heads
        return layer_decode(x, self.norm_in, self.eps, self.qkv_t, rope, h + g, self.head_dim, attention, self.o_t,
                            self.norm_mlp, self.gate_up_t, self.down_t, channel)

    def attend_output_with(self, x: torch.Tensor, heads: torch.Tensor, attention: CompiledAttention) -> torch.Tensor:
        """:meth:`decode_with` from the layer's ``heads`` (:meth:`attention_input`'s) on: the attention and
        :meth:`attention_output` in one compiled call (for a cache whose step needs the heads first: DMC's
        decisions; :func:`kernels.layer.layer_attend_output`)."""
        return layer_attend_output(x, heads, attention, self.o_t, self.norm_mlp, self.eps, self.gate_up_t,
                                   self.down_t)

    def __call__(self, x: torch.Tensor, attend: Attend,
                 all_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
        """``x [b, n, hidden]`` after this layer; ``attend(index, q, k, v)`` is the attention core (q and k before
        RoPE): :meth:`attention_input`, then the attention, then :meth:`attention_output`."""
        b, n, hidden = x.shape
        x = x.reshape(b * n, hidden)  # rows = tokens: every projection is one 2-d matmul (torch.mm: one call)
        q, k, v = self.attention_input(x)[0].view(b, n, -1, self.head_dim).split(self.heads, 2)
        out = attend(self.index, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # [b, H, n, d]
        return self.attention_output(x, out.transpose(1, 2).reshape(b * n, -1), all_reduce).view(b, n, hidden)
