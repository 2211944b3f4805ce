"""Partial accumulation of keys and values (DMC Eq. 9) in Triton: forward and backward kernels.

The CUDA path of :func:`kernels.dmc.partial_accumulation`: it is selected for CUDA tensors by the
dispatch in ``kernels/dmc/__init__.py`` (``_accumulation_impl``). Same semantics, dtypes and gradient
conventions as the PyTorch version (``accumulation.py``); runs under the Triton interpreter
(``TRITON_INTERPRET=1``) on CPU for the tests.

Layouts (made contiguous): k ``[b, h_kv, n, d]``, v ``[b, h_kv, n, d_v]``, alpha / omega
``[b, h_kv, n]``; the normaliser z ``[b, h_kv, n]`` (fp32, fp64 for fp64 inputs) is saved for backward.
Per (b, h) the recurrence ``h_i = a_i h_{i-1} + x_i`` runs over the channels ``x = [w k, w v, w]``
(w = omega, a_0 := 0); ``k~ = h[:d] / z``, ``v~ = h[d:d+d_v] / z`` with the normaliser ``z = h[-1]``.

Programs own ``BLOCK_C`` channels of the concatenation ``[k | v]`` (masked at the k / v boundary and
the end) and work on tiles ``[BLOCK_T tokens, BLOCK_C channels]`` (2-D loads, coalesced along the
channels). Arithmetic is in fp32 (fp64 for fp64 inputs) on loads cast to it; only products and sums
of the gates, no logarithms or divisions by a, so a = 0 and a = 1 are exact. The scalar channel z is
recomputed by every program (1-D, cheap).

- ``exact`` forward, grid (b h, channel blocks): the program walks its tiles in order. In a tile the
  recurrence is ``tl.associative_scan`` over the tokens of the pairs (a, x) with the combine
  ``(a1, x1), (a2, x2) -> (a1 a2, a2 x1 + x2)``; its first component is the product of the gates
  from the tile start, which carries the state of the previous tile in: ``h = scan + prod * h_in``.
  The next tile's loads are issued before the current tile's scan.
- ``window(w)`` forward (the paper's approximation, ``w < n``; ``w >= n`` runs the exact kernels),
  grid (b h, channel blocks, token tiles), independent tiles:
  ``h_i = sum_{s<w} P_s(i) x_{i-s}``, ``P_s(i) = prod_{m=i-s+1}^{i} a_m``, terms with i - s < 0 dropped:
  w multiply-adds of the tile loaded s tokens back (cache hits after the first).

Backward. Upstream ``g = (g_k~, g_v~)``: ``dL/dh = g / z`` on the channels and, on the z channel,
``dh_z = -(<g_k~, k~> + <g_v~, v~>) / z``, a reduction over every channel. With ``G_j = dL/dx_j``:
``dk_j = w_j G_j[:d]``, ``dv_j = w_j G_j[d:]``, ``domega_j = <G_j, [k_j, v_j, 1]>``; ``alpha_0`` gets 0.
dalpha and domega are sums over channels, so the channel programs write partial sums over their own
channels to ``[b h, n_blocks, n]`` buffers (no atomics), together with their part of
``<g, [k~, v~]>``; a second, 1-D kernel per (b h) sums the blocks, runs the z channel's adjoint and
writes dalpha and domega.

- ``exact``: ``G_i = dL/dh_i + a_{i+1} G_{i+1}``, the same scan over reversed tiles
  (``reverse=True``, gates a_{i+1}), tiles visited from the last; ``dalpha_i = <G_i, h_{i-1}>`` with
  ``h_{i-1} = z_{i-1} [k~, v~, 1]_{i-1}`` rebuilt from the saved outputs (as the PyTorch path does).
- ``window(w)``: with ``T_r(m) = P_r(m+r) dL/dh_{m+r}`` and ``H^(q)_m = sum_{s<=q} P_s(m) x_{m-s}``:
  ``G_m = sum_{r<w} T_r(m)``, ``dalpha_m = sum_{q<=w-2} <T_{w-2-q}(m), H^(q)_{m-1}>`` (every pair of
  an output i = m + r and an input j = m - 1 - s in one window, ``r + s <= w - 2``). One loop over q
  grows H and reloads shifted tiles; ``P_r(m+r)`` for the decreasing r is rebuilt each step (1-D).

Block sizes (:func:`_tiles`): exact mode halves ``BLOCK_C`` (64 down to 16) until there are ~256
programs, since its parallelism is (b h) x channel blocks; ``BLOCK_T`` gives a few tiles per program
for short sequences (the tests) and 128 (exact forward) or 64 tokens for long ones; 4 warps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from ._checks import work_dtype

MAX_BLOCK_C = 64  # channels of [k | v] per program
MIN_BLOCK_C = 16  # 32 bytes of a bf16 row: one memory sector
MIN_PROGRAMS = 256  # exact mode: parallelism wanted from (b h) x channel blocks (about 2 per SM)


# ---------------------------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------------------------


@triton.jit
def _combine(a1, x1, a2, x2):
    """Compose two steps of ``h -> a h + x`` (first then second)."""
    return a1 * a2, a2 * x1 + x2


@triton.jit
def _channels(cb, D: tl.constexpr, DV: tl.constexpr, BLOCK_C: tl.constexpr):
    """The program's channels of ``[k | v]``: offsets into k and v (plain ranges, so that loads are
    vectorised; out of range where masked) and their masks."""
    ch = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    return ch, ch - D, ch < D, (ch >= D) & (ch < D + DV)


@triton.jit
def _load_kv(K, V, rows, ck, cv, is_k, is_v, n, D: tl.constexpr, DV: tl.constexpr, CDT: tl.constexpr):
    """Tile ``[rows, channels]`` of this (b, h)'s ``[K | V]`` in CDT, 0 outside ``[0, n)``."""
    ok = ((rows >= 0) & (rows < n))[:, None]
    r = rows[:, None]
    xk = tl.load(K + r * D + ck[None, :], mask=ok & is_k[None, :], other=0.0).to(CDT)
    return xk + tl.load(V + r * DV + cv[None, :], mask=ok & is_v[None, :], other=0.0).to(CDT)


