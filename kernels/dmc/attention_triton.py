"""DMC training attention in Triton: flash-attention-style forward and backward kernels.

The CUDA path of :func:`kernels.dmc.dmc_attention`: it is selected for CUDA tensors by the dispatch in
``kernels/dmc/__init__.py`` (``_attention_impl``). Same math and gradient conventions as the portable
PyTorch version (``attention_blocked.py``); runs under the Triton interpreter (``TRITON_INTERPRET=1``)
on CPU for the tests.

Layouts (made contiguous): q ``[b, h_q, n, d]``, k~ ``[b, h_kv, n, d]``, v~ ``[b, h_kv, n, d_v]``,
alpha ``[b, h_kv, n]``; GQA ``h_q = G h_kv``, query head j reads KV head ``j // G``. Per key j the
gate ``g_j = 1 - alpha_{j+1}`` and bias ``log g_j`` (last key: 1 and 0) are O(n) vectors formed on the
host (``gate_and_bias``). The unnormalised weight of (i, j) is ``exp(s_ij) g_j`` for j < i,
``exp(s_ii)`` on the diagonal and 0 for j > i, with ``s_ij = scale <q_i, k~_j>``.

Forward (grid: (b h_q) x query tiles): one program holds BLOCK_M queries and walks the key tiles of
BLOCK_N keys up to its last row, with an online softmax in fp32 (fp64 for fp64 inputs) over the biased
scores ``s + log g`` (``log 0`` and every masked entry, i.e. future / out-of-range, is the finite
``NEG_BIG``, whose exponent is exactly 0 once a real score has been seen; every row meets its own
diagonal entry, so the final max is always real). It stores the output and the row log-sum-exp
``lse``; nothing n x n ever reaches memory.

Backward (FlashAttention-2 split), with ``U = exp(s - lse)`` (visible entries only, exponent clamped
at 60 as in the blocked version: only entries with g ~ 0, where P = U g ~ 0, get there),
``g`` per entry (g_j below the diagonal, 1 on it, 0 above), ``P = U g``, ``D_i = <dO_i, O_i>`` and
``W = U (dP - D)``:

- ``_bwd_dkdv_kernel`` (grid: (b h_kv) x key tiles): for its keys, loops over the G query heads of
  the KV head and their query tiles from the diagonal on: ``dv_j = sum_i P_ij dO_i``,
  ``dk_j = sum_i g W_ij scale q_i`` and ``dL/dg_j = sum_{i > j} W_ij`` (U, not P: the exact one-sided
  derivative also at alpha = 1, g = 0), summed over the G heads in registers, no atomics;
  ``d alpha_{j+1} = -dL/dg_j`` on the host.
- ``_bwd_dq_kernel`` (grid: (b h_q) x query tiles): ``dq_i = scale sum_j g W_ij k_j``.

Loads are cast to the compute dtype before ``tl.dot`` (the interpreter's dot on bf16 is wrong). The
dots run in TF32 for 16-bit inputs (exact for the loaded bf16 / fp16 operands) and IEEE otherwise.
Head sizes are padded to powers of two >= 16 with masks; any n (edge masks).

Triton decides at ``@triton.jit`` time, i.e. when this module is imported, whether the kernels are
compiled or interpreted: ``TRITON_INTERPRET=1`` must be set before the first import.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from .attention_blocked import gate_and_bias

NEG_BIG = tl.constexpr(-1e30)  # finite stand-in for log(0) / masked entries; exp() of it is exactly 0
MAX_EXPONENT = tl.constexpr(60.0)


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _fwd_kernel(
    Q, K, V, BIAS, OUT, LSE,
    n, h_q, h_kv, G, SCALE,
    D: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    CDT: tl.constexpr, PREC: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)  # b * h_q + query head
    pid_m = tl.program_id(1)
    scale = tl.load(SCALE).to(CDT)
    bk = (bh // h_q) * h_kv + (bh % h_q) // G  # b * h_kv + KV head
    q_ptr = Q + bh * n * D
    k_ptr = K + bk * n * D
    v_ptr = V + bk * n * DV
    bias_ptr = BIAS + bk * n

    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < n
    q = tl.load(q_ptr + offs_m[:, None] * D + offs_d[None, :], mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    q = q.to(CDT) * scale

    m_i = tl.full([BLOCK_M], NEG_BIG, dtype=CDT)
    l_i = tl.zeros([BLOCK_M], dtype=CDT)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=CDT)

    hi = tl.minimum(m0 + BLOCK_M, n)
    for j0 in range(0, hi, BLOCK_N):
        offs_n = j0 + tl.arange(0, BLOCK_N)
        col_ok = offs_n < n
        k = tl.load(k_ptr + offs_n[:, None] * D + offs_d[None, :], mask=col_ok[:, None] & (offs_d[None, :] < D),
                    other=0.0).to(CDT)
        v = tl.load(v_ptr + offs_n[:, None] * DV + offs_dv[None, :], mask=col_ok[:, None] & (offs_dv[None, :] < DV),
                    other=0.0).to(CDT)
        bias = tl.load(bias_ptr + offs_n, mask=col_ok, other=0.0).to(CDT)
        bias = tl.maximum(bias, NEG_BIG)  # log(0) = -inf -> finite
        s = tl.dot(q, tl.trans(k), input_precision=PREC)
        below = offs_n[None, :] < offs_m[:, None]
        diag = offs_n[None, :] == offs_m[:, None]
        s = tl.where(below & col_ok[None, :], s + bias[None, :], tl.where(diag, s, NEG_BIG))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        corr = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * corr + tl.sum(p, 1)
        acc = acc * corr[:, None] + tl.dot(p, v, input_precision=PREC)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(OUT + bh * n * DV + offs_m[:, None] * DV + offs_dv[None, :], out,
             mask=row_ok[:, None] & (offs_dv[None, :] < DV))
    tl.store(LSE + bh * n + offs_m, m_i + tl.log(l_i), mask=row_ok)


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, GATE, DO, LSE, DELTA, DK, DVV, DGATE,
    n, h_q, h_kv, G, SCALE,
    D: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    CDT: tl.constexpr, PREC: tl.constexpr, WANT_GATE: tl.constexpr,
):
    bk = tl.program_id(0).to(tl.int64)  # b * h_kv + KV head
    pid_n = tl.program_id(1)
    scale = tl.load(SCALE).to(CDT)
    b_idx = bk // h_kv
    h_idx = bk % h_kv

    j0 = pid_n * BLOCK_N
    offs_n = j0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    col_ok = offs_n < n
    k_mask = col_ok[:, None] & (offs_d[None, :] < D)
    v_mask = col_ok[:, None] & (offs_dv[None, :] < DV)
    k = tl.load(K + bk * n * D + offs_n[:, None] * D + offs_d[None, :], mask=k_mask, other=0.0).to(CDT)
    v = tl.load(V + bk * n * DV + offs_n[:, None] * DV + offs_dv[None, :], mask=v_mask, other=0.0).to(CDT)
    gate = tl.load(GATE + bk * n + offs_n, mask=col_ok, other=0.0).to(CDT)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=CDT)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=CDT)
    dgate = tl.zeros([BLOCK_N], dtype=CDT)

    start = (j0 // BLOCK_M) * BLOCK_M  # first query tile that can see these keys
    for gi in range(0, G):
        bh = b_idx * h_q + h_idx * G + gi
        q_ptr = Q + bh * n * D
        do_ptr = DO + bh * n * DV
        for i0 in range(start, n, BLOCK_M):
            offs_m = i0 + tl.arange(0, BLOCK_M)
            row_ok = offs_m < n
            q = tl.load(q_ptr + offs_m[:, None] * D + offs_d[None, :], mask=row_ok[:, None] & (offs_d[None, :] < D),
                        other=0.0).to(CDT) * scale
            do = tl.load(do_ptr + offs_m[:, None] * DV + offs_dv[None, :],
                         mask=row_ok[:, None] & (offs_dv[None, :] < DV), other=0.0).to(CDT)
            lse = tl.load(LSE + bh * n + offs_m, mask=row_ok, other=0.0)
            delta = tl.load(DELTA + bh * n + offs_m, mask=row_ok, other=0.0)

            # Transposed tiles [keys, queries]: no transposes of the probabilities needed.
            s_t = tl.dot(k, tl.trans(q), input_precision=PREC)
            below = offs_n[:, None] < offs_m[None, :]  # key j strictly before query i
            visible = (offs_n[:, None] <= offs_m[None, :]) & row_ok[None, :] & col_ok[:, None]
            u_t = tl.where(visible, tl.exp(tl.minimum(s_t - lse[None, :], MAX_EXPONENT)), 0.0)
            g_t = tl.where(below, gate[:, None], 1.0)  # masked entries have u = 0 already
            p_t = u_t * g_t
            dv += tl.dot(p_t, do, input_precision=PREC)
            dp_t = tl.dot(v, tl.trans(do), input_precision=PREC)
            w_t = u_t * (dp_t - delta[None, :])
            if WANT_GATE:
                dgate += tl.sum(tl.where(below, w_t, 0.0), 1)
            ds_t = w_t * g_t
            dk += tl.dot(ds_t, q, input_precision=PREC)

    tl.store(DK + bk * n * D + offs_n[:, None] * D + offs_d[None, :], dk, mask=k_mask)
    tl.store(DVV + bk * n * DV + offs_n[:, None] * DV + offs_dv[None, :], dv, mask=v_mask)
    if WANT_GATE:
        tl.store(DGATE + bk * n + offs_n, dgate, mask=col_ok)


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, GATE, DO, LSE, DELTA, DQ,
    n, h_q, h_kv, G, SCALE,
    D: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    CDT: tl.constexpr, PREC: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)  # b * h_q + query head
    pid_m = tl.program_id(1)
    scale = tl.load(SCALE).to(CDT)
    bk = (bh // h_q) * h_kv + (bh % h_q) // G
    k_ptr = K + bk * n * D
    v_ptr = V + bk * n * DV

    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < n
    q_mask = row_ok[:, None] & (offs_d[None, :] < D)
    q = tl.load(Q + bh * n * D + offs_m[:, None] * D + offs_d[None, :], mask=q_mask, other=0.0).to(CDT) * scale
    do = tl.load(DO + bh * n * DV + offs_m[:, None] * DV + offs_dv[None, :],
                 mask=row_ok[:, None] & (offs_dv[None, :] < DV), other=0.0).to(CDT)
    lse = tl.load(LSE + bh * n + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + bh * n + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=CDT)

    hi = tl.minimum(m0 + BLOCK_M, n)
    for j0 in range(0, hi, BLOCK_N):
        offs_n = j0 + tl.arange(0, BLOCK_N)
        col_ok = offs_n < n
        k = tl.load(k_ptr + offs_n[:, None] * D + offs_d[None, :], mask=col_ok[:, None] & (offs_d[None, :] < D),
                    other=0.0).to(CDT)
        v = tl.load(v_ptr + offs_n[:, None] * DV + offs_dv[None, :], mask=col_ok[:, None] & (offs_dv[None, :] < DV),
                    other=0.0).to(CDT)
        gate = tl.load(GATE + bk * n + offs_n, mask=col_ok, other=0.0).to(CDT)
        s = tl.dot(q, tl.trans(k), input_precision=PREC)
        below = offs_n[None, :] < offs_m[:, None]
        visible = (offs_n[None, :] <= offs_m[:, None]) & row_ok[:, None] & col_ok[None, :]
        u = tl.where(visible, tl.exp(tl.minimum(s - lse[:, None], MAX_EXPONENT)), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = u * (dp - delta[:, None]) * tl.where(below, gate[None, :], 1.0)
        dq += tl.dot(ds, k, input_precision=PREC)

    tl.store(DQ + bh * n * D + offs_m[:, None] * D + offs_d[None, :], dq * scale, mask=q_mask)


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------


def _pad(size: int) -> int:
    return max(16, triton.next_power_of_2(size))


def _config(q: torch.Tensor):
    """Compute dtype and dot precision: fp64 stays fp64 (IEEE dots), everything else fp32; TF32 dots
    only for 16-bit inputs, whose values TF32 holds exactly."""
    if q.dtype == torch.float64:
        return torch.float64, tl.float64, "ieee"
    prec = "tf32" if q.dtype in (torch.bfloat16, torch.float16) else "ieee"
    return torch.float32, tl.float32, prec


def _default_block(d: int, dv: int) -> int:
    return 64 if max(d, dv) <= 64 else 32


class TritonDMCAttention(torch.autograd.Function):
    """``apply(q [b, hq, n, d], k [b, hk, n, d], v [b, hk, n, dv], alpha [b, hk, n], scale, block_m,
    block_n, num_warps) -> out [b, hq, n, dv]`` (inputs validated by ``dmc_attention``)."""

    @staticmethod
    def forward(ctx, q, k, v, alpha, scale, block_m, block_n, num_warps):
        b, hq, n, d = q.shape
        hk, dv = k.shape[1], v.shape[-1]
        wd, cdt, prec = _config(q)
        q, k, v, alpha = (t.contiguous() for t in (q, k, v, alpha))
        _, bias = gate_and_bias(alpha.to(wd))
        bias = bias.contiguous()
        out = torch.empty(b, hq, n, dv, dtype=wd, device=q.device)
        lse = torch.empty(b, hq, n, dtype=wd, device=q.device)
        scale_t = torch.full((1,), scale, dtype=wd, device=q.device)  # a float argument would be fp32
        _fwd_kernel[(b * hq, triton.cdiv(n, block_m))](
            q, k, v, bias, out, lse, n, hq, hk, hq // hk, scale_t,
            D=d, DV=dv, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=_pad(d), BLOCK_DV=_pad(dv),
            CDT=cdt, PREC=prec, num_warps=num_warps,
        )
        ctx.save_for_backward(q, k, v, alpha, out, lse)
        ctx.scale, ctx.block_m, ctx.block_n, ctx.num_warps = scale, block_m, block_n, num_warps
        return out.to(q.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, alpha, out, lse = ctx.saved_tensors
        scale, block_m, block_n, num_warps = ctx.scale, ctx.block_m, ctx.block_n, ctx.num_warps
        b, hq, n, d = q.shape
        hk, dv = k.shape[1], v.shape[-1]
        wd, cdt, prec = _config(q)
        want_alpha = ctx.needs_input_grad[3]

        gate, _ = gate_and_bias(alpha.to(wd))
        gate = gate.contiguous()
        do = grad_out.contiguous()
        delta = (do.to(wd) * out).sum(-1).contiguous()  # D_i = <dO_i, O_i>, [b, hq, n]

        dq = torch.empty(b, hq, n, d, dtype=wd, device=q.device)
        dk = torch.empty(b, hk, n, d, dtype=wd, device=q.device)
        dvv = torch.empty(b, hk, n, dv, dtype=wd, device=q.device)
        dgate = torch.empty(b, hk, n, dtype=wd, device=q.device) if want_alpha else dk  # dummy if unused
        common = dict(D=d, DV=dv, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=_pad(d), BLOCK_DV=_pad(dv),
                      CDT=cdt, PREC=prec, num_warps=num_warps)
        scale_t = torch.full((1,), scale, dtype=wd, device=q.device)
        _bwd_dkdv_kernel[(b * hk, triton.cdiv(n, block_n))](
            q, k, v, gate, do, lse, delta, dk, dvv, dgate, n, hq, hk, hq // hk, scale_t,
            WANT_GATE=want_alpha, **common,
        )
        _bwd_dq_kernel[(b * hq, triton.cdiv(n, block_m))](
            q, k, v, gate, do, lse, delta, dq, n, hq, hk, hq // hk, scale_t, **common,
        )

        dalpha = None
        if want_alpha:
            dalpha = torch.zeros_like(dgate)
            dalpha[..., 1:] = -dgate[..., :-1]  # gate_j = 1 - alpha_{j+1}
            dalpha = dalpha.to(alpha.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dvv.to(v.dtype), dalpha, None, None, None, None


def dmc_attention_triton(
    q: torch.Tensor,
    k_tilde: torch.Tensor,
    v_tilde: torch.Tensor,
    alpha: torch.Tensor,
    scale: float,
    free_channel: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """DMC training attention (Fig. 3 bias) with the Triton kernels of this module.

    Same contract as :func:`kernels.dmc.dmc_attention` (inputs already validated there, ``scale``
    resolved): q ``[b, h_q, n, d]``, k_tilde ``[b, h_kv, n, d]``, v_tilde ``[b, h_kv, n, d_v]``, alpha
    ``[b, h_kv, n]`` in [0, 1]; ``free_channel`` is a channel of q / k_tilde treated as 0 (gradient 0).
    ``block_m`` / ``block_n``: query / key tile sizes (powers of two >= 16; default 64, 32 for head
    sizes above 64); ``num_warps``: default 4, 8 for head sizes above 64 (these defaults are untuned).

    Returns ``out [b, h_q, n, d_v]`` in q's dtype (computed in fp32, fp64 for fp64 inputs),
    differentiable w.r.t. q, k_tilde, v_tilde and alpha (exact one-sided alpha derivative at alpha = 1).
    """
    d, dv = q.shape[-1], v_tilde.shape[-1]
    block_m = block_m or _default_block(d, dv)
    block_n = block_n or _default_block(d, dv)
    num_warps = num_warps or (4 if max(d, dv) <= 64 else 8)
    for name, blk in (("block_m", block_m), ("block_n", block_n)):
        if blk < 16 or blk & (blk - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {blk}")
    if free_channel is not None:
        q = q.index_fill(-1, torch.tensor([free_channel], device=q.device), 0)
    return TritonDMCAttention.apply(q, k_tilde, v_tilde, alpha, float(scale), block_m, block_n, num_warps)
