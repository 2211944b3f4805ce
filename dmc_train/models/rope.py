"""RoPE: its inverse frequencies, unscaled or scaled (``model.rope_scaling``), its angles and its rotation.

    inv_freq = rope_inv_freq(head_dim, rotary_base, rope_scaling)   # [head_dim / 2], fp32
    inv_freq = model_inv_freq(cfg.model)                            # the same, from the model node
    cos, sin = rope_angles(positions, inv_freq)                     # [..., head_dim], fp32
    x = rotate_half_rope(x, cos, sin)                               # x [..., head_dim], cos / sin broadcast
    x = rope(x, positions, inv_freq)                                # the two above, angles cast to x's dtype
    rotate = rope_rotation(positions, inv_freq)                     # x -> rotate_half_rope(x, cos, sin), fewer calls
    rotate = rope_rotation(positions, inv_freq, dtype, cos_mask, sin_mask)   # the same, channels zeroed

Every RoPE of the project takes its angles ``position * inv_freq`` (rotate-half convention, the
frequencies repeated for both halves) from here: the training model (megatron-core's
``RotaryEmbedding`` reads them from its ``inv_freq``, which :func:`dmc_train.models.llama.build_model`
sets; DMC's ``rope_order=pre`` rotates with that same embedding), the inference engine
(:class:`~dmc_train.inference.model.LlamaForInference`; its ``rope`` is the DMC cache's rotation of
accumulated keys and LightCache's rotation at window positions) and the importer's layer-by-layer
verification (:mod:`dmc_train.models.llama_reference`). The rotation itself is
:func:`kernels.dmc.rotate_half_rope` (``kernels/`` sit below ``models/``, and DMC's ``rope_order=pre``
reference needs it), re-exported here so that the code above takes all of RoPE from this module. Exported
models run
transformers' own RoPE from the ``rope_parameters`` the exporter writes
(:func:`dmc_train.models.hf_config.rope_parameters`); the tests check that transformers computes
these very frequencies, bit for bit, for every type.

- ``none``: ``inv_freq_j = base^(-2j/d)``.
- ``linear``: ``inv_freq / factor`` (position interpolation; megatron-core's ``seq_len_interpolation_factor``
  divides the positions instead, the same angles up to rounding).
- ``llama3`` (Llama 3.1 / 3.2 / 3.3): with ``L = original_max_position_embeddings`` and wavelength
  ``2 pi / inv_freq``: kept below ``L / high_freq_factor``, divided by ``factor`` above ``L /
  low_freq_factor``, and in between ``(1 - s) inv_freq / factor + s inv_freq`` with ``s = (L / wavelength -
  low_freq_factor) / (high_freq_factor - low_freq_factor)``. The same operations, in the same order, as
  transformers' ``_compute_llama3_parameters`` and megatron-core's ``RotaryEmbedding._apply_scaling``
  (megatron-core's GPT model exposes only ``factor``, with 1 / 4 / 8192 fixed for the others; this
  function takes all four, and for those values equals megatron's ``rope_scaling=True`` bit for bit).

Torch only (no megatron import): the inference engine uses it without loading megatron.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Optional

import torch

from dmc_train.config import RopeScalingConfig, rope_scaling_of
from kernels.dmc import rotate_half_rope
from kernels.layer import rotate

__all__ = ["rope_inv_freq", "model_inv_freq", "rope_angles", "rotate_half_rope", "rope", "rope_tables",
           "rope_rotation"]


def rope_inv_freq(head_dim: int, base: float, scaling: RopeScalingConfig | None = None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim / 2]`` (fp32, CPU) of RoPE with base ``base`` and ``scaling``
    (a :class:`~dmc_train.config.RopeScalingConfig`; None or type ``none``: unscaled)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = "none" if scaling is None else scaling.type
    if kind == "none":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling.factor
    if kind != "llama3":
        raise ValueError(f"RoPE scaling type {kind!r} is not one of none, linear, llama3")
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    old_context_len = scaling.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low) / (high - low)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def model_inv_freq(model: Any) -> torch.Tensor:
    """:func:`rope_inv_freq` of a ``model`` config node (head_dim = hidden / heads, ``rotary_base``,
    ``rope_scaling``)."""
    return rope_inv_freq(model.hidden_size // model.num_attention_heads, float(model.rotary_base),
                         rope_scaling_of(model))


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [..., d]`` of ``positions [...]`` for the rotate-half convention: the angles
    ``position * inv_freq`` repeated for both halves, computed in fp32 (as megatron-core), returned in ``dtype``."""
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x [..., d]`` at ``positions`` (shape ``x.shape[:-1]`` or broadcastable to it) with
    the frequencies ``inv_freq [d / 2]``: angles in fp32, the rotation in ``x``'s dtype."""
    cos, sin = rope_angles(positions, inv_freq, x.dtype)
    return rotate_half_rope(x, cos, sin)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype = torch.float32,
                cos_mask: Optional[torch.Tensor] = None,
                sin_mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, signed sin)`` ``[..., d]`` at ``positions`` for ``x * cos + x.roll(d / 2, -1) * sin``, which is
    ``rotate_half_rope(x, cos, sin)`` bit for bit: ``rotate_half(x) * sin = [-x2, x1] * [s, s] = [x2, x1] * [-s, s]``,
    and ``[x2, x1]`` is ``x`` rolled by ``d / 2`` (:func:`rope_angles`' tables, the first half of the sine negated).

    ``cos_mask``, ``sin_mask`` (optional, 0 / 1 in ``dtype``, broadcast against the tables ``[..., d]``, e.g.
    ``[heads, d]`` for ``x [t, heads, d]`` at ``positions [t, 1]``): multiply the cosines and the signed sines. A 0
    in the cosine at channel ``c`` and in the sine at ``c + d / 2 mod d`` drops what reads ``x``'s channel ``c``
    (RoPE of ``x`` with that channel zeroed, DMC's decision channel); a 0 in the sine at ``c`` as well drops what
    writes it (the result's channel ``c`` zeroed)."""
    cos, sin = rope_angles(positions, inv_freq, dtype)
    half = cos.shape[-1] // 2
    sin = torch.cat([-sin[..., :half], sin[..., half:]], -1)
    if cos_mask is not None:
        cos = cos * cos_mask
    if sin_mask is not None:
        sin = sin * sin_mask
    return cos, sin


def rope_rotation(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype = torch.float32,
                  cos_mask: Optional[torch.Tensor] = None,
                  sin_mask: Optional[torch.Tensor] = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x [..., d] -> rotate_half_rope(x, cos, sin)`` at ``positions`` by :func:`rope_tables` (with their masks),
    bit for bit, in four tensor calls instead of six (the tables computed once, here)."""
    cos, sin = rope_tables(positions, inv_freq, dtype, cos_mask, sin_mask)
    return functools.partial(rotate, cos=cos, sin=sin)
