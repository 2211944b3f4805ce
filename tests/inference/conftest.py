"""A tiny random Llama for the inference tests (built here, in HF names, no checkpoint needed)."""

import pytest
import torch

from dmc_train.inference.model import LlamaForInference, ModelShape
from dmc_train.methods.configs import DMCSettings

SHAPE = ModelShape(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_heads=4, num_kv_heads=2, vocab_size=50,
                   max_positions=128)
# init_offset 0 with these random weights: about half the decisions merge, so every test sees both kinds
VARIANTS = {
    "full": None,
    "dmc_exact": DMCSettings(channel=SHAPE.head_dim - 1, init_offset=0.0),
    "dmc_window": DMCSettings(channel=SHAPE.head_dim - 1, init_offset=0.0, accumulation="window", window=3),
    "dmc_hardc": DMCSettings(channel=0, init_offset=0.0, shared=True),
    "dmc_pre": DMCSettings(channel=SHAPE.head_dim - 1, init_offset=0.0, rope_order="pre"),
    "dmc_pre_window": DMCSettings(channel=SHAPE.head_dim - 1, init_offset=0.0, rope_order="pre",
                                  accumulation="window", window=3),
    "fixed_pooling": DMCSettings(channel=None, pool=3),
}


def random_weights(shape: ModelShape = SHAPE, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d, h, ffn = shape.head_dim, shape.hidden_size, shape.ffn_hidden_size

    def rnd(*size):
        return torch.randn(*size, generator=g) * 0.2

    w = {"model.embed_tokens.weight": rnd(shape.vocab_size, h), "lm_head.weight": rnd(shape.vocab_size, h),
         "model.norm.weight": 1 + rnd(h)}
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        w.update({p + "self_attn.q_proj.weight": rnd(shape.num_heads * d, h),
                  p + "self_attn.k_proj.weight": rnd(shape.num_kv_heads * d, h),
                  p + "self_attn.v_proj.weight": rnd(shape.num_kv_heads * d, h),
                  p + "self_attn.o_proj.weight": rnd(h, shape.num_heads * d),
                  p + "mlp.gate_proj.weight": rnd(ffn, h), p + "mlp.up_proj.weight": rnd(ffn, h),
                  p + "mlp.down_proj.weight": rnd(h, ffn),
                  p + "input_layernorm.weight": 1 + rnd(h), p + "post_attention_layernorm.weight": 1 + rnd(h)})
    return w


@pytest.fixture(scope="session")
def make_model():
    weights = random_weights()

    def make(variant: str = "full", dtype=torch.float32) -> LlamaForInference:
        return LlamaForInference(SHAPE, weights, VARIANTS[variant], dtype)

    return make
