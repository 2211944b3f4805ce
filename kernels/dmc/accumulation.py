"""Partial accumulation of keys and values (DMC, Nawrot et al. 2024, Eq. 9).

Per KV head, with decisions ``alpha_i`` in [0, 1] and importances ``omega_i = w_i`` > 0:

    z_0 = w_0,          z_i = alpha_i z_{i-1} + w_i
    n_0 = w_0 k_0,      n_i = alpha_i n_{i-1} + w_i k_i          (same for v)
    k~_i = n_i / z_i

``alpha_0`` is forced to 0 (the first token always appends). Numerator and normaliser are one
first-order linear recurrence ``h_i = a_i h_{i-1} + x_i`` over the channels ``x = [w k, w v, w]``,
so both modes below run a single scan on that concatenation.

- ``exact``: the full recurrence (what inference computes). Chunked parallel scan: inside a chunk of
  C tokens ``h = D x`` with the decay matrix ``D[i, j] = prod_{m=j+1}^{i} a_m`` built by a cumulative
  *product* (no logarithms, so a_m = 0 and a_m = 1 are exact and NaN-free); the state entering each
  chunk comes from the same scan applied recursively to the chunk ends; the adjoint is the same scan
  backwards in time. Memory O(n (d + C)) per head.
- ``window``: the paper's approximation (Sec. 3.3): position i runs the recurrence only over its
  last ``w`` tokens, ``h_i = sum_{j=max(0, i-w+1)}^{i} (prod_{m=j+1}^{i} a_m) x_j``; ``w`` shifted
  multiply-adds, and O(w) of them for the adjoint. Memory O(n (d + w)) per head.

Both run in one custom autograd function that saves only the inputs, the outputs (which attention
keeps anyway) and z, so the accumulation adds no activation memory of its own.

``reference.reference_partial_accumulation`` is the token-by-token loop both are tested against;
``kernels.dmc.partial_accumulation`` validates the inputs and dispatches here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ._checks import work_dtype

# ---------------------------------------------------------------------------------------------
# Entry point (inputs validated by kernels.dmc.partial_accumulation)
# ---------------------------------------------------------------------------------------------


def partial_accumulation_torch(k, v, alpha, omega, mode, window, chunk):
    """PyTorch implementation of :func:`kernels.dmc.partial_accumulation` (any device).

    ``k [b, h_kv, n, d]``, ``v [b, h_kv, n, d_v]``, ``alpha`` / ``omega [b, h_kv, n]``; returns
    ``(k_tilde [b, h_kv, n, d], v_tilde [b, h_kv, n, d_v])``. ``mode`` is ``"exact"`` or ``"window"``.
    """
    return _Accumulation.apply(k, v, alpha, omega, mode, window, chunk)


# ---------------------------------------------------------------------------------------------
# exact: chunked parallel scan h_i = a_i h_{i-1} + x_i
# ---------------------------------------------------------------------------------------------


def _decay_matrix_t(a: torch.Tensor) -> torch.Tensor:
    """``a [..., C] -> D^T [..., C, C]`` where ``D[i, j] = prod_{m=j+1}^{i} a_m`` for i >= j, else 0.

    Row j of the result is column j of D: the cumulative product along i of ``a_i`` masked to 1 for
    ``i <= j`` (runs along the contiguous last dim). Exact for a in [0, 1] including hard zeros (no
    log 0) and ones.
    """
    C = a.shape[-1]
    idx = torch.arange(C, device=a.device)
    dt = torch.where(idx[None, :] > idx[:, None], a.unsqueeze(-2), torch.ones((), dtype=a.dtype, device=a.device))
    return dt.cumprod_(dim=-1).masked_fill_(idx[None, :] < idx[:, None], 0.0)  # i < j: no contribution


def _chunked(a: torch.Tensor, x: torch.Tensor, chunk: int):
    """Pad ``a [..., n]`` (with 1) and ``x [..., n, D]`` (with 0) to whole chunks and split them."""
    n_chunks = -(-a.shape[-1] // chunk)
    pad = n_chunks * chunk - a.shape[-1]
    if pad:
        a = F.pad(a, (0, pad), value=1.0)
        x = F.pad(x, (0, 0, 0, pad))
    return a.unflatten(-1, (n_chunks, chunk)), x.unflatten(-2, (n_chunks, chunk))


def _linear_scan(a: torch.Tensor, x: torch.Tensor, chunk: int) -> torch.Tensor:
    """``h_i = a_i h_{i-1} + x_i`` with ``h_{-1} = 0``.  ``a [..., n]``, ``x [..., n, D]`` -> ``h [..., n, D]``.

    No autograd (used inside ``_Accumulation``). Within chunks of ``chunk`` tokens the scan is a
    ``[C, C] @ [C, D]`` matmul from a zero state; the true state entering each chunk is obtained by
    scanning the chunk-end states (gate = product of the chunk's gates) with this same function.
    """
    n = a.shape[-1]
    if n <= chunk:
        return _decay_matrix_t(a).transpose(-1, -2) @ x
    a_c, x_c = _chunked(a, x, chunk)  # [..., nc, C], [..., nc, C, D]
    h = _decay_matrix_t(a_c).transpose(-1, -2) @ x_c  # scan inside each chunk, zero entering state
    prefix = torch.cumprod(a_c, dim=-1)  # prod of gates from the chunk start to i (inclusive)
    ends = _linear_scan(prefix[..., -1], h[..., -1, :], chunk)  # true state at each chunk end
    carry = F.pad(ends[..., :-1, :], (0, 0, 1, 0))  # state entering each chunk
    h.addcmul_(prefix.unsqueeze(-1), carry.unsqueeze(-2))
    return h.flatten(-3, -2)[..., :n, :]


def _linear_scan_reverse(a: torch.Tensor, y: torch.Tensor, chunk: int) -> torch.Tensor:
    """The adjoint of :func:`_linear_scan`: ``g_i = y_i + a_{i+1} g_{i+1}`` with ``g_n = 0``.

    Same layouts. Inside a chunk ``g = D^T y`` with the same decay matrix; the value at each chunk
    start is a reverse scan over chunks (gate linking chunk c to c+1: ``prod_{m=s_c+1}^{s_{c+1}} a_m``).
    """
    n = a.shape[-1]
    if n <= chunk:
        return _decay_matrix_t(a) @ y
    a_c, y_c = _chunked(a, y, chunk)
    g = _decay_matrix_t(a_c) @ y_c  # inside each chunk, zero state after it
    suffix = F.pad(a_c[..., 1:].flip(-1).cumprod(-1).flip(-1), (0, 1), value=1.0)  # prod_{m=i+1}^{end} a_m
    next_gate = F.pad(a_c[..., 1:, 0], (0, 1))  # a at the first token of the next chunk
    link = suffix[..., :-1, 0] * next_gate[..., :-1]
    starts = _linear_scan_reverse(F.pad(link, (1, 0)), g[..., 0, :], chunk)  # true g at chunk starts
    carry = F.pad(starts[..., 1:, :], (0, 0, 0, 1))  # g at the start of the next chunk
    g.addcmul_((suffix * next_gate.unsqueeze(-1)).unsqueeze(-1), carry.unsqueeze(-2))
    return g.flatten(-3, -2)[..., :n, :]


class _Accumulation(torch.autograd.Function):
    """``(k, v, alpha, omega) -> (k~, v~)`` for both modes, saving only the inputs, the outputs (which
    attention keeps anyway) and z.

    Forward: ``h = scan(a, x)`` on ``x = [w k, w v, w]`` (:func:`_linear_scan` or :func:`_windowed_scan`),
    ``k~ = h_k / z``, ``v~ = h_v / z``.
    Backward: ``dh = [dk~ / z, dv~ / z, -(<dk~, k~> + <dv~, v~>) / z]``; then the scan's adjoint gives
    ``g = dx`` and ``da``: for ``exact`` ``g_i = dh_i + a_{i+1} g_{i+1}`` (the same scan run backwards
    in time) and ``da_i = <g_i, h_{i-1}>`` with ``h = z [k~, v~, 1]``; for ``window``
    :func:`_windowed_scan_backward`. Finally ``dk = w g_k``, ``dv = w g_v``, ``dw = <g, [k, v, 1]>``.
    Exact for alpha in [0, 1] including 0 and 1.
    """

    @staticmethod
    def forward(ctx, k, v, alpha, omega, mode, window, chunk):
        wd = work_dtype(k)
        d_k = k.shape[-1]
        a = alpha.to(wd, copy=True)
        a[..., 0] = 0  # the first token always appends
        w = omega.to(wd)
        x = _scan_input(k, v, w)
        h = _linear_scan(a, x, chunk) if mode == "exact" else _windowed_scan(a, x, window)
        del x
        z = h[..., -1].clone()
        # Contiguous outputs in the input dtypes; saved as returned, so they are shared with whatever
        # else keeps them (attention saves k~, v~ too).
        k_tilde = (h[..., :d_k] / z.unsqueeze(-1)).to(k.dtype)
        v_tilde = (h[..., d_k:-1] / z.unsqueeze(-1)).to(v.dtype)
        del h
        ctx.save_for_backward(k, v, a, w, k_tilde, v_tilde, z)
        ctx.mode, ctx.window, ctx.chunk = mode, window, chunk
        ctx.alpha_dtype, ctx.omega_dtype = alpha.dtype, omega.dtype
        return k_tilde, v_tilde

    @staticmethod
    @once_differentiable
    def backward(ctx, dk_tilde, dv_tilde):
        k, v, a, w, k_tilde, v_tilde, z = ctx.saved_tensors
        d_k, d_v = k.shape[-1], v.shape[-1]
        wd = z.dtype
        k_tilde, v_tilde = k_tilde.to(wd), v_tilde.to(wd)
        dk_tilde = torch.zeros_like(k_tilde) if dk_tilde is None else dk_tilde.to(wd)
        dv_tilde = torch.zeros_like(v_tilde) if dv_tilde is None else dv_tilde.to(wd)
        inv_z = z.reciprocal().unsqueeze(-1)
        dh = torch.empty(*z.shape, d_k + d_v + 1, dtype=wd, device=z.device)
        torch.mul(dk_tilde, inv_z, out=dh[..., :d_k])
        torch.mul(dv_tilde, inv_z, out=dh[..., d_k:-1])
        dh[..., -1] = -((dk_tilde * k_tilde).sum(-1) + (dv_tilde * v_tilde).sum(-1)) * inv_z.squeeze(-1)

        want_alpha = ctx.needs_input_grad[2]
        if ctx.mode == "exact":
            g = _linear_scan_reverse(a, dh, ctx.chunk)
            del dh
        else:
            x = _scan_input(k, v, w) if want_alpha else None
            g, dalpha = _windowed_scan_backward(a, x, dh, ctx.window, want_alpha)
            del dh, x
        g_k, g_v, g_z = g[..., :d_k], g[..., d_k:-1], g[..., -1]

        dk = dv = domega = None
        if want_alpha and ctx.mode == "exact":  # da_i = z_{i-1} (<g_k,i, k~_{i-1}> + <g_v,i, v~_{i-1}> + g_z,i)
            dalpha = torch.zeros_like(a)
            dalpha[..., 1:] = z[..., :-1] * (
                (g_k[..., 1:, :] * k_tilde[..., :-1, :]).sum(-1)
                + (g_v[..., 1:, :] * v_tilde[..., :-1, :]).sum(-1)
                + g_z[..., 1:]
            )
        dalpha = dalpha.to(ctx.alpha_dtype) if want_alpha else None
        if ctx.needs_input_grad[0]:
            dk = (g_k * w.unsqueeze(-1)).to(k.dtype)
        if ctx.needs_input_grad[1]:
            dv = (g_v * w.unsqueeze(-1)).to(v.dtype)
        if ctx.needs_input_grad[3]:
            domega = ((g_k * k).sum(-1) + (g_v * v).sum(-1) + g_z).to(ctx.omega_dtype)
        return dk, dv, dalpha, domega, None, None, None


def _scan_input(k: torch.Tensor, v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x = [w k, w v, w]`` ``[b, h, n, d + d_v + 1]`` in w's dtype (``w [b, h, n]``)."""
    d_k = k.shape[-1]
    x = torch.empty(*k.shape[:-1], d_k + v.shape[-1] + 1, dtype=w.dtype, device=k.device)
    torch.mul(k, w.unsqueeze(-1), out=x[..., :d_k])
    torch.mul(v, w.unsqueeze(-1), out=x[..., d_k:-1])
    x[..., -1] = w
    return x


# ---------------------------------------------------------------------------------------------
# window: the paper's approximation
# ---------------------------------------------------------------------------------------------


def _window_decays(a: torch.Tensor, window: int) -> list[torch.Tensor]:
    """``decay[s] = prod_{m=i-s+1}^{i} a_m`` for positions i in [s, n), ``[..., n - s]``, s < min(window, n)."""
    n = a.shape[-1]
    decay = [torch.ones_like(a)]
    for s in range(1, min(window, n)):
        decay.append(decay[-1][..., 1:] * a[..., 1 : n - s + 1])
    return decay


def _windowed_scan(a: torch.Tensor, x: torch.Tensor, window: int) -> torch.Tensor:
    """``h_i = sum_{s=0}^{w-1} (prod_{m=i-s+1}^{i} a_m) x_{i-s}``, terms with ``i - s < 0`` dropped.

    ``a [..., n]``, ``x [..., n, D]``. No autograd (used inside ``_Accumulation``); memory O(n (D + w)).
    """
    n = a.shape[-1]
    h = x
    for s, decay in enumerate(_window_decays(a, window)[1:], start=1):
        h = h + F.pad(decay.unsqueeze(-1) * x[..., : n - s, :], (0, 0, s, 0))
    return h


def _windowed_scan_backward(a, x, dh, window, want_alpha=True):
    """The gradients ``(dx, da)`` of :func:`_windowed_scan` for the output gradient ``dh [..., n, D]``
    (``da`` None unless ``want_alpha``).

    With ``P_s(i) = prod_{m=i-s+1}^{i} a_m`` and ``w' = min(window, n)``: ``dx_j = sum_{s<w'} P_s(j+s) dh_{j+s}``.
    Splitting each product at a_m gives ``da_m = sum_{r+q <= w'-2} <P_r(m+r) dh_{m+r}, P_q(m-1) x_{m-1-q}>
    = sum_r <T_r(m), H^(w'-2-r)_{m-1}>``, where ``T_r(m) = P_r(m+r) dh_{m+r}`` and ``H^(q)`` is the scan
    with window q + 1 (built up like the forward). O(w) passes over ``[..., n, D]``, no division by a.
    """
    n = a.shape[-1]
    decay = _window_decays(a, window)
    w = len(decay)
    dx = dh.clone()
    for s in range(1, w):  # decay[s][j] = P_s(j + s)
        dx[..., : n - s, :].addcmul_(decay[s].unsqueeze(-1), dh[..., s:, :])
    if not want_alpha:
        return dx, None
    da = torch.zeros_like(a)
    h = x.clone()  # H^(0), grown in place to H^(q)
    for q in range(w - 1):
        r = w - 2 - q  # m in [1, n - r): <T_r(m), H^(q)_{m-1}> = decay[r][m] <dh_{m+r}, H^(q)_{m-1}>
        da[..., 1 : n - r] += decay[r][..., 1:] * (dh[..., r + 1 :, :] * h[..., : n - r - 1, :]).sum(-1)
        if q + 1 < w - 1:
            s = q + 1
            h[..., s:, :].addcmul_(decay[s].unsqueeze(-1), x[..., : n - s, :])
    return dx, da
