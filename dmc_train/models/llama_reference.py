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
against transformers on tiny models. The layer is :class:`~dmc_train.models.llama_layer.LlamaLayer`, the
inference model's, here with causal SDPA over the whole sequence as its attention.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from dmc_train.models.llama_layer import LlamaLayer, layer_names
from dmc_train.models.norm import rms_norm
from dmc_train.models.rope import model_inv_freq, rope_angles, rotate_half_rope

__all__ = ["streaming_logits"]

Fetch = Callable[[list[str]], dict[str, torch.Tensor]]


def _fetch_layer(fetch: Fetch, i: int, head_dim: int, eps: float) -> LlamaLayer:
    """Layer ``i`` in fp32; the fetched tensors are dropped on return (the layer holds what it computes with)."""
    got = fetch(layer_names(i))
    return LlamaLayer(i, lambda name: got[name].float(), head_dim, eps)


@torch.no_grad()
def streaming_logits(fetch: Fetch, model: Any, tokens: torch.Tensor,
                     inv_freq: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Logits ``[b, s, vocab]`` (fp32) of the Llama whose tensors ``fetch`` gives, on ``tokens [b, s]``
    (no padding). ``model`` is the ``model`` config node (layers, heads, RoPE base and scaling,
    norm eps); ``inv_freq [head_dim / 2]`` replaces the RoPE frequencies it implies."""
    heads = model.num_attention_heads
    eps = float(model.norm_epsilon)
    x = F.embedding(tokens, fetch(["model.embed_tokens.weight"])["model.embed_tokens.weight"].float())
    cos, sin = rope_angles(torch.arange(tokens.shape[1]), model_inv_freq(model) if inv_freq is None else inv_freq)

    def attend(layer, q, k, v):  # [b, H, s, d], [b, H_kv, s, d] x 2 -> [b, H, s, d]: causal, GQA
        q, k = rotate_half_rope(q, cos, sin), rotate_half_rope(k, cos, sin)
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    for i in range(model.num_layers):  # each layer is dropped before the next one is fetched
        x = _fetch_layer(fetch, i, x.shape[-1] // heads, eps)(x, attend)
    x = rms_norm(x, fetch(["model.norm.weight"])["model.norm.weight"], eps)
    return F.linear(x, fetch(["lm_head.weight"])["lm_head.weight"].float())