@triton.jit
def _store_kv(K, V, rows, ck, cv, is_k, is_v, n, y, D: tl.constexpr, DV: tl.constexpr):
    ok = (rows < n)[:, None]
    r = rows[:, None]
    tl.store(K + r * D + ck[None, :], y.to(K.dtype.element_ty), mask=ok & is_k[None, :])
    tl.store(V + r * DV + cv[None, :], y.to(V.dtype.element_ty), mask=ok & is_v[None, :])


@triton.jit
def _load_row(P, rows, n, other, CDT: tl.constexpr):
    """Per-token values at ``rows`` (any integers), ``other`` outside ``[0, n)``."""
    return tl.load(P + rows, mask=(rows >= 0) & (rows < n), other=other).to(CDT)


@triton.jit
def _pick(x, rows, row):
    """Entry ``row`` of the vector x (indexed by ``rows``)."""
    return tl.sum(tl.where(rows == row, x, 0.0), axis=0)


@triton.jit
def _pick_row(x, rows, row):
    """Row ``row`` of the tile x (rows indexed by ``rows``)."""
    return tl.sum(tl.where((rows == row)[:, None], x, 0.0), axis=0)


@triton.jit
def _decay(ALPHA, rows, r, n, CDT: tl.constexpr):
    """``P_r(rows + r) = prod_{s=1}^{r} a_{rows+s}`` (0 past the end, where nothing is read)."""
    p = tl.full(rows.shape, 1.0, CDT)
    for s in range(1, r + 1):
        p *= _load_row(ALPHA, rows + s, n, 0.0, CDT)
    return p


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------


