"""Two independent implementations of DMC inference agree: the exported model's modeling file
(transformers, padded per-head cache) and the engine's model (plain tensors, paged cache), on the
same weights, for both RoPE orders and both accumulations, and with the released code's omega eps
and bf16 decision threshold."""

import pytest
import torch

from dmc_train.conversion.hf_dmc import modeling_dmc_llama as dmc_hf
from dmc_train.inference.dmc_decisions import DMCInference
from dmc_train.inference.model import LlamaForInference, ModelShape
from dmc_train.models.dmc_settings import DMCSettings

RELEASED = {"omega_eps": 2.0 ** -7, "decision_threshold": 0.00785}  # the released code's bf16 values


@pytest.mark.parametrize("rope_order, accumulation, options", [
    ("post", "exact", {}), ("post", "window", {}), ("pre", "exact", {}), ("pre", "window", {}),
    ("pre", "window", RELEASED)])
def test_transformers_file_and_engine_model_agree(rope_order, accumulation, options):
    torch.manual_seed(0)
    config = dmc_hf.DMCLlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, dmc_init_offset=0.0,
                                   dmc_accumulation=accumulation, dmc_window=3, dmc_rope_order=rope_order,
                                   rope_theta=10000.0, **{f"dmc_{k}": v for k, v in options.items()})
    hf = dmc_hf.DMCLlamaForCausalLM(config).eval()
    shape = ModelShape(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_heads=4, num_kv_heads=2, vocab_size=64,
                       norm_eps=config.rms_norm_eps, rope_base=10000.0, max_positions=128)
    settings = DMCSettings(channel=config.dmc_decision_channel, init_offset=0.0, accumulation=accumulation,
                           window=3, rope_order=rope_order, **options)
    ours = LlamaForInference(shape, hf.state_dict(), DMCInference(settings))
    ids = torch.randint(0, 64, (2, 20))
    with torch.no_grad():
        full = hf(ids, use_cache=False).logits
        cache = dmc_hf.DMCCache(config)  # the transformers cache: prefill a chunk, then token by token
        steps = [hf(ids[:, :7], past_key_values=cache).logits]
        steps += [hf(ids[:, t: t + 1], past_key_values=cache).logits for t in range(7, 20)]
    torch.testing.assert_close(ours.forward(ids), full, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-4)
