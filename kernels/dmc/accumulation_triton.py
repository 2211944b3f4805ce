"""Partial accumulation of keys and values (DMC Eq. 9) in Triton: forward and backward kernels.

The CUDA path of :func:`kernels.dmc.partial_accumulation`: it is selected for CUDA tensors by the
dispatch in ``kernels/dmc/__init__.py`` (``_accumulation_impl``). Same semantics, dtypes and gradient
conventions as the PyTorch version (``accumulation.py``); runs under the Triton interpreter
(``TRITON_INTERPRET=1``) on CPU for the tests.

Layouts (made contiguous): k ``[b, h_kv, n, d]``, v ``[b, h_kv, n, d_v]``, alpha / omega
``[b, h_kv, n]``. Per (b, h) the recurrence ``h_i = a_i h_{i-1} + x_i`` runs over the channels
``x = [w k, w v, w]`` (w = omega, a_0 := 0); ``k~ = h[:d] / z``, ``v~ = h[d:d+d_v] / z`` with the
normaliser ``z = h[-1]``.

Kernels (grid: (b h_kv) x channel blocks): a program owns ``BLOCK`` channels of the concatenation
``[k | v]`` (``d + d_v`` channels, masked edges) and walks the tokens *sequentially* with accumulators
in fp32 (fp64 for fp64 inputs). The scalar normaliser channel z is recomputed by every program (it
is cheap), so each program divides its own channels. Only multiplications and additions of the
gates: no logarithms, exact (and NaN-free) at a = 0 and a = 1.

- ``exact`` forward: the recurrence itself; program 0 also stores z ``[b h, n]`` for backward.
- ``window(w)`` forward: ``h_i = sum_{j=max(0,i-w+1)}^{i} (prod_{m=j+1}^{i} a_m) x_j`` by restarting the
  recurrence at ``i - w + 1`` for every i (O(n w) per program, meant for the paper's short windows).
  ``w >= n`` is the exact recurrence and runs the exact kernels.

Backward: ``dL/dh_i`` from the upstream ``g_k~, g_v~`` is ``g_k~ / z`` (in the kernels) and, on the
z channel, ``-(<g_k~, k~> + <g_v~, v~>) / z`` (computed on the host: it needs every channel). With
``G_j = dL/dx_j``: ``dk_j = w_j G_j[:d]``, ``dv_j = w_j G_j[d:d+d_v]``, ``domega_j = <G_j, [k_j, v_j, 1]>``.

- ``exact``: the adjoint recurrence backwards in time, ``G_i = dL/dh_i + a_{i+1} G_{i+1}``, and
  ``dalpha_i = <G_i, h_{i-1}>`` with ``h_{i-1} = [k~, v~, 1] z`` rebuilt from the saved outputs (in
  their dtype, as the PyTorch path does).
- ``window(w)``: ``G_j = sum_{i=j}^{j+w-1} (prod_{m=j+1}^{i} a_m) dL/dh_i`` (O(w) per token), and
  ``dalpha_m = sum_{i=m}^{m+w-2} (prod_{m'=m+1}^{i} a_{m'}) <dL/dh_i, T_i>`` where ``T_i`` is the state
  at m - 1 of the recurrence restarted at ``max(0, i - w + 1)``. Visiting i downwards lengthens
  ``T_i`` by one older token at a time (exact updates) while the products for i upwards are kept
  in a vector of ``next_pow2(w - 1)`` slots: O(w) per token as well.

Both backward kernels write their partial sums of ``dalpha`` and ``domega`` (over their own channels;
program 0 adds the z channel) to ``[b h, n_blocks, n]``, summed on the host: no atomics.
``alpha_0`` gets gradient 0. Inputs and gradients keep their dtypes (loads are cast to the compute
dtype; the interpreter's 16-bit arithmetic is unreliable, so nothing is computed in it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from ._checks import work_dtype

DEFAULT_BLOCK = 64  # channels of [k | v] per program (more programs for small b h on a GPU)


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _load_kv(K, V, ok, ov, tok, is_k, is_v, CDT: tl.constexpr, D: tl.constexpr, DV: tl.constexpr):
    """Token ``tok`` of this (b, h) on the program's channels of ``[K | V]`` (offsets ok / ov), 0 where masked."""
    xk = tl.load(K + ok + tok * D, mask=is_k, other=0.0).to(CDT)
    return xk + tl.load(V + ov + tok * DV, mask=is_v, other=0.0).to(CDT)