@triton.jit
def _fwd_exact_kernel(
    K, V, ALPHA, OMEGA, KT, VT, Z, n,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, CDT: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)
    ck, cv, is_k, is_v = _channels(tl.program_id(1), D, DV, BLOCK_C)
    K, V, KT, VT = K + bh * n * D, V + bh * n * DV, KT + bh * n * D, VT + bh * n * DV
    ALPHA, OMEGA, Z = ALPHA + bh * n, OMEGA + bh * n, Z + bh * n
    t = tl.arange(0, BLOCK_T)
    h_in = tl.zeros([BLOCK_C], dtype=CDT)  # state after the previous tile
    z_in = tl.zeros([], dtype=CDT)
    # a past the end is 1 (the state passes through), w and x are 0
    a_nx = tl.where(t == 0, 0.0, _load_row(ALPHA, t, n, 1.0, CDT))  # a_0 := 0
    w_nx = _load_row(OMEGA, t, n, 0.0, CDT)
    x_nx = _load_kv(K, V, t, ck, cv, is_k, is_v, n, D, DV, CDT)
    for t0 in range(0, n, BLOCK_T):
        rows = t0 + t
        a, w, x = a_nx, w_nx, x_nx
        a_nx = _load_row(ALPHA, rows + BLOCK_T, n, 1.0, CDT)
        w_nx = _load_row(OMEGA, rows + BLOCK_T, n, 0.0, CDT)
        x_nx = _load_kv(K, V, rows + BLOCK_T, ck, cv, is_k, is_v, n, D, DV, CDT)

        p, h = tl.associative_scan((tl.broadcast_to(a[:, None], x.shape), w[:, None] * x), 0, _combine)
        h += p * h_in[None, :]
        pz, z = tl.associative_scan((a, w), 0, _combine)
        z += pz * z_in
        _store_kv(KT, VT, rows, ck, cv, is_k, is_v, n, h / z[:, None], D, DV)
        tl.store(Z + rows, z, mask=(rows < n) & (tl.program_id(1) == 0))
        h_in = _pick_row(h, rows, t0 + BLOCK_T - 1)
        z_in = _pick(z, rows, t0 + BLOCK_T - 1)


@triton.jit
def _fwd_window_kernel(
    K, V, ALPHA, OMEGA, KT, VT, Z, n, window,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, CDT: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)
    ck, cv, is_k, is_v = _channels(tl.program_id(1), D, DV, BLOCK_C)
    K, V, KT, VT = K + bh * n * D, V + bh * n * DV, KT + bh * n * D, VT + bh * n * DV
    ALPHA, OMEGA, Z = ALPHA + bh * n, OMEGA + bh * n, Z + bh * n
    rows = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    p = tl.full([BLOCK_T], 1.0, CDT)  # P_s(i)
    h = tl.zeros([BLOCK_T, BLOCK_C], dtype=CDT)
    z = tl.zeros([BLOCK_T], dtype=CDT)
    for s in range(0, window):
        j = rows - s  # token j enters with weight P_s(i) w_j; P_s(i) = P_{s-1}(i) a_{j+1}
        p *= tl.where((s > 0) & (j >= 0), _load_row(ALPHA, j + 1, n, 1.0, CDT), 1.0)
        c = p * _load_row(OMEGA, j, n, 0.0, CDT)
        h += c[:, None] * _load_kv(K, V, j, ck, cv, is_k, is_v, n, D, DV, CDT)
        z += c
    z = tl.where(rows < n, z, 1.0)
    _store_kv(KT, VT, rows, ck, cv, is_k, is_v, n, h / z[:, None], D, DV)
    tl.store(Z + rows, z, mask=(rows < n) & (tl.program_id(1) == 0))


