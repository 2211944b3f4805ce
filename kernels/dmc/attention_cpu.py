"""DMC training attention on CPU through PyTorch's fused flash-attention kernels.

``aten._scaled_dot_product_flash_attention_for_cpu`` (forward, returns the row log-sum-exp) and its
``_backward`` are blocked O(n)-memory kernels for causal attention. The Fig. 3 bias is split into

- the *past* part (j < i, bias ``log(1 - alpha_{j+1})``): shift keys and values one position to the
  right, so that causal attention of query i over the shifted sequence covers exactly j < i; slot 0
  becomes a dummy key no query may see. The per-key bias rides in one channel, ``q' = [q * scale, 1]``,
  ``k'_{j+1} = [k~_j, log(1 - alpha_{j+1})]``, so the kernel's scores are ``s_ij + bias_j``. That
  channel is DMC's decision channel when the caller names it (``free_channel``: the head size stays
  d) or an appended one (head size d + 1, ~30 % slower in these kernels);
- the *diagonal* (j = i, bias 0): one score per query, ``s_ii = q_i . k~_i``, merged with the past
  part through the log-sum-exps: ``lse = logaddexp(lse_past, s_ii)``,
  ``out = exp(lse_past - lse) out_past + exp(s_ii - lse) v~_i``.

Backward calls the fused backward with the *merged* ``out`` and ``lse``: it recomputes
``P_ij = exp(s_ij + bias_j - lse_i)`` and ``D_i = <dO_i, out_i>``, which are exactly the merged
softmax's, so its dq / dk / dv are the past part's gradients; the diagonal's are O(n d) element-wise.
``dL/d bias_j`` comes out as the gradient of the bias channel of k'. (This uses only the standard
flash backward contract, P from lse and D from out; tests/kernels/dmc/test_attention.py checks it
against the dense reference, so a change inside torch would show there.)

Hard alpha = 1 (bias -inf): the forward uses -1e30 (weight exactly 0). The backward clamps the bias
at -60, so the kernel's column sum is ``e^-60 sum_i U_ij (dP_ij - D_i)`` (``U = exp(s - lse)``), which
rescales to the exact one-sided derivative ``dL/dg_j``; those keys' spurious dk / dv rows are scaled
to 0, and their e^-60-weighted contribution to dq is below float32 resolution unless such a key
outscores all visible keys of the row by > 40 nats. Should that exponent overflow (> 148 nats), the
backward is redone with those keys at weight exactly 0 (and alpha-gradient 0 for them).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ._checks import empty_in_layout_of, work_dtype
from .attention_blocked import NEG_BIG

_BIAS_FLOOR_BACKWARD = -60.0


@functools.cache
def fused_cpu_available() -> bool:
    try:
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # noqa: B018
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


def _kernel_inputs(q, k, v, alpha, scale, free_channel, bias_floor, wd):
    """``q' [b, hq, n, W]``, shifted ``k' / v' [b, hq, n, W]`` (repeated over the GQA group) and the
    bias channel index. ``W = d`` (free channel) or ``d + 1``, at least ``d_v``."""
    b, hq, n, d = q.shape
    hk, dv = k.shape[1], v.shape[-1]
    G = hq // hk
    c = d if free_channel is None else free_channel
    width = max(d if free_channel is not None else d + 1, dv)

    bias = torch.log1p(-alpha.to(wd)).clamp_min_(bias_floor)  # slot j+1 holds key j: log(1 - alpha_{j+1})
    bias[..., 0] = NEG_BIG  # slot 0: dummy, never visible
    k_ext = torch.empty(b, hk, n, width, dtype=wd, device=q.device)
    k_ext[:, :, 0] = 0
    k_ext[:, :, 1:, :d] = k[:, :, :-1]
    k_ext[..., d:] = 0
    k_ext[..., c] = bias
    v_ext = torch.empty(b, hk, n, width, dtype=wd, device=q.device)
    v_ext[:, :, 0] = 0
    v_ext[:, :, 1:, :dv] = v[:, :, :-1]
    v_ext[..., dv:] = 0
    if G > 1:
        k_ext = k_ext.repeat_interleave(G, dim=1)
        v_ext = v_ext.repeat_interleave(G, dim=1)
    q_ext = torch.empty(b, hq, n, width, dtype=wd, device=q.device)
    torch.mul(q, scale, out=q_ext[..., :d])
    q_ext[..., d:] = 0
    q_ext[..., c] = 1.0
    return q_ext, k_ext, v_ext, c


def _scaled_queries(q, scale, free_channel, wd):
    """``q * scale`` with the free channel zeroed, ``[b, hq, n, d]``."""
    qs = q.to(wd) * scale
    if free_channel is not None:
        qs[..., free_channel] = 0
    return qs


def _diagonal_scores(q, k, scale, free_channel, wd):
    """``s_ii = scale * q_i . k~_i`` per query head, ``[b, hq, n]``."""
    b, hq, n, d = q.shape
    hk = k.shape[1]
    qs = _scaled_queries(q, scale, free_channel, wd)
    return (qs.view(b, hk, hq // hk, n, d) * k.to(wd).unsqueeze(2)).sum(-1).view(b, hq, n)


def _group_sum(x: torch.Tensor, hk: int) -> torch.Tensor:
    """``[b, hq, ...] -> [b, hk, ...]``: sum over the query heads of each KV group."""
    b, hq = x.shape[:2]
    return x.view(b, hk, hq // hk, *x.shape[2:]).sum(2) if hq != hk else x


def _past_backward(q, k, v, alpha, scale, free_channel, bias_floor, do, out, lse):
    """Fused backward of the past part; returns ``dq', dk', dv'`` (per query head, width W) and the
    bias channel index."""
    q_ext, k_ext, v_ext, c = _kernel_inputs(q, k, v, alpha, scale, free_channel, bias_floor, out.dtype)
    pad = q_ext.shape[-1] - do.shape[-1]
    if pad:
        do, out = F.pad(do, (0, pad)), F.pad(out, (0, pad))
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do, q_ext, k_ext, v_ext, out, lse, 0.0, True, scale=1.0
    )
    return (*grads, c)


class FusedCPUDMCAttention(torch.autograd.Function):
    """``apply(q [b, hq, n, d], k [b, hk, n, d], v [b, hk, n, dv], alpha [b, hk, n], scale,
    free_channel) -> out [b, hq, n, dv]`` (inputs validated by ``dmc_attention``; out's dims lie in
    memory like q's, see ``empty_in_layout_of``)."""

    @staticmethod
    def forward(ctx, q, k, v, alpha, scale, free_channel):
        b, hq, n, d = q.shape
        hk, dv = k.shape[1], v.shape[-1]
        G = hq // hk
        wd = work_dtype(q)
        q_ext, k_ext, v_ext, _ = _kernel_inputs(q, k, v, alpha, scale, free_channel, NEG_BIG, wd)
        out_past, lse_past = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q_ext, k_ext, v_ext, 0.0, True, scale=1.0
        )
        s_diag = _diagonal_scores(q, k, scale, free_channel, wd)
        lse = torch.logaddexp(lse_past, s_diag)
        w_past = (lse_past - lse).exp_().unsqueeze(-1)
        w_diag = (s_diag - lse).exp_()
        out = torch.mul(out_past[..., :dv], w_past, out=empty_in_layout_of(q, dv, wd))
        out.view(b, hk, G, n, dv).addcmul_(w_diag.view(b, hk, G, n, 1), v.to(wd).unsqueeze(2))

        ctx.save_for_backward(q, k, v, alpha, out, lse, s_diag)
        ctx.scale, ctx.free_channel = scale, free_channel
        return out.to(q.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, alpha, out, lse, s_diag = ctx.saved_tensors
        scale, free_channel = ctx.scale, ctx.free_channel
        b, hq, n, d = q.shape
        hk, dv = k.shape[1], v.shape[-1]
        G = hq // hk
        wd = out.dtype

        # Past part: the fused backward with the merged out / lse.
        do = grad_out.to(wd).contiguous()
        floor = _BIAS_FLOOR_BACKWARD
        dq_ext, dk_ext, dv_ext, c = _past_backward(q, k, v, alpha, scale, free_channel, floor, do, out, lse)
        if not (torch.isfinite(dq_ext.sum()) and torch.isfinite(dv_ext.sum())):  # overflow shows in both
            # exp(s - lse - 60) overflowed: an invisible key outscores its row by > 148 nats. Redo
            # with invisible keys at weight 0 (their alpha-gradient is then 0 in this call).
            floor = NEG_BIG
            dq_ext, dk_ext, dv_ext, c = _past_backward(q, k, v, alpha, scale, free_channel, floor, do, out, lse)
        dk_ext, dv_ext = _group_sum(dk_ext, hk), _group_sum(dv_ext, hk)
        # Slot j' = j + 1 holds key j. The kernel saw exp(clamped bias) instead of the gate g: rescale
        # per key (1 for ordinary keys, 0 for alpha = 1) and turn d bias into dL/dg = e^-bias d bias.
        a = alpha.to(wd)[..., 1:]
        raw_bias = torch.log1p(-a)
        ordinary = raw_bias >= floor  # the kernel saw the true bias
        rescale = math.exp(-floor) if floor == _BIAS_FLOOR_BACKWARD else 0.0  # NEG_BIG: weight was 0
        key_scale = torch.where(ordinary, torch.ones_like(a), (1.0 - a) * rescale)
        grad_scale = torch.where(ordinary, torch.exp(-raw_bias.clamp_min(floor)), torch.full_like(a, rescale))
        dk = torch.zeros(b, hk, n, d, dtype=wd, device=q.device)
        dvv = torch.zeros(b, hk, n, dv, dtype=wd, device=q.device)
        dk[:, :, :-1] = dk_ext[:, :, 1:, :d] * key_scale.unsqueeze(-1)
        dvv[:, :, :-1] = dv_ext[:, :, 1:, :dv] * key_scale.unsqueeze(-1)
        dalpha = torch.zeros(b, hk, n, dtype=wd, device=q.device)
        dalpha[..., 1:] = -grad_scale * dk_ext[:, :, 1:, c]

        # Diagonal: P_ii = exp(s_ii - lse_i), dS_ii = P_ii (<dO_i, v~_i> - D_i).
        qs = _scaled_queries(q, scale, free_channel, wd)
        p_diag = (s_diag - lse).exp_()
        vw = v.to(wd).unsqueeze(2)
        dp_diag = (do.view(b, hk, G, n, dv) * vw).sum(-1).view(b, hq, n)
        ds_diag = p_diag * (dp_diag - (do * out).sum(-1))
        kw = k.to(wd)
        if free_channel is not None:
            kw = kw.clone()
            kw[..., free_channel] = 0
        dq = dq_ext[..., :d]  # ours to modify
        dq.view(b, hk, G, n, d).addcmul_(ds_diag.view(b, hk, G, n, 1), kw.unsqueeze(2))
        dq.mul_(scale)
        dk += _group_sum(ds_diag.unsqueeze(-1) * qs, hk)
        dvv += _group_sum(p_diag.unsqueeze(-1) * do, hk)
        if free_channel is not None:  # the channel takes no part in attention
            dq[..., free_channel] = 0
            dk[..., free_channel] = 0
        return dq.to(q.dtype), dk.to(k.dtype), dvv.to(v.dtype), dalpha.to(alpha.dtype), None, None