@triton.jit
def _store_kv(K, V, ok, ov, tok, y, is_k, is_v, D: tl.constexpr, DV: tl.constexpr):
    """Store the channel block ``y`` as token ``tok`` of ``K`` / ``V`` (each in its own dtype)."""
    tl.store(K + ok + tok * D, y.to(K.dtype.element_ty), mask=is_k)
    tl.store(V + ov + tok * DV, y.to(V.dtype.element_ty), mask=is_v)


@triton.jit
def _fwd_kernel(
    K, V, ALPHA, OMEGA, KT, VT, Z,
    n, window,
    D: tl.constexpr, DV: tl.constexpr, BLOCK: tl.constexpr, EXACT: tl.constexpr, CDT: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)
    cb = tl.program_id(1)
    offs = cb * BLOCK + tl.arange(0, BLOCK)  # channels of [k | v]
    is_k = offs < D
    is_v = (offs >= D) & (offs < D + DV)
    row = bh * n  # flat index of token 0 of this (b, h)
    ok, ov = row * D + tl.where(is_k, offs, 0), row * DV + tl.where(is_v, offs - D, 0)  # token 0 in K / V
    ap, wp, zp = ALPHA + row, OMEGA + row, Z + row  # per-token scalars
    if EXACT:
        h = tl.zeros([BLOCK], dtype=CDT)
        hz = tl.zeros((), dtype=CDT)
        for i in range(n):
            a = tl.load(ap + i, mask=i > 0, other=0.0).to(CDT)  # a_0 := 0
            w = tl.load(wp + i).to(CDT)
            x = _load_kv(K, V, ok, ov, i, is_k, is_v, CDT, D, DV)
            h = a * h + w * x
            hz = a * hz + w
            _store_kv(KT, VT, ok, ov, i, h / hz, is_k, is_v, D, DV)
            tl.store(zp + i, hz, mask=cb == 0)
    else:
        for i in range(n):
            start = tl.maximum(i - window + 1, 0)
            h = tl.zeros([BLOCK], dtype=CDT)
            hz = tl.zeros((), dtype=CDT)
            for j in range(start, i + 1):
                a = tl.load(ap + j, mask=j > start, other=0.0).to(CDT)  # the recurrence restarts at `start`
                w = tl.load(wp + j).to(CDT)
                x = _load_kv(K, V, ok, ov, j, is_k, is_v, CDT, D, DV)
                h = a * h + w * x
                hz = a * hz + w
            _store_kv(KT, VT, ok, ov, i, h / hz, is_k, is_v, D, DV)
            tl.store(zp + i, hz, mask=cb == 0)


@triton.jit
def _bwd_exact_kernel(
    K, V, ALPHA, OMEGA, KT, VT, Z, GKT, GVT, GZ, DK, DV_, DA_PART, DW_PART,
    n, n_blocks,
    D: tl.constexpr, DV: tl.constexpr, BLOCK: tl.constexpr, CDT: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)
    cb = tl.program_id(1)
    offs = cb * BLOCK + tl.arange(0, BLOCK)
    is_k = offs < D
    is_v = (offs >= D) & (offs < D + DV)
    row = bh * n
    ok, ov = row * D + tl.where(is_k, offs, 0), row * DV + tl.where(is_v, offs - D, 0)
    ap, wp, zp, gzp = ALPHA + row, OMEGA + row, Z + row, GZ + row
    part = (bh * n_blocks + cb) * n  # this program's row of the [b h, n_blocks, n] partial sums
    z_flag = (cb == 0).to(CDT)  # the z channel is counted once, by block 0
    g = tl.zeros([BLOCK], dtype=CDT)  # G_i = dL/dx_i on this block's channels
    gz = tl.zeros((), dtype=CDT)  # ... and on the z channel
    for tt in range(n):
        i = n - 1 - tt
        a_next = tl.load(ap + i + 1, mask=i + 1 < n, other=0.0).to(CDT)
        gh = _load_kv(GKT, GVT, ok, ov, i, is_k, is_v, CDT, D, DV)
        g = gh / tl.load(zp + i).to(CDT) + a_next * g
        gz = tl.load(gzp + i).to(CDT) + a_next * gz
        w = tl.load(wp + i).to(CDT)
        _store_kv(DK, DV_, ok, ov, i, w * g, is_k, is_v, D, DV)
        x = _load_kv(K, V, ok, ov, i, is_k, is_v, CDT, D, DV)
        tl.store(DW_PART + part + i, tl.sum(g * x, axis=0) + z_flag * gz)
        # dalpha_i = <G_i, h_{i-1}>, h_{i-1} = [k~, v~, 1] z_{i-1}; 0 for i = 0 (z_{-1} := 0)
        z_prev = tl.load(zp + i - 1, mask=i > 0, other=0.0).to(CDT)
        y_prev = _load_kv(KT, VT, ok, ov, i - 1, is_k & (i > 0), is_v & (i > 0), CDT, D, DV)
        tl.store(DA_PART + part + i, z_prev * (tl.sum(g * y_prev, axis=0) + z_flag * gz))