# ---------------------------------------------------------------------------------------------
# Backward: channel blocks (partial sums), then the z channel and the block sums per (b h)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _bwd_exact_kernel(
    K, V, ALPHA, OMEGA, KT, VT, Z, GK, GV, DK, DV_, DA_PART, DW_PART, RD_PART, n,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, CDT: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)
    cb = tl.program_id(1)
    ck, cv, is_k, is_v = _channels(cb, D, DV, BLOCK_C)
    K, V, KT, VT = K + bh * n * D, V + bh * n * DV, KT + bh * n * D, VT + bh * n * DV
    GK, GV, DK, DV_ = GK + bh * n * D, GV + bh * n * DV, DK + bh * n * D, DV_ + bh * n * DV
    ALPHA, OMEGA, Z = ALPHA + bh * n, OMEGA + bh * n, Z + bh * n
    part = (bh * tl.num_programs(1) + cb) * n  # this program's row of the [b h, n_blocks, n] partial sums
    DA_PART, DW_PART, RD_PART = DA_PART + part, DW_PART + part, RD_PART + part
    t = tl.arange(0, BLOCK_T)
    g_in = tl.zeros([BLOCK_C], dtype=CDT)  # G at the first token of the following tile
    a_nx, z_nx, zp_nx, g_nx, x_nx, y_nx, yp_nx = _bwd_exact_loads(
        K, V, ALPHA, Z, GK, GV, KT, VT, (tl.cdiv(n, BLOCK_T) - 1) * BLOCK_T + t, ck, cv, is_k, is_v, n, D, DV, CDT)
    for tt in range(0, tl.cdiv(n, BLOCK_T)):
        t0 = (tl.cdiv(n, BLOCK_T) - 1 - tt) * BLOCK_T
        rows = t0 + t
        a_next, z, z_prev, g, x, y, y_prev = a_nx, z_nx, zp_nx, g_nx, x_nx, y_nx, yp_nx
        a_nx, z_nx, zp_nx, g_nx, x_nx, y_nx, yp_nx = _bwd_exact_loads(
            K, V, ALPHA, Z, GK, GV, KT, VT, rows - BLOCK_T, ck, cv, is_k, is_v, n, D, DV, CDT)

        dh = g / z[:, None]
        p, G = tl.associative_scan((tl.broadcast_to(a_next[:, None], dh.shape), dh), 0, _combine, reverse=True)
        G += p * g_in[None, :]
        g_in = _pick_row(G, rows, t0)
        _store_kv(DK, DV_, rows, ck, cv, is_k, is_v, n, _load_row(OMEGA, rows, n, 0.0, CDT)[:, None] * G, D, DV)
        ok = rows < n
        tl.store(DW_PART + rows, tl.sum(G * x, axis=1), mask=ok)
        tl.store(DA_PART + rows, z_prev * tl.sum(G * y_prev, axis=1), mask=ok)
        tl.store(RD_PART + rows, tl.sum(g * y, axis=1), mask=ok)


@triton.jit
def _bwd_exact_loads(K, V, ALPHA, Z, GK, GV, KT, VT, rows, ck, cv, is_k, is_v, n,
                     D: tl.constexpr, DV: tl.constexpr, CDT: tl.constexpr):
    """What one tile of the exact backward reads: a_{i+1}, z_i, z_{i-1}, g_i, [k, v]_i, y_i, y_{i-1}."""
    return (
        _load_row(ALPHA, rows + 1, n, 0.0, CDT),
        _load_row(Z, rows, n, 1.0, CDT),
        _load_row(Z, rows - 1, n, 0.0, CDT),
        _load_kv(GK, GV, rows, ck, cv, is_k, is_v, n, D, DV, CDT),
        _load_kv(K, V, rows, ck, cv, is_k, is_v, n, D, DV, CDT),
        _load_kv(KT, VT, rows, ck, cv, is_k, is_v, n, D, DV, CDT),
        _load_kv(KT, VT, rows - 1, ck, cv, is_k, is_v, n, D, DV, CDT),
    )


