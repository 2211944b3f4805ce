"""DMC attention for the layer spec: decisions from the freed channel, partial accumulation, Fig. 3 attention.

``DMCSelfAttention`` (the spec's ``self_attention``) takes the decision channel ``c`` out of the
projected query and key heads *before* RoPE (the math is :mod:`kernels.dmc.decisions`):

- ``alpha`` (accumulate) from key head channel c: logit ``k[c] - c0``; training: Gumbel-sigmoid
  ``sigmoid((logit + g1 - g2) / tau)`` (noise in fp32); evaluation: ``logit > 0`` with a
  straight-through estimator when gradients are needed. The first token always appends (alpha = 0).
- ``omega`` (importance) ``sigmoid(mean_{query heads of the group} q[c] + c0) + eps``.
- variants: ``c`` (DMC-C) adds ``sum |alpha - mean_{heads of the layer} alpha|`` (Eq. 13,
  normalised per decision like Eq. 10) to the loss; ``hardc`` (DMC-HardC) shares one alpha logit and
  one omega (means over the layer's heads) and one noise draw across all heads of a layer.

then zeroes channel c in q and k, so RoPE rotates the other channels with it zeroed (as the released
code does), and hands ``(alpha, omega, accumulated)`` to its ``DMCCoreAttention`` (the spec's
``core_attention``) through a :class:`DecisionHandoff` given to both at construction. The core
attention attends with the Fig. 3 bias in O(n) memory, ignoring channel c. Where keys and values are
accumulated (Eq. 9) depends on ``DMCSettings.rope_order``:

- ``post`` (default): the core attention accumulates the keys megatron has already rotated by RoPE.
- ``pre`` (the released code): ``get_query_key_value_tensors`` accumulates the raw keys and values
  and returns ``k~`` and ``v~``; megatron then rotates ``k~_t`` at position t (the newest token of
  its segment), and the core attention skips its own accumulation (``accumulated=True``).

Phases (set by the DMC method's schedule on the shared :class:`DMCState`):
``zero_out`` - vanilla attention with channel c of q and k scaled by ``zero_out_factor`` (Eq. 12);
``dmc`` - learned decisions as above; ``fixed`` - Fixed Memory Pooling (the paper's ablation): every
``settings.pool`` tokens are averaged into one slot (alpha = 1 except every pool-th token, omega = 1),
all channels used.

Layouts follow megatron: ``query [s, b, heads/TP, d]``, ``key/value [s, b, groups/TP, d]``; alpha and
omega ``[b, groups/TP, s]``.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.transformer.attention import SelfAttention

from dmc_train.models.attention import SDPACoreAttention
from dmc_train.models.dmc.cr_loss import CRLossTracker
from dmc_train.models.dmc_settings import DMCSettings
from dmc_train.models.layer_loss import AttachLoss
from kernels.dmc import decisions, dmc_attention, partial_accumulation


@dataclass
class DMCState:
    """What every DMC layer of a rank shares with the method: the frozen ``settings`` beside the run
    state (phase, zero-out factor and target CR set by the schedule, the noise coordinates, the CR tracker)."""

    settings: DMCSettings
    phase: str = "dmc"  # zero_out | dmc | fixed
    zero_out_factor: float = 1.0
    target_cr: float = 1.0  # the CR loss's target in the dmc phase (fixed pooling: its pool size)
    noise_seed: int = 0  # Gumbel noise = f(noise_seed, step, data-parallel rank, micro-batch, layer)
    step: int = 0
    dp_rank: int = 0
    tracker: Optional[CRLossTracker] = None


Decisions = tuple[torch.Tensor, torch.Tensor, bool]  # (alpha [b, g, s], omega [b, g, s], accumulated)


class DecisionHandoff:
    """One layer's ``(alpha, omega, accumulated)`` from ``DMCSelfAttention`` to its ``DMCCoreAttention``,
    for one forward (megatron calls the core attention with q, k, v only). ``accumulated``: the keys
    and values it receives are already k~ / v~ (``rope_order=pre``). Empty in the zero-out phase."""

    def __init__(self):
        self._value: Optional[Decisions] = None

    def put(self, value: Optional[Decisions]) -> None:
        self._value = value

    def take(self) -> Optional[Decisions]:
        value, self._value = self._value, None
        return value


class DMCSelfAttention(SelfAttention):
    """megatron ``SelfAttention`` whose q/k decision channel drives DMC (module docstring)."""

    def __init__(self, config, submodules, *args, dmc_state: DMCState, **kwargs):
        if config.attention_output_gate:
            raise ValueError("DMC attention does not support megatron's attention_output_gate")
        handoff = DecisionHandoff()
        core = functools.partial(DMCCoreAttention, dmc_state=dmc_state, handoff=handoff)
        super().__init__(config, dataclasses.replace(submodules, core_attention=core), *args, **kwargs)
        self.dmc, self.handoff = dmc_state, handoff
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.head_offset = tp_rank * self.num_query_groups_per_partition  # global index of local KV head 0

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True):
        assert split_qkv and not output_gate, "DMC attention needs split q, k, v and no output gate"
        query, key, value = super().get_query_key_value_tensors(hidden_states, key_value_states)
        st, settings = self.dmc, self.dmc.settings
        c = settings.channel
        if st.phase == "fixed":
            s, b, g, _ = key.shape
            alpha = decisions.fixed_pooling_alpha(s, settings.pool, key.device).expand(b, g, s).contiguous()
            if st.tracker is not None:  # counts the decisions (achieved CR); no gradient
                alpha = st.tracker.record(alpha, self.layer_number - 1, self.head_offset, st.target_cr)
            return (query, *self._hand_off(key, value, alpha, torch.ones_like(alpha)))
        keep = torch.ones(query.shape[-1], dtype=query.dtype, device=query.device)
        if st.phase == "zero_out":
            keep[c] = st.zero_out_factor
            self.handoff.put(None)
            return query * keep, key * keep, value
        keep[c] = 0
        alpha_logit = decisions.alpha_logit(key[..., c], settings.init_offset)  # [s, b, g]
        q_dec = decisions.group_mean(query[..., c], alpha_logit.shape[-1])  # [s, b, g]
        if settings.shared:  # one decision and one importance per layer, shared by all heads
            alpha_logit, q_dec = _mean_over_heads(alpha_logit), _mean_over_heads(q_dec)
        omega = decisions.importance(q_dec, settings.init_offset, settings.omega_eps)
        alpha = self._alpha(alpha_logit, shared_noise=settings.shared)
        alpha = decisions.first_token_appends(alpha, seq_dim=0).permute(1, 2, 0)  # [b, g, s]
        query, key = query * keep, key * keep
        constraint = None
        if settings.variant == "c":  # DMC-C (Eq. 13): |alpha - mean over the layer's heads|, per head
            constraint = (alpha - _mean_over_heads(alpha, dim=1)).abs().sum(dim=(0, 2))
            n_layers, n_heads = self.config.num_layers, self.config.num_query_groups
            # Normalised per decision like Eq. 10; the loop weights loss terms by the b * n tokens.
            query = AttachLoss.apply(query, constraint.sum(), 1.0 / (n_layers * n_heads))
        if st.tracker is not None:
            alpha = st.tracker.record(alpha, self.layer_number - 1, self.head_offset, st.target_cr,
                                      constraint=constraint, logit=alpha_logit)
        return (query, *self._hand_off(key, value, alpha, omega.permute(1, 2, 0)))

    def _hand_off(self, key, value, alpha, omega) -> tuple[torch.Tensor, torch.Tensor]:
        """Give the decisions to the core attention; return the key and value megatron continues with
        (RoPE, then the core attention): unchanged for ``rope_order=post``; for ``pre`` the raw keys and
        values accumulated by Eq. 9 (``[s, b, g, d]``), so that RoPE rotates k~_t at position t."""
        settings = self.dmc.settings
        pre = settings.rope_order == "pre"
        # value is a view into the fused QKV projection's output [s, b, g, (G + 2) d]. The accumulation
        # saves v for backward, which would pin all of that buffer, (G + 2) times v's own size; a
        # compact copy lets it go after the forward (vanilla SDPA does pin it).
        value = value.contiguous()
        if pre:
            k, v = (t.permute(1, 2, 0, 3) for t in (key, value))  # [b, g, s, d]
            k_t, v_t = partial_accumulation(k, v, alpha, omega, mode=settings.accumulation,
                                            window=settings.window)
            # v~ stays a view: the core attention permutes it back and saves the very tensor the
            # accumulation saved (RoPE makes a new k~ anyway)
            key, value = k_t.permute(2, 0, 1, 3).contiguous(), v_t.permute(2, 0, 1, 3)
        self.handoff.put((alpha, omega, pre))
        return key, value

    def _alpha(self, logit: torch.Tensor, shared_noise: bool = False) -> torch.Tensor:
        """Accumulate probabilities ``[s, b, g]`` from logits (module docstring), in fp32."""
        if not self.training:
            return decisions.hard_alpha(logit, self.dmc.settings.decision_threshold)
        # Noise for all KV heads of the layer, so every TP layout sees the same values.
        noise = decisions.gumbel_difference((*logit.shape[:2], self.config.num_query_groups),
                                            self._noise_generator(logit.device))
        lo = self.head_offset
        noise = noise[..., :1].expand_as(logit) if shared_noise else noise[..., lo: lo + logit.shape[-1]]
        return decisions.relaxed_alpha(logit, noise, self.dmc.settings.tau)

    def _noise_generator(self, device: torch.device) -> torch.Generator:
        """A generator on ``device`` seeded by (seed, step, data-parallel rank, micro-batch, layer): the noise is
        layout-independent and resumable (the same on every layout of one kind of device)."""
        st = self.dmc
        seed = st.noise_seed
        for part in (st.step, st.dp_rank, st.tracker.active if st.tracker is not None else 0, self.layer_number):
            seed = (seed * 1_000_003 + part) % (2 ** 63)
        return torch.Generator(device=device).manual_seed(seed)


def _mean_over_heads(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Mean over all KV heads of the layer along ``dim`` (this rank holds a slice of them under TP),
    broadcast back to the local heads; gradients reach every rank's heads."""
    local = x.sum(dim=dim, keepdim=True)
    total = copy_to_tensor_model_parallel_region(reduce_from_tensor_model_parallel_region(local))
    return (total / (x.shape[dim] * parallel_state.get_tensor_model_parallel_world_size())).expand_as(x)