@triton.jit
def _bwd_window_kernel(
    K, V, ALPHA, OMEGA, Z, GKT, GVT, GZ, DK, DV_, DA_PART, DW_PART,
    n, n_blocks, window,
    D: tl.constexpr, DV: tl.constexpr, BLOCK: tl.constexpr, SLOTS: tl.constexpr, CDT: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)
    cb = tl.program_id(1)
    offs = cb * BLOCK + tl.arange(0, BLOCK)
    is_k = offs < D
    is_v = (offs >= D) & (offs < D + DV)
    row = bh * n
    ok, ov = row * D + tl.where(is_k, offs, 0), row * DV + tl.where(is_v, offs - D, 0)
    ap, wp, zp, gzp = ALPHA + row, OMEGA + row, Z + row, GZ + row
    part = (bh * n_blocks + cb) * n
    z_flag = (cb == 0).to(CDT)
    slots = tl.arange(0, SLOTS)
    for m in range(n):
        # Outputs i in [m, e), e = min(m + w - 1, n), have both m - 1 and m in their window. Downwards
        # over them: dots[i - m] = <dL/dh_i, T_i> with T_i = sum_{j=s_i}^{m-1} P(j+1..m-1) x_j,
        # s_i = max(0, i - w + 1) (P(j+1..i) = prod_{m'=j+1}^{i} a_{m'}), which only gains older tokens.
        e = tl.minimum(m + window - 1, n)
        dots = tl.zeros([SLOTS], dtype=CDT)
        t = tl.zeros([BLOCK], dtype=CDT)  # T on this block's channels, then on the z channel
        tz = tl.zeros((), dtype=CDT)
        coef = tl.full((), 1.0, CDT)  # P(j+1..m-1) of the oldest token j in T
        length = 0  # T holds tokens m - length .. m - 1
        for ii in range(0, e - m):
            i = e - 1 - ii
            target = tl.minimum(window - 1 - (i - m), m)
            for l in range(length, target):
                j = m - 1 - l
                coef = coef * tl.load(ap + j + 1, mask=l > 0, other=1.0).to(CDT)
                cw = coef * tl.load(wp + j).to(CDT)
                t += cw * _load_kv(K, V, ok, ov, j, is_k, is_v, CDT, D, DV)
                tz += cw
            length = target
            gh = _load_kv(GKT, GVT, ok, ov, i, is_k, is_v, CDT, D, DV)
            dot = tl.sum(gh * t, axis=0) / tl.load(zp + i).to(CDT) + z_flag * tl.load(gzp + i).to(CDT) * tz
            dots = tl.where(slots == i - m, dot, dots)
        # Upwards over i in [m, m + w): G_m = sum_i P(m+1..i) dL/dh_i, dalpha_m = sum_{i<e} P(m+1..i) dots[i - m]
        g = tl.zeros([BLOCK], dtype=CDT)
        gz = tl.zeros((), dtype=CDT)
        prods = tl.zeros([SLOTS], dtype=CDT)  # slot i - m: P(m+1..i) (slot w - 1, i = m + w - 1, is dropped)
        p = tl.full((), 1.0, CDT)
        for i in range(m, tl.minimum(m + window, n)):
            p = p * tl.load(ap + i, mask=i > m, other=1.0).to(CDT)
            gh = _load_kv(GKT, GVT, ok, ov, i, is_k, is_v, CDT, D, DV)
            g += (p / tl.load(zp + i).to(CDT)) * gh
            gz += p * tl.load(gzp + i).to(CDT)
            prods = tl.where(slots == i - m, p, prods)
        w = tl.load(wp + m).to(CDT)
        _store_kv(DK, DV_, ok, ov, m, w * g, is_k, is_v, D, DV)
        x = _load_kv(K, V, ok, ov, m, is_k, is_v, CDT, D, DV)
        tl.store(DW_PART + part + m, tl.sum(g * x, axis=0) + z_flag * gz)
        tl.store(DA_PART + part + m, tl.sum(prods * dots, axis=0))


# ---------------------------------------------------------------------------------------------
# Autograd function and entry point
# ---------------------------------------------------------------------------------------------