@triton.jit
def _bwd_window_kernel(
    K, V, ALPHA, OMEGA, KT, VT, Z, GK, GV, DK, DV_, DA_PART, DW_PART, RD_PART, n, window,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, CDT: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)
    cb = tl.program_id(1)
    ck, cv, is_k, is_v = _channels(cb, D, DV, BLOCK_C)
    K, V, KT, VT = K + bh * n * D, V + bh * n * DV, KT + bh * n * D, VT + bh * n * DV
    GK, GV, DK, DV_ = GK + bh * n * D, GV + bh * n * DV, DK + bh * n * D, DV_ + bh * n * DV
    ALPHA, OMEGA, Z = ALPHA + bh * n, OMEGA + bh * n, Z + bh * n
    part = (bh * tl.num_programs(1) + cb) * n
    m = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    G = tl.zeros([BLOCK_T, BLOCK_C], dtype=CDT)
    da = tl.zeros([BLOCK_T, BLOCK_C], dtype=CDT)  # summed over the channels at the end
    H = tl.zeros([BLOCK_T, BLOCK_C], dtype=CDT)  # H^(q)_{m-1}
    ps = tl.full([BLOCK_T], 1.0, CDT)  # P_q(m-1)
    for q in range(0, window - 1):
        j = m - 1 - q
        ps *= tl.where(q > 0, _load_row(ALPHA, j + 1, n, 1.0, CDT), 1.0)
        H += (ps * _load_row(OMEGA, j, n, 0.0, CDT))[:, None] * _load_kv(K, V, j, ck, cv, is_k, is_v, n, D, DV, CDT)
        i = m + window - 2 - q  # T_r(m), r = w - 2 - q
        c = _decay(ALPHA, m, window - 2 - q, n, CDT) / _load_row(Z, i, n, 1.0, CDT)
        tr = c[:, None] * _load_kv(GK, GV, i, ck, cv, is_k, is_v, n, D, DV, CDT)
        da += tr * H
        G += tr
    i = m + window - 1
    c = _decay(ALPHA, m, window - 1, n, CDT) / _load_row(Z, i, n, 1.0, CDT)
    G += c[:, None] * _load_kv(GK, GV, i, ck, cv, is_k, is_v, n, D, DV, CDT)

    _store_kv(DK, DV_, m, ck, cv, is_k, is_v, n, _load_row(OMEGA, m, n, 0.0, CDT)[:, None] * G, D, DV)
    x = _load_kv(K, V, m, ck, cv, is_k, is_v, n, D, DV, CDT)
    g = _load_kv(GK, GV, m, ck, cv, is_k, is_v, n, D, DV, CDT)
    y = _load_kv(KT, VT, m, ck, cv, is_k, is_v, n, D, DV, CDT)
    ok = m < n
    tl.store(DW_PART + part + m, tl.sum(G * x, axis=1), mask=ok)
    tl.store(DA_PART + part + m, tl.sum(da, axis=1), mask=ok)
    tl.store(RD_PART + part + m, tl.sum(g * y, axis=1), mask=ok)


@triton.jit
def _block_sum(P, rows, n, n_blocks, NB: tl.constexpr, CDT: tl.constexpr):
    """``sum_b P[b, rows]`` of one (b h)'s ``[n_blocks, n]`` partial sums (0 outside ``[0, n)``)."""
    b = tl.arange(0, NB)
    mask = ((rows >= 0) & (rows < n))[:, None] & (b < n_blocks)[None, :]
    return tl.sum(tl.load(P + b[None, :] * n + rows[:, None], mask=mask, other=0.0).to(CDT), axis=1)


@triton.jit
def _dh_z(RD_PART, Z, rows, n, n_blocks, NB: tl.constexpr, CDT: tl.constexpr):
    """``dL/dz = -<g, [k~, v~]> / z`` at ``rows`` (0 outside ``[0, n)``)."""
    return -_block_sum(RD_PART, rows, n, n_blocks, NB, CDT) / _load_row(Z, rows, n, 1.0, CDT)


@triton.jit
def _bwd_z_exact_kernel(
    ALPHA, Z, DA_PART, DW_PART, RD_PART, DALPHA, DOMEGA, n, n_blocks,
    BLOCK_T: tl.constexpr, NB: tl.constexpr, CDT: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)
    ALPHA, Z, DALPHA, DOMEGA = ALPHA + bh * n, Z + bh * n, DALPHA + bh * n, DOMEGA + bh * n
    DA_PART, DW_PART, RD_PART = DA_PART + bh * n_blocks * n, DW_PART + bh * n_blocks * n, RD_PART + bh * n_blocks * n
    t = tl.arange(0, BLOCK_T)
    g_in = tl.zeros([], dtype=CDT)
    for tt in range(0, tl.cdiv(n, BLOCK_T)):
        t0 = (tl.cdiv(n, BLOCK_T) - 1 - tt) * BLOCK_T
        rows = t0 + t
        dh = _dh_z(RD_PART, Z, rows, n, n_blocks, NB, CDT)
        p, G = tl.associative_scan((_load_row(ALPHA, rows + 1, n, 0.0, CDT), dh), 0, _combine, reverse=True)
        G += p * g_in
        g_in = _pick(G, rows, t0)
        da = _block_sum(DA_PART, rows, n, n_blocks, NB, CDT) + _load_row(Z, rows - 1, n, 0.0, CDT) * G
        dw = _block_sum(DW_PART, rows, n, n_blocks, NB, CDT) + G
        tl.store(DALPHA + rows, tl.where(rows == 0, 0.0, da).to(DALPHA.dtype.element_ty), mask=rows < n)
        tl.store(DOMEGA + rows, dw.to(DOMEGA.dtype.element_ty), mask=rows < n)


