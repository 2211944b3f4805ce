"""A plain-torch Llama forward under Hugging Face's rules, one layer at a time, weights fetched on demand.

    logits = streaming_logits(fetch, model_cfg, tokens)     # [b, s, vocab], fp32

``fetch(names) -> {name: tensor}`` returns Hugging Face ``LlamaForCausalLM`` tensors by name (any
dtype; the forward computes in fp32). The forward asks for ``model.embed_tokens.weight``, then the
nine tensors of one layer at a time (``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight``,
``mlp.{gate,up,down}_proj.weight``, ``input_layernorm.weight``, ``post_attention_layernorm.weight``),
then ``model.norm.weight`` and ``lm_head.weight``, and drops each group before fetching the next, so
memory stays near the largest tensor or one layer plus the activations ``[b, s, hidden]``, whatever
the model size. The importer verifies what it wrote with it (the Hugging Face tensors against the
checkpoint's) without holding either model.

What it computes is transformers' ``LlamaForCausalLM`` without padding or cache: RMSNorm in fp32
(``w * x / sqrt(mean(x^2) + eps)``), RoPE with ``rotate_half`` at positions ``0..s-1`` (the model's
frequencies, ``model.rope_scaling`` included, from :func:`~dmc_train.models.rope.model_inv_freq`, or the
``inv_freq`` given: the importer passes transformers' own, so a misread RoPE config shows), causal
attention with GQA (query head ``j`` reads KV head ``j // (heads / kv_heads)``, scale ``1/sqrt(d)``),
SwiGLU ``down(silu(gate x) * up x)``, a final RMSNorm and ``lm_head``. ``tests/conversion`` checks it
against transformers on tiny models.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from dmc_train.models.norm import rms_norm
from dmc_train.models.rope import model_inv_freq, rope_angles, rotate_half_rope

__all__ = ["streaming_logits", "layer_names"]

Fetch = Callable[[list[str]], dict[str, torch.Tensor]]
_LAYER = ("input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
          "self_attn.o_proj.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
          "mlp.up_proj.weight", "mlp.down_proj.weight")


def layer_names(i: int) -> list[str]:
    """The Hugging Face names of layer ``i``'s nine tensors."""
    return [f"model.layers.{i}.{n}" for n in _LAYER]


def _layer(x: torch.Tensor, w: dict[str, torch.Tensor], heads: int, kv_heads: int, eps: float,
           cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """One decoder layer on ``x [b, s, hidden]`` (fp32) with the layer's tensors ``w`` (short names)."""
    b, s, hidden = x.shape
    d = hidden // heads
    h = rms_norm(x, w["input_layernorm.weight"], eps)
    q = F.linear(h, w["self_attn.q_proj.weight"].float()).view(b, s, heads, d).transpose(1, 2)
    k = F.linear(h, w["self_attn.k_proj.weight"].float()).view(b, s, kv_heads, d).transpose(1, 2)
    v = F.linear(h, w["self_attn.v_proj.weight"].float()).view(b, s, kv_heads, d).transpose(1, 2)
    q, k = rotate_half_rope(q, cos, sin), rotate_half_rope(k, cos, sin)
    k, v = k.repeat_interleave(heads // kv_heads, dim=1), v.repeat_interleave(heads // kv_heads, dim=1)
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, hidden)
    x = x + F.linear(attn, w["self_attn.o_proj.weight"].float())
    h = rms_norm(x, w["post_attention_layernorm.weight"], eps)
    mlp = F.silu(F.linear(h, w["mlp.gate_proj.weight"].float())) * F.linear(h, w["mlp.up_proj.weight"].float())
    return x + F.linear(mlp, w["mlp.down_proj.weight"].float())


@torch.no_grad()
def streaming_logits(fetch: Fetch, model: Any, tokens: torch.Tensor,
                     inv_freq: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Logits ``[b, s, vocab]`` (fp32) of the Llama whose tensors ``fetch`` gives, on ``tokens [b, s]``
    (no padding). ``model`` is the ``model`` config node (layers, heads, KV groups, RoPE base and scaling,
    norm eps); ``inv_freq [head_dim / 2]`` replaces the RoPE frequencies it implies."""
    heads = model.num_attention_heads
    kv_heads = model.num_query_groups or heads
    eps = float(model.norm_epsilon)
    x = F.embedding(tokens, fetch(["model.embed_tokens.weight"])["model.embed_tokens.weight"].float())
    cos, sin = rope_angles(torch.arange(tokens.shape[1]), model_inv_freq(model) if inv_freq is None else inv_freq)
    for i in range(model.num_layers):
        names = layer_names(i)
        got = fetch(names)
        x = _layer(x, {short: got[n] for short, n in zip(_LAYER, names)}, heads, kv_heads, eps, cos, sin)
        del got
    x = rms_norm(x, fetch(["model.norm.weight"])["model.norm.weight"], eps)
    return F.linear(x, fetch(["lm_head.weight"])["lm_head.weight"].float())
