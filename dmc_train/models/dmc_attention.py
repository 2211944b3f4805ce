"""DMC attention for the layer spec: decisions from the freed channel, partial accumulation, Fig. 3 attention.

``DMCSelfAttention`` (the spec's ``self_attention``) takes the decision channel ``c`` out of the
projected query and key heads *before* RoPE:

- ``alpha`` (accumulate) from key head channel c: logit ``k[c] - c0``; training: Gumbel-sigmoid
  ``sigmoid((logit + g1 - g2) / tau)`` (noise in fp32); evaluation: ``logit > 0`` with a
  straight-through estimator when gradients are needed. The first token always appends (alpha = 0).
- ``omega`` (importance) ``sigmoid(mean_{query heads of the group} q[c] + c0) + eps``.
- variants (App. E): ``c`` (DMC-C) adds ``sum |alpha - mean_{heads of the layer} alpha|`` (Eq. 13,
  normalised per decision like Eq. 10) to the loss; ``hardc`` (DMC-HardC) shares one alpha logit and
  one omega (means over the layer's heads) and one noise draw across all heads of a layer.

then zeroes channel c in q and k, so RoPE rotates the other channels with it zeroed (as the released
code does), and hands ``(alpha, omega)`` to ``DMCCoreAttention`` (the spec's ``core_attention``),
which accumulates keys and values after RoPE (Eq. 9) and attends with the Fig. 3 bias in O(n) memory,
ignoring channel c.

Phases (set by the DMC method's schedule on a shared :class:`DMCState`):
``zero_out`` - vanilla attention with channel c of q and k scaled by ``zero_out_factor`` (Eq. 12);
``dmc`` - learned decisions as above; ``fixed`` - Fixed Memory Pooling (the paper's ablation): every
``pool`` tokens are averaged into one slot (alpha = 1 except every pool-th token, omega = 1), all
channels used.

Layouts follow megatron: ``query [s, b, heads/TP, d]``, ``key/value [s, b, groups/TP, d]``; alpha and
omega ``[b, groups/TP, s]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    reduce_from_tensor_model_parallel_region)
from megatron.core.transformer.attention import SelfAttention

from dmc_train.methods.cr_loss import AttachLoss, CRLossTracker
from dmc_train.methods.dmc_ops import dmc_attention, partial_accumulation
from dmc_train.models.attention import SDPACoreAttention

OMEGA_EPS = 1e-6


@dataclass
class DMCState:
    """What every DMC layer of a rank shares with the method: settings, current phase, CR tracker."""

    channel: int  # decision channel index within a head
    init_offset: float = 5.0
    tau: float = 0.1
    accumulation: str = "exact"
    window: int = 12
    attention_impl: str = "auto"
    variant: str = "dmc"  # dmc | c (DMC-C, Eq. 13) | hardc (decisions shared per layer)
    phase: str = "dmc"  # zero_out | dmc | fixed
    zero_out_factor: float = 1.0
    pool: int = 2  # fixed pooling: tokens per slot
    noise_seed: int = 0  # Gumbel noise = f(noise_seed, step, data-parallel rank, micro-batch, layer)
    step: int = 0
    dp_rank: int = 0
    tracker: Optional[CRLossTracker] = None


class DMCSelfAttention(SelfAttention):
    """megatron ``SelfAttention`` whose q/k decision channel drives DMC (module docstring)."""

    def __init__(self, *args, dmc_state: DMCState, **kwargs):
        super().__init__(*args, **kwargs)
        self.dmc = dmc_state
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.head_offset = tp_rank * self.num_query_groups_per_partition  # global index of local KV head 0
        self.core_attention.dmc = dmc_state

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True):
        query, key, value = super().get_query_key_value_tensors(hidden_states, key_value_states)
        st, c = self.dmc, self.dmc.channel
        self.core_attention.pending = None
        if st.phase == "fixed":
            alpha, omega = fixed_pooling_decisions(key, st.pool)
            if st.tracker is not None:  # counts the decisions (achieved CR); no gradient
                alpha = st.tracker.record(alpha, self.layer_number - 1, self.head_offset)
            self.core_attention.pending = (alpha, omega)
            return query, key, value
        keep = torch.ones(query.shape[-1], dtype=query.dtype, device=query.device)
        if st.phase == "zero_out":
            keep[c] = st.zero_out_factor
            return query * keep, key * keep, value
        keep[c] = 0
        alpha_logit = key[..., c].float() - st.init_offset  # [s, b, g]
        s, b, g = alpha_logit.shape
        q_dec = query[..., c].float().unflatten(-1, (g, -1)).mean(-1)  # [s, b, g]: mean over the group
        if st.variant == "hardc":  # one decision and one importance per layer, shared by all heads
            alpha_logit, q_dec = _mean_over_heads(alpha_logit), _mean_over_heads(q_dec)
        omega = torch.sigmoid(q_dec + st.init_offset) + OMEGA_EPS
        alpha = self._alpha(alpha_logit, shared_noise=st.variant == "hardc")
        first = torch.ones(s, 1, 1, dtype=alpha.dtype, device=alpha.device)
        first[0] = 0
        alpha = (alpha * first).permute(1, 2, 0)  # [b, g, s]; the first token always appends
        query, key = query * keep, key * keep
        constraint = None
        if st.variant == "c":  # DMC-C (Eq. 13): |alpha - mean over the layer's heads|, per head
            constraint = (alpha - _mean_over_heads(alpha, dim=1)).abs().sum(dim=(0, 2))
            n_layers, n_heads = self.config.num_layers, self.config.num_query_groups
            # Normalised per decision like Eq. 10; the loop weights loss terms by the b * n tokens.
            query = AttachLoss.apply(query, constraint.sum(), 1.0 / (n_layers * n_heads))
        if st.tracker is not None:
            alpha = st.tracker.record(alpha, self.layer_number - 1, self.head_offset, constraint=constraint)
        self.core_attention.pending = (alpha, omega.permute(1, 2, 0))
        return query, key, value

    def _alpha(self, logit: torch.Tensor, shared_noise: bool = False) -> torch.Tensor:
        """Accumulate probabilities ``[s, b, g]`` from logits (module docstring), in fp32."""
        if self.training:  # noise for all KV heads of the layer, so every TP layout sees the same values
            shape = (2, *logit.shape[:2], self.config.num_query_groups)
            u = torch.rand(shape, generator=self._noise_generator(), dtype=torch.float32).clamp_(1e-10, 1 - 1e-7)
            gumbel = -torch.log(-torch.log(u))  # [2, s, b, groups]: g1, g2
            noise = gumbel[0] - gumbel[1]
            lo = self.head_offset
            noise = noise[..., :1].expand_as(logit) if shared_noise else noise[..., lo: lo + logit.shape[-1]]
            return torch.sigmoid((logit + noise.to(logit.device)) / self.dmc.tau)
        hard = (logit > 0).to(logit.dtype)
        if not torch.is_grad_enabled() or not logit.requires_grad:
            return hard
        soft = torch.sigmoid(logit)
        return hard + soft - soft.detach()  # straight-through

    def _noise_generator(self) -> torch.Generator:
        """Seeded by (seed, step, data-parallel rank, micro-batch, layer): layout-independent, resumable."""
        st = self.dmc
        seed = st.noise_seed
        for part in (st.step, st.dp_rank, st.tracker.active if st.tracker is not None else 0, self.layer_number):
            seed = (seed * 1_000_003 + part) % (2 ** 63)
        return torch.Generator().manual_seed(seed)


def _mean_over_heads(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Mean over all KV heads of the layer along ``dim`` (this rank holds a slice of them under TP),
    broadcast back to the local heads; gradients reach every rank's heads."""
    local = x.sum(dim=dim, keepdim=True)
    total = copy_to_tensor_model_parallel_region(reduce_from_tensor_model_parallel_region(local))
    return (total / (x.shape[dim] * parallel_state.get_tensor_model_parallel_world_size())).expand_as(x)


def fixed_pooling_decisions(key: torch.Tensor, pool: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed Memory Pooling: ``key [s, b, g, d]`` -> alpha, omega ``[b, g, s]`` averaging every ``pool`` tokens."""
    s, b, g, _ = key.shape
    pos = torch.arange(s, device=key.device)
    alpha = (pos % pool != 0).to(torch.float32).expand(b, g, s).contiguous()
    return alpha, torch.ones_like(alpha)


class DMCCoreAttention(SDPACoreAttention):
    """Core attention over partially accumulated keys/values with the Fig. 3 bias (vanilla when no
    decisions are pending, i.e. in the zero-out phase)."""

    dmc: DMCState
    pending: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, **kwargs):
        if self.pending is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, **kwargs)
        alpha, omega = self.pending
        self.pending = None
        sq, b, nh, hd = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        k_t, v_t = partial_accumulation(k, v, alpha, omega, mode=self.dmc.accumulation, window=self.dmc.window)
        free = None if self.dmc.phase == "fixed" else self.dmc.channel
        out = dmc_attention(q, k_t, v_t, alpha, scale=self.softmax_scale, free_channel=free,
                            impl=self.dmc.attention_impl)
        return out.permute(2, 0, 1, 3).reshape(sq, b, nh * hd)
