"""Hugging Face Llama ``config.json`` <-> this project's ``model`` config (torch-free).

Llama-family checkpoints (Llama 2, Llama 3 shapes: MHA or GQA, any ``rope_theta``, tied or untied
embeddings) map one to one onto the ``model`` node; anything this project's model cannot represent
is refused with a one-line :class:`~dmc_train.errors.ConfigError` naming the field.

Both spellings of RoPE are read: transformers 5.x writes ``rope_parameters: {rope_theta, rope_type}``,
older files (Llama 2 on the hub) a top-level ``rope_theta`` and ``rope_scaling``. Only the default
(unscaled) RoPE is supported; a scaled one (``llama3``, ``linear``, ``dynamic``, ``yarn`` ...) is refused.
"""

from __future__ import annotations

from typing import Any

from dmc_train.config import kv_groups
from dmc_train.errors import ConfigError

ARCHITECTURES = ("LlamaForCausalLM",)


def _rope(hf: dict) -> tuple[float, str]:
    """``(rope_theta, rope_type)`` from either spelling."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    return float(theta), rope_type


def model_config_from_hf(hf: dict, name: str = "hf_llama") -> dict[str, Any]:
    """The ``model`` node (a plain dict) for a Hugging Face ``config.json`` dict; one-line ConfigError
    for what the project's Llama cannot represent."""
    arch = hf.get("architectures") or ["LlamaForCausalLM"]
    if hf.get("model_type", "llama") != "llama" or not set(arch) <= set(ARCHITECTURES):
        raise ConfigError(f"config.json describes model_type={hf.get('model_type')!r} architectures={arch}; "
                          f"only Llama-family models ({', '.join(ARCHITECTURES)}) can be imported")
    theta, rope_type = _rope(hf)
    if rope_type != "default":
        raise ConfigError(f"config.json has rope scaling of type {rope_type!r}; only unscaled RoPE is supported "
                          f"(remove rope_scaling or use a model without it)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ConfigError(f"config.json sets {key}=true; the project's Llama has no biases")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config.json sets hidden_act={hf['hidden_act']!r}; only silu (SwiGLU) is supported")
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    head_dim = hf.get("head_dim") or hidden // heads
    if head_dim * heads != hidden:
        raise ConfigError(f"config.json has head_dim={head_dim} x num_attention_heads={heads} != "
                          f"hidden_size={hidden}; the project's Llama needs head_dim = hidden_size / heads")
    groups = hf.get("num_key_value_heads") or heads
    return {
        "name": name,
        "num_layers": hf["num_hidden_layers"],
        "hidden_size": hidden,
        "ffn_hidden_size": hf["intermediate_size"],
        "num_attention_heads": heads,
        "num_query_groups": None if groups == heads else groups,
        "vocab_size": hf["vocab_size"],
        "max_position_embeddings": hf.get("max_position_embeddings", 4096),
        "rotary_base": int(theta) if float(theta).is_integer() else theta,
        "norm_epsilon": hf.get("rms_norm_eps", 1e-5),
        "init_method_std": hf.get("initializer_range", 0.02),
    }


def hf_config_from_model(model: Any, tie_word_embeddings: bool = False, dtype: str = "float32") -> dict[str, Any]:
    """A ``LlamaForCausalLM`` ``config.json`` dict for the ``model`` node (transformers 5.x spelling)."""
    heads = model.num_attention_heads
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": model.vocab_size,
        "hidden_size": model.hidden_size,
        "intermediate_size": model.ffn_hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_groups(model),
        "head_dim": model.hidden_size // heads,
        "hidden_act": "silu",
        "max_position_embeddings": model.max_position_embeddings,
        "initializer_range": model.init_method_std,
        "rms_norm_eps": model.norm_epsilon,
        "rope_parameters": {"rope_theta": float(model.rotary_base), "rope_type": "default"},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tie_word_embeddings,
        "dtype": dtype,
    }
