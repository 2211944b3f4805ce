"""Core attention modules for the layer spec's ``core_attention`` slot.

Interface (megatron ``SelfAttention``): ``forward(query, key, value, attention_mask, attn_mask_type=...)``
with RoPE-applied ``query [sq, b, heads/TP, hd]``, ``key/value [sk, b, groups/TP, hd]``; returns
``[sq, b, heads/TP * hd]``. Methods (DMC) plug their own module into the same slot.
"""

import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule


class SDPACoreAttention(MegatronModule):
    """Causal attention with torch SDPA (flash / memory-efficient kernels where available), GQA native."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str = "self",
                 attention_dropout=None, softmax_scale=None, **_unused):
        super().__init__(config=config)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, **_unused):
        sq, b, nh, hd = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0,
            scale=self.softmax_scale, enable_gqa=k.shape[1] != nh)
        return out.permute(2, 0, 1, 3).reshape(sq, b, nh * hd)
