"""The weight layout of our megatron-core Llama, decoded in one place.

Fused QKV. ``self_attention.linear_qkv.weight`` is ``[groups * (heads/groups + 2) * d, hidden]``
(``d`` = head dim): for every query group its ``heads/groups`` query heads, then its key head, then
its value head, ``d`` rows each. Query head ``j`` belongs to group ``j // (heads/groups)``. A tensor
parallel shard has the same layout with the local counts (``heads/TP`` heads, ``groups/TP`` groups).

SwiGLU. ``mlp.linear_fc1.weight`` is ``cat([gate, up])`` (a TP shard: ``cat([gate shard, up shard])``).

Names. :data:`MEGATRON_TO_HF` maps megatron-core ``GPTModel`` state-dict names (our spec,
``dmc_train/models/llama.py``) to Hugging Face ``LlamaForCausalLM`` names; :func:`megatron_to_hf` and
:func:`hf_to_megatron` convert whole TP=1 state dicts. No RoPE permutation is needed: megatron's
non-interleaved rotary embedding rotates halves like Hugging Face's ``rotate_half``.

Parameter counts from a config: :func:`count_parameters` (torch-free, in ``dmc_train.models.shape``).

Imports torch only (no megatron): usable by converters and tools that never build a model.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

import torch

from dmc_train.models.shape import count_parameters, layer_parameters  # re-exported (__all__)

__all__ = ["qkv_by_group", "split_qkv", "merge_qkv", "split_fc1", "merge_fc1", "MEGATRON_TO_HF",
           "HF_TO_MEGATRON", "hf_names", "megatron_name", "megatron_to_hf", "hf_to_megatron", "count_parameters",
           "layer_parameters"]


# ----------------------------------------------------------------------------------------------
# Fused QKV and fc1
# ----------------------------------------------------------------------------------------------
def qkv_by_group(weight: torch.Tensor, num_heads: int, num_groups: int) -> torch.Tensor:
    """View of ``linear_qkv.weight`` as ``[groups, heads/groups + 2, d, hidden]``.

    Index ``[:, :heads/groups]`` are a group's query heads, ``[:, -2]`` its key head, ``[:, -1]`` its
    value head. A view (writes go to ``weight``), so ``weight`` must be contiguous. For a TP shard
    pass the local counts (``num_attention_heads_per_partition``, ``num_query_groups_per_partition``).
    """
    if num_groups < 1 or num_heads % num_groups:
        raise ValueError(f"num_groups={num_groups} must divide num_heads={num_heads}")
    per_group = num_heads // num_groups
    rows = num_groups * (per_group + 2)
    if weight.dim() != 2 or weight.shape[0] % rows:
        raise ValueError(f"linear_qkv weight of shape {tuple(weight.shape)} is not [{rows} * head_dim, hidden] "
                         f"({num_heads} heads, {num_groups} groups)")
    return weight.view(num_groups, per_group + 2, weight.shape[0] // rows, weight.shape[1])


def split_qkv(weight: torch.Tensor, num_heads: int, num_groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``linear_qkv.weight`` -> ``(q [heads, d, hidden], k [groups, d, hidden], v [groups, d, hidden])``,
    heads in global order. The results may share storage with ``weight``: read them, or clone first;
    edit in place through :func:`qkv_by_group`."""
    w = qkv_by_group(weight, num_heads, num_groups)
    per_group = num_heads // num_groups
    return w[:, :per_group].reshape(num_heads, *w.shape[2:]), w[:, per_group], w[:, per_group + 1]


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`split_qkv`: ``q [heads, d, hidden]``, ``k``/``v [groups, d, hidden]`` ->
    ``linear_qkv.weight [groups * (heads/groups + 2) * d, hidden]`` (a new tensor)."""
    heads, groups = q.shape[0], k.shape[0]
    if q.dim() != 3 or k.shape != v.shape or k.shape[1:] != q.shape[1:] or heads % groups:
        raise ValueError(f"cannot merge q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected "
                         f"[heads, d, hidden] and [groups, d, hidden] with groups dividing heads")
    q = q.reshape(groups, heads // groups, *q.shape[1:])
    return torch.cat([q, k.unsqueeze(1), v.unsqueeze(1)], dim=1).reshape(-1, q.shape[-1])


def split_fc1(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``linear_fc1.weight [2 * ffn, hidden]`` -> ``(gate, up)``, each ``[ffn, hidden]`` (views)."""
    if weight.shape[0] % 2:
        raise ValueError(f"linear_fc1 weight of shape {tuple(weight.shape)} has an odd number of rows; "
                         f"expected cat([gate, up])")
    gate, up = weight.chunk(2, dim=0)
    return gate, up