def _compute_dtype(t: torch.Tensor):
    return tl.float64 if work_dtype(t) == torch.float64 else tl.float32


def _num_warps(block: int) -> int:
    return 1 if block <= 64 else 2


class _TritonAccumulation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k, v, alpha, omega, exact, window, block):
        k, v, alpha, omega = (t.contiguous() for t in (k, v, alpha, omega))
        b, hk, n, d = k.shape
        dv = v.shape[-1]
        k_tilde, v_tilde = torch.empty_like(k), torch.empty_like(v)
        z = torch.empty(b, hk, n, dtype=work_dtype(k), device=k.device)
        n_blocks = triton.cdiv(d + dv, block)
        if b * hk:
            _fwd_kernel[(b * hk, n_blocks)](
                k, v, alpha, omega, k_tilde, v_tilde, z, n, window,
                D=d, DV=dv, BLOCK=block, EXACT=exact, CDT=_compute_dtype(k), num_warps=_num_warps(block),
            )
        ctx.save_for_backward(k, v, alpha, omega, k_tilde, v_tilde, z)
        ctx.exact, ctx.window, ctx.block = exact, window, block
        return k_tilde, v_tilde

    @staticmethod
    @once_differentiable
    def backward(ctx, dk_tilde, dv_tilde):
        k, v, alpha, omega, k_tilde, v_tilde, z = ctx.saved_tensors
        b, hk, n, d = k.shape
        dv = v.shape[-1]
        wd = z.dtype
        dk_tilde = torch.zeros_like(k_tilde) if dk_tilde is None else dk_tilde.contiguous()
        dv_tilde = torch.zeros_like(v_tilde) if dv_tilde is None else dv_tilde.contiguous()
        # dL/dz_i = -(<g_k~, k~> + <g_v~, v~>) / z_i: a reduction over all channels, so on the host
        gz = -((dk_tilde.to(wd) * k_tilde.to(wd)).sum(-1) + (dv_tilde.to(wd) * v_tilde.to(wd)).sum(-1)) / z
        block = ctx.block
        n_blocks = triton.cdiv(d + dv, block)
        dk, dv_ = torch.empty_like(k), torch.empty_like(v)
        da_part = torch.empty(b * hk, n_blocks, n, dtype=wd, device=k.device)
        dw_part = torch.empty_like(da_part)
        grid = (b * hk, n_blocks)
        common = dict(D=d, DV=dv, BLOCK=block, CDT=_compute_dtype(k), num_warps=_num_warps(block))
        if ctx.exact and b * hk:
            _bwd_exact_kernel[grid](
                k, v, alpha, omega, k_tilde, v_tilde, z, dk_tilde, dv_tilde, gz, dk, dv_, da_part, dw_part,
                n, n_blocks, **common,
            )
        elif b * hk:
            slots = triton.next_power_of_2(max(ctx.window - 1, 1))
            _bwd_window_kernel[grid](
                k, v, alpha, omega, z, dk_tilde, dv_tilde, gz, dk, dv_, da_part, dw_part,
                n, n_blocks, ctx.window, SLOTS=slots, **common,
            )
        dalpha = da_part.sum(1).view(b, hk, n)
        dalpha[..., 0] = 0  # alpha_0 is forced to 0
        domega = dw_part.sum(1).view(b, hk, n)
        return dk, dv_, dalpha.to(alpha.dtype), domega.to(omega.dtype), None, None, None


def partial_accumulation_triton(k, v, alpha, omega, mode, window, chunk, *, block=None):
    """Triton implementation of :func:`kernels.dmc.partial_accumulation` (inputs validated there).

    ``k [b, h_kv, n, d]``, ``v [b, h_kv, n, d_v]``, ``alpha`` / ``omega [b, h_kv, n]``; returns
    ``(k_tilde [b, h_kv, n, d], v_tilde [b, h_kv, n, d_v])`` in the dtypes of k and v, differentiable
    w.r.t. all four inputs. ``mode`` is ``"exact"`` or ``"window"``; ``chunk`` (a knob of the PyTorch
    scan) is unused: the kernels scan token by token. ``block``: channels of ``[k | v]`` per program
    (a power of two, default ``min(DEFAULT_BLOCK, next_pow2(d + d_v))``).
    """
    d_all = k.shape[-1] + v.shape[-1]
    if block is None:
        block = min(DEFAULT_BLOCK, triton.next_power_of_2(d_all))
    elif block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block!r}")
    exact = mode == "exact" or window >= k.shape[2]  # a window covering every token is the recurrence
    return _TritonAccumulation.apply(k, v, alpha, omega, exact, int(window), int(block))