@triton.jit
def _bwd_z_window_kernel(
    ALPHA, OMEGA, Z, DA_PART, DW_PART, RD_PART, DALPHA, DOMEGA, n, n_blocks, window,
    BLOCK_T: tl.constexpr, NB: tl.constexpr, CDT: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)
    ALPHA, OMEGA, Z = ALPHA + bh * n, OMEGA + bh * n, Z + bh * n
    DALPHA, DOMEGA = DALPHA + bh * n, DOMEGA + bh * n
    DA_PART, DW_PART, RD_PART = DA_PART + bh * n_blocks * n, DW_PART + bh * n_blocks * n, RD_PART + bh * n_blocks * n
    m = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    # the window adjoint of the channel kernel on the single channel x = w
    G = tl.zeros([BLOCK_T], dtype=CDT)
    da = tl.zeros([BLOCK_T], dtype=CDT)
    H = tl.zeros([BLOCK_T], dtype=CDT)
    ps = tl.full([BLOCK_T], 1.0, CDT)
    for q in range(0, window - 1):
        j = m - 1 - q
        ps *= tl.where(q > 0, _load_row(ALPHA, j + 1, n, 1.0, CDT), 1.0)
        H += ps * _load_row(OMEGA, j, n, 0.0, CDT)
        tr = _decay(ALPHA, m, window - 2 - q, n, CDT) * _dh_z(RD_PART, Z, m + window - 2 - q, n, n_blocks, NB, CDT)
        da += tr * H
        G += tr
    G += _decay(ALPHA, m, window - 1, n, CDT) * _dh_z(RD_PART, Z, m + window - 1, n, n_blocks, NB, CDT)
    da += _block_sum(DA_PART, m, n, n_blocks, NB, CDT)
    dw = _block_sum(DW_PART, m, n, n_blocks, NB, CDT) + G
    tl.store(DALPHA + m, tl.where(m == 0, 0.0, da).to(DALPHA.dtype.element_ty), mask=m < n)
    tl.store(DOMEGA + m, dw.to(DOMEGA.dtype.element_ty), mask=m < n)


# ---------------------------------------------------------------------------------------------
# Block sizes, autograd function and entry point
# ---------------------------------------------------------------------------------------------


