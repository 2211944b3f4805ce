"""DMC training attention through PyTorch's fused flash-attention kernels, on CPU and on CUDA.

A fused causal attention kernel that returns the row log-sum-exp, and its backward, are O(n)-memory; the
device decides which (:func:`fused_ops`): on CPU ``aten._scaled_dot_product_flash_attention_for_cpu``; on
CUDA in bf16 / fp16 cuDNN's (``aten._scaled_dot_product_cudnn_attention``) on Hopper and newer,
FlashAttention-2 (``aten._scaled_dot_product_flash_attention``) before, and the memory-efficient kernel in fp32
(``aten._scaled_dot_product_efficient_attention``). The kernel works in the input dtype on CUDA (bf16 /
fp16: the dtype the flash kernels take) and in fp32 (fp64) on CPU; the merge below is always fp32 (fp64). On
CUDA the element-wise stages around the kernel are fused by ``torch.compile`` (:func:`_stages`).
The Fig. 3 bias is split into

- the *past* part (j < i, bias ``log(1 - alpha_{j+1})``): shift keys and values one position to the
  right, so that causal attention of query i over the shifted sequence covers exactly j < i; slot 0
  becomes a dummy key no query may see. The per-key bias rides in one channel, ``q' = [q * scale, 1]``,
  ``k'_{j+1} = [k~_j, log(1 - alpha_{j+1})]``, so the kernel's scores are ``s_ij + bias_j``. That
  channel is DMC's decision channel when the caller names it (``free_channel``: the head size stays
  d) or an appended one (head size d + 1, rounded up to a multiple of 8 on CUDA; ~30 % slower on CPU);
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
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ._checks import empty_in_layout_of, work_dtype
from .attention_blocked import NEG_BIG

_BIAS_FLOOR_BACKWARD = -60.0


# ---------------------------------------------------------------------------------------------
# The fused kernels of each device: forward (out, lse [b, h, n], extras) and backward (dq, dk, dv)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FusedOps:
    """One fused causal attention kernel pair, at scale 1, on ``[b, h, n, W]`` inputs of one dtype.

    ``forward(q, k, v) -> (out, lse, extras)``: ``lse [b, h, n]`` fp32 (natural log); ``extras`` is what its
    backward needs besides the tensors. ``backward(do, q, k, v, out, lse, extras) -> (dq, dk, dv)``.
    ``kernel_dtype(dtype)``: the dtype the kernel computes in for inputs of ``dtype``. ``width_multiple``: the
    head size is padded to a multiple of it."""

    name: str
    forward: Callable
    backward: Callable
    kernel_dtype: Callable[[torch.dtype], torch.dtype]
    width_multiple: int = 1
    compiled: bool = False  # the element-wise stages around the kernels through torch.compile


def _cpu_forward(q, k, v):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=1.0)
    return out, lse, None


def _cpu_backward(do, q, k, v, out, lse, extras):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(do, q, k, v, out, lse, 0.0, True,
                                                                               scale=1.0)


def _flash_forward(q, k, v):
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, True, False, scale=1.0)
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _flash_backward(do, q, k, v, out, lse, extras):
    cum_q, cum_k, max_q, max_k, seed, offset = extras
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        do, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset, scale=1.0)


def _cudnn_forward(q, k, v):
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, True, False, scale=1.0)
    return out, lse.reshape(q.shape[:3]), (lse.shape, cum_q, cum_k, max_q, max_k, seed, offset)


def _cudnn_backward(do, q, k, v, out, lse, extras):
    lse_shape, cum_q, cum_k, max_q, max_k, seed, offset = extras
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(  # cuDNN wants out laid out like do
        do, q, k, v, out.contiguous(), lse.reshape(lse_shape), seed, offset, None, cum_q, cum_k, max_q, max_k,
        0.0, True, scale=1.0)


def _efficient_forward(q, k, v):
    out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True,
                                                                                    scale=1.0)
    n = q.shape[2]  # the kernel pads its lse's rows (to a multiple of 32); its backward takes it padded
    return out, lse[..., :n], (lse, seed, offset)


def _efficient_backward(do, q, k, v, out, lse, extras):
    padded, seed, offset = extras
    padded = padded.clone()
    padded[..., :q.shape[2]] = lse
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        do, q, k, v, None, out, padded, seed, offset, 0.0, [True, True, True, False], True, scale=1.0)
    return dq, dk, dv


def _cpu_kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


CPU_FLASH = FusedOps("cpu_flash", _cpu_forward, _cpu_backward, _cpu_kernel_dtype)
CUDA_FLASH = FusedOps("flash", _flash_forward, _flash_backward, lambda dtype: dtype, 8, True)
CUDA_CUDNN = FusedOps("cudnn", _cudnn_forward, _cudnn_backward, lambda dtype: dtype, 8, True)
CUDA_EFFICIENT = FusedOps("efficient", _efficient_forward, _efficient_backward, lambda dtype: dtype, 8, True)


@functools.cache
def fused_cpu_available() -> bool:
    try:
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # noqa: B018
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


def fused_ops(device: torch.device, dtype: torch.dtype) -> FusedOps | None:
    """The fused kernels for inputs on ``device`` of ``dtype``: CPU flash on CPU; on CUDA for bf16 / fp16 cuDNN's
    on Hopper and newer (1.3-1.4x faster than FlashAttention-2 there, benchmarks/gpu_train.py), FlashAttention-2
    before, and the memory-efficient kernel for fp32; None where none fits (fp64 on CUDA, other devices)."""
    if device.type == "cpu":
        return CPU_FLASH if fused_cpu_available() else None
    if device.type == "cuda":
        if dtype in (torch.bfloat16, torch.float16):
            hopper = torch.cuda.get_device_capability(device) >= (9, 0)
            return CUDA_CUDNN if hopper and torch.backends.cudnn.is_available() else CUDA_FLASH
        return CUDA_EFFICIENT if dtype == torch.float32 else None
    return None


# ---------------------------------------------------------------------------------------------
# Kernel inputs, the diagonal, the autograd function
# ---------------------------------------------------------------------------------------------


def _kernel_inputs(q, k, v, alpha, scale, free_channel, bias_floor, kd, multiple):
    """``q' [b, hq, n, W]``, shifted ``k' / v' [b, hq, n, W]`` (repeated over the GQA group) in dtype ``kd``,
    and the bias channel index. ``W = d`` (free channel) or ``d + 1``, at least ``d_v``, rounded up to
    ``multiple``."""
    b, hq, n, d = q.shape
    hk, dv = k.shape[1], v.shape[-1]
    G = hq // hk
    c = d if free_channel is None else free_channel
    width = max(d if free_channel is not None else d + 1, dv)
    width = -(-width // multiple) * multiple

    bias = torch.log1p(-alpha.to(work_dtype(alpha))).clamp_min_(bias_floor)  # slot j+1 holds key j
    bias[..., 0] = NEG_BIG  # slot 0: dummy, never visible
    k_ext = torch.empty(b, hk, n, width, dtype=kd, device=q.device)
    k_ext[:, :, 0] = 0
    k_ext[:, :, 1:, :d] = k[:, :, :-1]
    k_ext[..., d:] = 0
    k_ext[..., c] = bias
    v_ext = torch.empty(b, hk, n, width, dtype=kd, device=q.device)
    v_ext[:, :, 0] = 0
    v_ext[:, :, 1:, :dv] = v[:, :, :-1]
    v_ext[..., dv:] = 0
    if G > 1:
        k_ext = k_ext.repeat_interleave(G, dim=1)
        v_ext = v_ext.repeat_interleave(G, dim=1)
    q_ext = torch.empty(b, hq, n, width, dtype=kd, device=q.device)
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


def _group_sum(x: torch.Tensor, hk: int) -> torch.Tensor:
    """``[b, hq, ...] -> [b, hk, ...]``: sum over the query heads of each KV group."""
    b, hq = x.shape[:2]
    return x.view(b, hk, hq // hk, *x.shape[2:]).sum(2) if hq != hk else x


def _merge(out_past, lse_past, q, k, v, scale, free_channel):
    """The diagonal merged with the past part: ``out [b, hq, n, dv]`` (laid out like q, in the kernel's dtype),
    ``lse`` and the diagonal scores ``s_diag [b, hq, n]`` (work dtype)."""
    b, hq, n, d = q.shape
    hk, dv = k.shape[1], v.shape[-1]
    G = hq // hk
    wd = work_dtype(q)
    qs = _scaled_queries(q, scale, free_channel, wd)
    s_diag = (qs.view(b, hk, G, n, d) * k.to(wd).unsqueeze(2)).sum(-1).view(b, hq, n)
    lse = torch.logaddexp(lse_past.to(wd), s_diag)
    w_past = (lse_past - lse).exp_().unsqueeze(-1)
    w_diag = (s_diag - lse).exp_()
    out = torch.mul(out_past[..., :dv], w_past, out=empty_in_layout_of(q, dv, wd))
    out.view(b, hk, G, n, dv).addcmul_(w_diag.view(b, hk, G, n, 1), v.to(wd).unsqueeze(2))
    return out.to(out_past.dtype), lse.to(lse_past.dtype), s_diag


def _finish_backward(dq_ext, dk_ext, dv_ext, q, k, v, alpha, do, out, lse, s_diag, scale, free_channel, c, floor):
    """dq, dk, dv, dalpha (in the inputs' dtypes) from the kernel's gradients of the past part (``dk_ext`` /
    ``dv_ext`` per query head) and the diagonal's, which are element-wise."""
    b, hq, n, d = q.shape
    hk, dv = k.shape[1], v.shape[-1]
    G = hq // hk
    wd = s_diag.dtype
    dk_ext, dv_ext = _group_sum(dk_ext.to(wd), hk), _group_sum(dv_ext.to(wd), hk)
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
    do, out = do.to(wd), out.to(wd)
    qs = _scaled_queries(q, scale, free_channel, wd)
    p_diag = (s_diag - lse).exp_()
    vw = v.to(wd).unsqueeze(2)
    dp_diag = (do.view(b, hk, G, n, dv) * vw).sum(-1).view(b, hq, n)
    ds_diag = p_diag * (dp_diag - (do * out).sum(-1))
    kw = k.to(wd)
    if free_channel is not None:
        kw = kw.clone()
        kw[..., free_channel] = 0
    dq = dq_ext[..., :d].to(wd)  # ours to modify
    dq.view(b, hk, G, n, d).addcmul_(ds_diag.view(b, hk, G, n, 1), kw.unsqueeze(2))
    dq.mul_(scale)
    dk += _group_sum(ds_diag.unsqueeze(-1) * qs, hk)
    dvv += _group_sum(p_diag.unsqueeze(-1) * do, hk)
    if free_channel is not None:  # the channel takes no part in attention
        dq[..., free_channel] = 0
        dk[..., free_channel] = 0
    return dq.to(q.dtype), dk.to(k.dtype), dvv.to(v.dtype), dalpha.to(alpha.dtype)


@functools.cache
def _stages(compiled: bool) -> tuple[Callable, Callable, Callable]:
    """The element-wise stages around the kernels (inputs, merge, backward's finish): as written, or fused by
    ``torch.compile`` (CUDA: each stage is many passes over ``[b, h, n, d]`` tensors otherwise)."""
    stages = (_kernel_inputs, _merge, _finish_backward)
    if not compiled:
        return stages
    return tuple(torch.compile(f, dynamic=False) for f in stages)


class FusedDMCAttention(torch.autograd.Function):
    """``apply(q [b, hq, n, d], k [b, hk, n, d], v [b, hk, n, dv], alpha [b, hk, n], scale, free_channel, ops)
    -> out [b, hq, n, dv]`` (inputs validated by ``dmc_attention``; ``ops``: :func:`fused_ops` of the inputs;
    out's dims lie in memory like q's, see ``empty_in_layout_of``)."""

    @staticmethod
    def forward(ctx, q, k, v, alpha, scale, free_channel, ops):
        prepare, merge, _ = _stages(ops.compiled)
        kd = ops.kernel_dtype(q.dtype)
        q_ext, k_ext, v_ext, _ = prepare(q, k, v, alpha, scale, free_channel, NEG_BIG, kd, ops.width_multiple)
        out_past, lse_past, extras = ops.forward(q_ext, k_ext, v_ext)
        del q_ext, k_ext, v_ext
        # out: what the kernel's backward reads (and, for bf16 / fp16 inputs, what is returned)
        out, lse, s_diag = merge(out_past, lse_past, q, k, v, scale, free_channel)
        ctx.save_for_backward(q, k, v, alpha, out, lse, s_diag)
        ctx.scale, ctx.free_channel, ctx.ops, ctx.extras = scale, free_channel, ops, extras
        return out.to(q.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, alpha, out, lse, s_diag = ctx.saved_tensors
        scale, free_channel, ops = ctx.scale, ctx.free_channel, ctx.ops
        prepare, _, finish = _stages(ops.compiled)
        do = grad_out.to(out.dtype).contiguous()

        def past_backward(floor):
            """The fused backward of the past part with the merged out / lse: dq', dk', dv' per query head."""
            q_ext, k_ext, v_ext, c = prepare(q, k, v, alpha, scale, free_channel, floor, out.dtype,
                                             ops.width_multiple)
            pad = q_ext.shape[-1] - do.shape[-1]
            do_, out_ = (F.pad(do, (0, pad)), F.pad(out, (0, pad))) if pad else (do, out)
            return (*ops.backward(do_, q_ext, k_ext, v_ext, out_, lse, ctx.extras), c)

        floor = _BIAS_FLOOR_BACKWARD
        dq_ext, dk_ext, dv_ext, c = past_backward(floor)
        if not torch.isfinite(dq_ext.sum() + dv_ext.sum()):  # an overflow shows in both
            # exp(s - lse - 60) overflowed: an invisible key outscores its row by > 148 nats. Redo
            # with invisible keys at weight 0 (their alpha-gradient is then 0 in this call).
            floor = NEG_BIG
            dq_ext, dk_ext, dv_ext, c = past_backward(floor)
        return (*finish(dq_ext, dk_ext, dv_ext, q, k, v, alpha, do, out, lse, s_diag, scale, free_channel, c, floor),
                None, None, None)