class DMCCoreAttention(SDPACoreAttention):
    """Core attention over partially accumulated keys/values with the Fig. 3 bias (vanilla when the
    handoff holds no decisions, i.e. in the zero-out phase). Accumulates the RoPE-rotated keys itself
    (``rope_order=post``) unless the handoff says they arrive accumulated (``pre``)."""

    def __init__(self, *args, dmc_state: DMCState, handoff: DecisionHandoff, **kwargs):
        super().__init__(*args, **kwargs)
        self.dmc, self.handoff = dmc_state, handoff

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, **kwargs):
        pending = self.handoff.take()
        if pending is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, **kwargs)
        alpha, omega, accumulated = pending
        settings = self.dmc.settings
        sq, b, nh, hd = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        if accumulated:  # rope_order=pre: k~ (rotated by megatron at each token's position) and v~
            k_t, v_t = k, v
        else:
            k_t, v_t = partial_accumulation(k, v, alpha, omega, mode=settings.accumulation, window=settings.window)
        free = None if self.dmc.phase == "fixed" else settings.channel
        out = dmc_attention(q, k_t, v_t, alpha, scale=self.softmax_scale, free_channel=free,
                            impl=settings.attention_impl)
        return out.permute(2, 0, 1, 3).reshape(sq, b, nh * hd)
