"""A training method at inference: what :class:`~dmc_train.inference.model.LlamaForInference` asks of the method a
checkpoint was trained with, so that the model names no method (in the spirit of megatron-core's module specs: the
model holds a hook, the method fills it).

    method = inference_hook(saved.cfg).from_saved(saved, state, shape)   # dmc_train.methods: the registry's hook
    model = LlamaForInference(shape, weights, method)

A method may provide (each has the plain model's default, this class):

- ``cache``: the engine's cache its checkpoints need unless told otherwise (``cache="auto"``; ``full`` here);
- ``rotate_in_cache``: the keys reach the cache before RoPE and the cache rotates what it keeps (DMC
  ``rope_order=pre``);
- ``decisions(...)``: the per-layer decisions hook (DMC's :class:`~dmc_train.inference.dmc_decisions.DMCDecisions`:
  ``rule`` once per forward, ``decide`` or ``hand_to`` per layer), which also holds the masks that zero its decision
  channel (``keep [d]``, ``rope_masks``); None here;
- ``attention(...)``: the teacher-forced attention without a cache (:meth:`LlamaForInference.forward`);
- its own weights (LESS's kernels, :class:`~dmc_train.inference.caches.less.LESSWeights`), moved by ``to(device)``;
- ``check_tensor_parallel()``: a one-line error when its model cannot be split across tensor-parallel ranks.

DMC's and fixed pooling's hook is :class:`~dmc_train.inference.dmc_decisions.DMCInference`, LESS's
:class:`~dmc_train.inference.caches.less.LESSWeights`; a method registers its hook with
:func:`dmc_train.methods.register_method` (``inference="module:Class"``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from dmc_train.inference.caches.base import TokenInfo
from dmc_train.inference.caches.full import causal_attention


class InferenceMethod:
    """The plain model's method (``none``, GQA up-training): full cache, no decisions, causal attention."""

    cache: str = "full"
    rotate_in_cache: bool = False

    @classmethod
    def from_saved(cls, saved: Any, state: dict[str, torch.Tensor], shape: Any) -> "InferenceMethod":
        """The hook of a saved run (:class:`~dmc_train.training.model_state.SavedRun`: config, meta) whose full
        (TP=1) megatron ``state`` and :class:`~dmc_train.inference.model.ModelShape` are given; a method with its
        own modules takes their tensors out of ``state``, leaving the Llama weights."""
        return cls()

    def to(self, device: torch.device) -> "InferenceMethod":
        """This method with its own tensors on ``device``."""
        return self

    def decisions(self, head_counts: tuple[int, int, int], head_dim: int, dtype: torch.dtype,
                  device: torch.device) -> Optional[Any]:
        """The per-layer decisions hook of a model (or a tensor-parallel rank's shard) with ``head_counts = (H,
        H_kv, H_kv)`` heads of ``head_dim`` channels in ``dtype`` on ``device``; None: no decisions."""
        return None

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, info: TokenInfo,
                  scale: float) -> torch.Tensor:
        """Teacher-forced attention without a cache: ``q [b, H, n, d]``, ``k, v [b, H_kv, n, d]`` and ``info``
        (positions ``[b, n]``, the decisions ``[b, H_kv, n]``) -> ``[b, H, n, d_v]``; causal softmax here."""
        return causal_attention(q, k, v, scale)

    def check_tensor_parallel(self) -> None:
        """A one-line :class:`~dmc_train.errors.InferenceError` when this method's model cannot be split across
        tensor-parallel ranks (called only for more than one)."""
