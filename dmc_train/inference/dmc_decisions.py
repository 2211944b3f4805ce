"""DMC at inference: the method hook of a DMC (or Fixed Memory Pooling) checkpoint (:class:`DMCInference`, an
:class:`~dmc_train.inference.method.InferenceMethod`) and the decisions it gives the inference model per forward and
per layer, so that :class:`~dmc_train.inference.model.LlamaForInference` holds no DMC rule itself.

    method = DMCInference(settings)                       # the hook of method=dmc and fixed_pooling (from_saved)
    hook = method.decisions(head_counts, head_dim, dtype, device)     # a DMCDecisions, once per model
    rule = hook.rule(positions)                           # once per forward: what every layer shares
    alpha, omega = hook.decide(channel_values, rule, positions)   # a layer's hard decisions [t, H_kv]
    hook.hand_to(call, rule)                              # or a layer's compiled call takes them itself

The decisions are training's evaluation functions (:mod:`kernels.dmc.decisions`), bit for bit. A model with a
decision channel ``c`` also takes from here the masks that zero it: ``keep [d]`` and ``rope_masks`` (the RoPE tables'
masks, :func:`~dmc_train.models.rope.rope_tables`).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from dmc_train.errors import InferenceError
from dmc_train.inference.caches.base import TokenInfo
from dmc_train.inference.caches.dmc import teacher_forced_dmc
from dmc_train.inference.method import InferenceMethod
from dmc_train.methods.configs import dmc_settings
from dmc_train.models.dmc_settings import DMCSettings
from kernels.dmc import decisions


class DMCInference(InferenceMethod):
    """DMC's (and fixed pooling's) hook: its :class:`DMCSettings` (``settings``), the ``dmc`` cache, keys rotated in
    the cache for ``rope_order=pre``, the per-layer :class:`DMCDecisions` and the teacher-forced attention with hard
    decisions (:func:`~dmc_train.inference.caches.dmc.teacher_forced_dmc`)."""

    cache = "dmc"

    def __init__(self, settings: DMCSettings):
        self.settings = settings
        self.rotate_in_cache = settings.rope_order == "pre"

    @classmethod
    def from_saved(cls, saved: Any, state: dict[str, torch.Tensor], shape: Any) -> "DMCInference":
        """The settings of the saved run's ``method`` config (one-line ConfigError for a checkpoint still in DMC's
        zero-out stage, :func:`~dmc_train.methods.configs.dmc_settings`)."""
        return cls(dmc_settings(saved.cfg.method, shape.head_dim, saved.meta.get("step")))

    def decisions(self, head_counts: tuple[int, int, int], head_dim: int, dtype: torch.dtype,
                  device: torch.device) -> "DMCDecisions":
        return DMCDecisions(self.settings, head_counts, head_dim, dtype, device)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, info: TokenInfo,
                  scale: float) -> torch.Tensor:
        """Algorithm 1's result over the whole sequence, with ``info``'s hard decisions ``[b, H_kv, n]``."""
        return teacher_forced_dmc(q, k, v, info, self.settings, scale)[0]

    def check_tensor_parallel(self) -> None:
        if self.settings.shared:
            raise InferenceError("a DMC model with decisions shared across a layer's heads (variant hardc) cannot "
                                 "run tensor-parallel (its decisions average over every head); use tensor_parallel=1")


class DMCDecisions:
    """The per-layer decisions of a DMC or Fixed Memory Pooling model with ``head_counts = (H, H_kv, H_kv)``.

    With a decision channel ``c``: ``keep [d]`` (0 at ``c``, the model's dtype); ``rope_masks``, the masks of
    :func:`~dmc_train.models.rope.rope_tables` for the query and key heads rotated together (``rope_order=post``):
    cos ``keep [d]``, signed sine ``[H + H_kv, d]``, 0 where it multiplies the channel (``c + d / 2 mod d``) and, in
    the query heads, also where it writes it (``c``); the decision scalars as 0-dim fp32 tensors (offset, threshold,
    eps, 0, 1: no scalar conversion per call) and the key heads' offsets ``[H_kv]`` (:meth:`rule`). Without one
    (fixed pooling): ``keep`` None, ``rope_masks`` ``(None, None)``."""

    def __init__(self, settings: DMCSettings, head_counts: tuple[int, int, int], head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        self.settings, self.head_counts = settings, head_counts
        self.channel = settings.channel
        self.keep, self.rope_masks = None, (None, None)
        if settings.channel is None:
            return
        hq, hk, _ = head_counts
        d = head_dim
        self.keep = torch.ones(d, dtype=dtype, device=device)
        self.keep[settings.channel] = 0
        rolled = self.keep.roll(d // 2)  # 0 where the signed sine multiplies the channel
        self.rope_masks = (self.keep, torch.cat([(rolled * self.keep).expand(hq, d), rolled.expand(hk, d)]))
        self.scalars = tuple(torch.tensor(x, dtype=torch.float32, device=device)
                             for x in (settings.init_offset, settings.decision_threshold, settings.omega_eps, 0.0, 1.0))
        self.channel_shift = (-self.scalars[0]).expand(hk)  # k - c0 (alpha_logit)

    def rule(self, positions: torch.Tensor) -> Any:
        """What every layer's decisions share in a forward of the tokens at ``positions [b, n]`` (``t = b n`` rows).
        Fixed pooling: the decisions themselves, ``(alpha, omega)`` ``[t, H_kv]`` (every ``pool``-th token appends,
        equal weights). DMC: ``shift [t, H_kv]`` (fp32), added to the key heads' decision channel: ``-c0``
        (:func:`~kernels.dmc.decisions.alpha_logit`: ``k + (-c0)`` is ``k - c0`` exactly), and ``-inf`` at a
        sequence's first token (``positions == 0``: its logit never exceeds the threshold, so the first token
        appends)."""
        st, (_, hk, _) = self.settings, self.head_counts
        if st.pool is not None:
            alpha = (positions.reshape(-1, 1) % st.pool != 0).float().expand(-1, hk).contiguous()
            return alpha, torch.ones_like(alpha)
        return torch.where(positions.reshape(-1, 1) == 0, -math.inf, self.channel_shift)

    def decide(self, channel_values: Optional[torch.Tensor], rule: Any,
               positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hard ``alpha`` and ``omega [t, H_kv]`` (fp32) of one layer from its q and k heads' decision channel before
        RoPE, ``channel_values [t, H + H_kv]`` (rows = tokens; :meth:`LlamaLayer.attention_input`; None for fixed
        pooling) and the forward's ``rule`` at ``positions [b, n]``. The sigmoid runs on dense tensors in the order
        training's does (``[t, H_kv]``; HardC ``[b, H_kv, n]``): a vectorised and a scalar sigmoid round
        differently, so the same values must fall in the same places."""
        st, (hq, hk, _) = self.settings, self.head_counts
        if st.pool is not None:
            return rule
        offset, threshold, eps, zero, one = self.scalars
        q_dec, k_dec = channel_values.split((hq, hk), 1)  # [t, H], [t, H_kv]
        q_dec = q_dec.float()
        logit = k_dec + rule  # alpha_logit, -inf at a first token
        if hq != hk or st.shared:  # GQA: the group's mean (one head: itself, as the mean of one value);
            q_dec = decisions.group_mean(q_dec, hk)  # HardC: also one head, contiguous
        if not st.shared:
            return torch.where(logit > threshold, one, zero), decisions.importance(q_dec, offset, eps)
        b, n = positions.shape  # HardC: the layer's heads decide together, in training's layout [b, H_kv, n]
        logit, q_dec = (x.mean(-1, keepdim=True).view(b, n, 1).transpose(1, 2).expand(-1, hk, -1)
                        for x in (logit, q_dec))
        alpha, omega = torch.where(logit > threshold, one, zero), decisions.importance(q_dec, offset, eps)
        return alpha.transpose(1, 2).reshape(-1, hk), omega.transpose(1, 2).reshape(-1, hk)  # rows [t, H_kv]

    @property
    def decides_in_call(self) -> bool:
        """Whether a layer's compiled call (``KVCache.compiled_attention``) takes its decisions itself
        (:meth:`hand_to`): fixed pooling's and DMC's, not HardC's, whose heads decide together (:meth:`decide` then
        runs between two calls)."""
        return not (self.settings.pool is None and self.settings.shared)

    def hand_to(self, call: Any, rule: Any) -> None:
        """Hand a layer's compiled attention its decisions (where :attr:`decides_in_call`): fixed pooling's of the
        forward, or DMC's rule (the threshold, offset and epsilon) to take them in the call from the decision channel
        (alpha exactly PyTorch's; omega's sigmoid in C, within a few ulp of :meth:`decide`)."""
        st = self.settings
        if st.pool is not None:
            call.with_decisions(*rule)
        else:
            call.deciding(rule, st.decision_threshold, st.init_offset, st.omega_eps)
