"""Hugging Face Llama ``config.json`` <-> this project's ``model`` config (torch-free).

Llama-family checkpoints (Llama 2, Llama 3.x: MHA or GQA, any ``rope_theta``, unscaled / ``linear`` /
``llama3`` RoPE, tied or untied embeddings) map one to one onto the ``model`` node; anything this
project's model cannot represent is refused with a one-line :class:`~dmc_train.errors.ConfigError`
naming the field.

RoPE is read as the pinned transformers (5.23, ``RotaryEmbeddingConfigMixin``) reads it, from either
spelling: transformers 5.x writes ``rope_parameters: {rope_type, rope_theta, factor, ...}``, older files
(Llama 2 / 3.1 on the hub) a top-level ``rope_theta`` and ``rope_scaling``. Types ``default`` (unscaled),
``linear`` and ``llama3`` map onto ``model.rope_scaling``; any other (``dynamic``, ``yarn``, ``longrope``,
...) is refused in one line naming it. See :func:`read_rope`.
"""

from __future__ import annotations

from typing import Any, Optional

from dmc_train.config import kv_groups, rope_scaling_of
from dmc_train.errors import ConfigError

ARCHITECTURES = ("LlamaForCausalLM",)


SUPPORTED_ROPE = {"default": "none", "linear": "linear", "llama3": "llama3"}  # HF rope_type -> model.rope_scaling.type


def read_rope(hf: dict) -> tuple[float, dict[str, Any]]:
    """``(rope_theta, rope_scaling)`` of a ``config.json`` dict, by transformers 5.23's rules:

    - a non-empty ``rope_scaling`` replaces ``rope_parameters`` as a whole (a ``rope_theta`` inside
      ``rope_parameters`` is then not used);
    - the type is ``rope_type``, else the legacy ``type``, else ``default``;
    - ``rope_theta`` is the parameters' own, else the top-level ``rope_theta``, else 10000;
    - ``llama3``'s ``original_max_position_embeddings`` is a top-level one if present, else the
      parameters' own, else ``max_position_embeddings``.

    ``rope_scaling`` is the ``model.rope_scaling`` node (``type`` none / linear / llama3 and the fields it
    uses). One-line ConfigError for an unsupported type, a missing field or a partial rotary dimension."""
    scaling = hf.get("rope_scaling")
    params = dict(scaling or hf.get("rope_parameters") or {})
    source = "rope_scaling" if scaling else "rope_parameters"
    rope_type = params["rope_type"] if "rope_type" in params else params.get("type", "default")
    if rope_type not in SUPPORTED_ROPE:
        raise ConfigError(f"config.json has RoPE of type {rope_type!r} ({source}); the project supports "
                          f"{', '.join(SUPPORTED_ROPE)} (unscaled, linear, Llama 3.x)")
    theta = params["rope_theta"] if "rope_theta" in params else hf.get("rope_theta", 10000.0)
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise ConfigError(f"config.json sets partial_rotary_factor={partial}; the project's Llama rotates whole heads")
    needed = {"default": (), "linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}
    missing = [k for k in needed[rope_type] if params.get(k) is None]
    if missing:
        raise ConfigError(f"config.json's {source} of type {rope_type!r} lacks {', '.join(missing)}; "
                          f"transformers cannot load it either")
    out: dict[str, Any] = {"type": SUPPORTED_ROPE[rope_type]}
    for key in needed[rope_type]:
        out[key] = float(params[key])
    if rope_type == "llama3":
        out["original_max_position_embeddings"] = int(hf.get("original_max_position_embeddings") or params.get(
            "original_max_position_embeddings") or hf.get("max_position_embeddings", 2048))
    return float(theta), out


def rope_scaling_fields(model: Any) -> dict[str, Any]:
    """``model.rope_scaling`` of a ``model`` node reduced to its type and the fields that type uses (what
    :func:`read_rope` returns), for comparing two configs' RoPE."""
    r = rope_scaling_of(model)
    out: dict[str, Any] = {"type": r.type}
    if r.type in ("linear", "llama3"):
        out["factor"] = float(r.factor)
    if r.type == "llama3":
        out.update(low_freq_factor=float(r.low_freq_factor), high_freq_factor=float(r.high_freq_factor),
                   original_max_position_embeddings=int(r.original_max_position_embeddings))
    return out


def rope_parameters(model: Any, theta: Optional[float] = None) -> dict[str, Any]:
    """The ``rope_parameters`` of a ``config.json`` (transformers 5.x spelling) for the ``model`` node (or anything
    with a ``rope_scaling``, ``theta`` its base; default ``model.rotary_base``): ``rope_type``, ``rope_theta`` and
    the fields of its type (``model.rope_scaling``)."""
    fields = rope_scaling_fields(model)
    hf_type = {v: k for k, v in SUPPORTED_ROPE.items()}[fields.pop("type")]
    return {"rope_theta": float(model.rotary_base if theta is None else theta), "rope_type": hf_type, **fields}


def model_config_from_hf(hf: dict, name: str = "hf_llama") -> dict[str, Any]:
    """The ``model`` node (a plain dict) for a Hugging Face ``config.json`` dict; one-line ConfigError
    for what the project's Llama cannot represent."""
    arch = hf.get("architectures") or ["LlamaForCausalLM"]
    if hf.get("model_type", "llama") != "llama" or not set(arch) <= set(ARCHITECTURES):
        raise ConfigError(f"config.json describes model_type={hf.get('model_type')!r} architectures={arch}; "
                          f"only Llama-family models ({', '.join(ARCHITECTURES)}) can be imported")
    theta, rope_scaling = read_rope(hf)
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
        "max_position_embeddings": hf.get("max_position_embeddings", 2048),  # LlamaConfig's defaults
        "rotary_base": int(theta) if float(theta).is_integer() else theta,
        "rope_scaling": rope_scaling,
        "norm_epsilon": hf.get("rms_norm_eps", 1e-6),
        "init_method_std": hf.get("initializer_range", 0.02),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),  # LlamaConfig's default: untied
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
        "rope_parameters": rope_parameters(model),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tie_word_embeddings,
        "dtype": dtype,
    }