def merge_fc1(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`split_fc1`: ``cat([gate, up])``."""
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")
    return torch.cat([gate, up], dim=0)


# ----------------------------------------------------------------------------------------------
# megatron-core <-> Hugging Face names
# ----------------------------------------------------------------------------------------------
_L, _HL = "decoder.layers.{i}.", "model.layers.{i}."

#: megatron-core name -> Hugging Face name(s); ``{i}`` is the (global) layer number, 0-based in both.
#: Fused tensors map to several names in order: QKV -> (q, k, v), fc1 -> (gate, up).
MEGATRON_TO_HF: dict[str, tuple[str, ...]] = {
    "embedding.word_embeddings.weight": ("model.embed_tokens.weight",),
    _L + "input_layernorm.weight": (_HL + "input_layernorm.weight",),
    _L + "self_attention.linear_qkv.weight": (_HL + "self_attn.q_proj.weight", _HL + "self_attn.k_proj.weight",
                                              _HL + "self_attn.v_proj.weight"),
    _L + "self_attention.linear_proj.weight": (_HL + "self_attn.o_proj.weight",),
    _L + "pre_mlp_layernorm.weight": (_HL + "post_attention_layernorm.weight",),
    _L + "mlp.linear_fc1.weight": (_HL + "mlp.gate_proj.weight", _HL + "mlp.up_proj.weight"),
    _L + "mlp.linear_fc2.weight": (_HL + "mlp.down_proj.weight",),
    "decoder.final_layernorm.weight": ("model.norm.weight",),
    "output_layer.weight": ("lm_head.weight",),
}

#: Hugging Face name -> (megatron-core name, position among the parts of a fused tensor).
HF_TO_MEGATRON: dict[str, tuple[str, int]] = {
    hf: (mc, pos) for mc, hfs in MEGATRON_TO_HF.items() for pos, hf in enumerate(hfs)}

# Entries that carry no weights: megatron's per-module ``_extra_state`` (None for our local spec),
# the rotary ``inv_freq`` buffer older Hugging Face checkpoints store.
_MEGATRON_SKIP = re.compile(r"(^|\.)_extra_state$")
_HF_SKIP = re.compile(r"\.rotary_emb\.inv_freq$")


def _template(name: str, prefix: str) -> tuple[str, str | None]:
    """(name with its layer number replaced by ``{i}``, the layer number or None)."""
    m = re.match(re.escape(prefix) + r"(\d+)\.", name)
    if m is None:
        return name, None
    return prefix + "{i}." + name[m.end():], m.group(1)


def hf_names(megatron_name: str) -> tuple[str, ...]:
    """Hugging Face name(s) of one megatron-core state-dict name (KeyError if it has none)."""
    template, layer = _template(megatron_name, "decoder.layers.")
    if template not in MEGATRON_TO_HF:
        raise KeyError(f"no Hugging Face name for megatron parameter {megatron_name!r}")
    return tuple(n.format(i=layer) for n in MEGATRON_TO_HF[template])


def megatron_name(hf_name: str) -> str:
    """The megatron-core name of the tensor that holds the Hugging Face tensor ``hf_name`` (for q/k/v the
    fused ``linear_qkv``, for gate/up ``linear_fc1``); KeyError if it has none."""
    template, layer = _template(hf_name, "model.layers.")
    if template not in HF_TO_MEGATRON:
        raise KeyError(f"no megatron name for Hugging Face parameter {hf_name!r}")
    return HF_TO_MEGATRON[template][0].format(i=layer)


def _splitter(name: str, num_heads: int, num_groups: int) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]]:
    if name.endswith("linear_qkv.weight"):
        return lambda w: tuple(x.reshape(-1, w.shape[-1]) for x in split_qkv(w, num_heads, num_groups))
    if name.endswith("linear_fc1.weight"):
        return split_fc1
    return lambda w: (w,)


def megatron_to_hf(state: Mapping[str, torch.Tensor], num_heads: int, num_groups: int) -> dict[str, torch.Tensor]:
    """A full (TP=1, all layers) megatron-core state dict -> Hugging Face ``LlamaForCausalLM`` names.

    Fused tensors are split (q/k/v ``[heads*d | groups*d, hidden]``, gate/up) into tensors that own
    their storage (safetensors refuses shared storage); ``_extra_state`` entries are dropped; any
    other unknown name raises KeyError.
    """
    out: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        if _MEGATRON_SKIP.search(name):
            continue
        names = hf_names(name)
        parts = _splitter(name, num_heads, num_groups)(value)
        for hf, part in zip(names, parts):
            out[hf] = part.clone() if len(names) > 1 else part
    return out


def hf_to_megatron(state: Mapping[str, torch.Tensor], num_heads: int, num_groups: int) -> dict[str, torch.Tensor]:
    """A Hugging Face ``LlamaForCausalLM`` state dict -> megatron-core names (full, TP=1).

    q/k/v are merged into ``linear_qkv`` and gate/up into ``linear_fc1``. The result has no
    ``_extra_state`` entries, so load it with ``model.load_state_dict(sd, strict=False)`` and require
    empty ``missing_keys`` and ``unexpected_keys`` (torch lists an absent ``_extra_state`` only when
    strict). Unknown names and incomplete fused tensors raise KeyError; the rotary ``inv_freq``
    buffer of older checkpoints is ignored.
    """
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for name, value in state.items():
        if _HF_SKIP.search(name):
            continue
        template, layer = _template(name, "model.layers.")
        if template not in HF_TO_MEGATRON:
            raise KeyError(f"no megatron name for Hugging Face parameter {name!r}")
        mc, pos = HF_TO_MEGATRON[template]
        parts.setdefault(mc.format(i=layer), {})[pos] = value
    out: dict[str, torch.Tensor] = {}
    for name, got in parts.items():
        template, _ = _template(name, "decoder.layers.")
        want = MEGATRON_TO_HF[template]
        if len(got) != len(want):
            missing = [n for pos, n in enumerate(hf_names(name)) if pos not in got]
            raise KeyError(f"{name} needs {', '.join(missing)} too")
        if name.endswith("linear_qkv.weight"):
            q, k, v = got[0], got[1], got[2]
            hidden = q.shape[-1]
            d = q.shape[0] // num_heads
            if q.shape[0] != num_heads * d or k.shape[0] != num_groups * d or v.shape != k.shape:
                raise ValueError(f"{name}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not "
                                 f"fit {num_heads} heads and {num_groups} groups")
            out[name] = merge_qkv(q.reshape(num_heads, d, hidden), k.reshape(num_groups, d, hidden),
                                  v.reshape(num_groups, d, hidden))
        elif name.endswith("linear_fc1.weight"):
            out[name] = merge_fc1(got[0], got[1])
        else:
            out[name] = got[0]
    return out