def _tiles(n: int, d_all: int, bh: int, exact: bool, backward: bool, block: int | None):
    """``(BLOCK_T, BLOCK_C, num_warps)`` for a kernel on ``[bh, n, d_all]`` (``block``: BLOCK_C if given)."""
    block_c = block or min(MAX_BLOCK_C, triton.next_power_of_2(d_all))
    if exact and block is None:  # the only parallelism is (b h) x channel blocks
        while block_c > MIN_BLOCK_C and bh * triton.cdiv(d_all, block_c) < MIN_PROGRAMS:
            block_c //= 2
    max_t = 128 if exact and not backward else 64
    block_t = min(max_t, max(16, triton.next_power_of_2(triton.cdiv(n, 4))))  # a few tiles even for short n
    return block_t, block_c, max(1, min(4, block_t * block_c // 512))  # 4 warps measured best on an H200


def _compute_dtype(t: torch.Tensor):
    return tl.float64 if work_dtype(t) == torch.float64 else tl.float32


class _TritonAccumulation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k, v, alpha, omega, exact, window, block):
        k, v, alpha, omega = (t.contiguous() for t in (k, v, alpha, omega))
        b, hk, n, d = k.shape
        dv = v.shape[-1]
        k_tilde, v_tilde = torch.empty_like(k), torch.empty_like(v)
        z = torch.empty(b, hk, n, dtype=work_dtype(k), device=k.device)
        bt, bc, warps = _tiles(n, d + dv, b * hk, exact, False, block)
        args = (k, v, alpha, omega, k_tilde, v_tilde, z, n)
        meta = dict(D=d, DV=dv, BLOCK_T=bt, BLOCK_C=bc, CDT=_compute_dtype(k), num_warps=warps)
        if b * hk and exact:
            _fwd_exact_kernel[(b * hk, triton.cdiv(d + dv, bc))](*args, **meta)
        elif b * hk:
            _fwd_window_kernel[(b * hk, triton.cdiv(d + dv, bc), triton.cdiv(n, bt))](*args, window, **meta)
        ctx.save_for_backward(k, v, alpha, omega, k_tilde, v_tilde, z)
        ctx.exact, ctx.window, ctx.block = exact, window, block
        return k_tilde, v_tilde

    @staticmethod
    @once_differentiable
    def backward(ctx, dk_tilde, dv_tilde):
        k, v, alpha, omega, k_tilde, v_tilde, z = ctx.saved_tensors
        b, hk, n, d = k.shape
        dv = v.shape[-1]
        dk_tilde = torch.zeros_like(k_tilde) if dk_tilde is None else dk_tilde.contiguous()
        dv_tilde = torch.zeros_like(v_tilde) if dv_tilde is None else dv_tilde.contiguous()
        dk, dv_ = torch.empty_like(k), torch.empty_like(v)
        dalpha, domega = torch.empty_like(alpha), torch.empty_like(omega)
        if b * hk == 0:
            return dk, dv_, dalpha, domega, None, None, None
        bt, bc, warps = _tiles(n, d + dv, b * hk, ctx.exact, True, ctx.block)
        n_blocks = triton.cdiv(d + dv, bc)
        # per channel block: dalpha and domega over its channels, and <g, [k~, v~]> (for the z channel)
        parts = torch.empty(3, b * hk, n_blocks, n, dtype=z.dtype, device=k.device)
        cdt = _compute_dtype(k)
        args = (k, v, alpha, omega, k_tilde, v_tilde, z, dk_tilde, dv_tilde, dk, dv_, *parts, n)
        meta = dict(D=d, DV=dv, BLOCK_T=bt, BLOCK_C=bc, CDT=cdt, num_warps=warps)
        z_meta = dict(BLOCK_T=min(1024, triton.next_power_of_2(n)), NB=triton.next_power_of_2(n_blocks), CDT=cdt)
        if ctx.exact:
            _bwd_exact_kernel[(b * hk, n_blocks)](*args, **meta)
            _bwd_z_exact_kernel[(b * hk,)](alpha, z, *parts, dalpha, domega, n, n_blocks, **z_meta)
        else:
            _bwd_window_kernel[(b * hk, n_blocks, triton.cdiv(n, bt))](*args, ctx.window, **meta)
            z_meta["BLOCK_T"] = min(64, z_meta["BLOCK_T"])
            grid = (b * hk, triton.cdiv(n, z_meta["BLOCK_T"]))
            _bwd_z_window_kernel[grid](alpha, omega, z, *parts, dalpha, domega, n, n_blocks, ctx.window, **z_meta)
        return dk, dv_, dalpha, domega, None, None, None


def partial_accumulation_triton(k, v, alpha, omega, mode, window, chunk, *, block=None):
    """Triton implementation of :func:`kernels.dmc.partial_accumulation` (inputs validated there).

    ``k [b, h_kv, n, d]``, ``v [b, h_kv, n, d_v]``, ``alpha`` / ``omega [b, h_kv, n]``; returns
    ``(k_tilde [b, h_kv, n, d], v_tilde [b, h_kv, n, d_v])`` in the dtypes of k and v, differentiable
    w.r.t. all four inputs. ``mode`` is ``"exact"`` or ``"window"``; ``chunk`` (a knob of the PyTorch
    scan) is unused. ``block``: channels of ``[k | v]`` per program (a power of two; default chosen
    by :func:`_tiles`).
    """
    if block is not None and (block < 1 or block & (block - 1)):
        raise ValueError(f"block must be a power of two, got {block!r}")
    exact = mode == "exact" or window >= k.shape[2]  # a window covering every token is the recurrence
    return _TritonAccumulation.apply(k, v, alpha, omega, exact, int(window), block)
