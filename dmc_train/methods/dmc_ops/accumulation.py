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
  chunk comes from the same scan applied recursively to the chunk ends. A custom autograd function
  saves only ``a`` and ``h`` and runs the adjoint (the same scan backwards in time) in backward.
  Memory O(n (d + C)) per head.
- ``window``: the paper's approximation (Sec. 3.3): position i runs the recurrence only over its
  last ``w`` tokens, ``h_i = sum_{j=max(0, i-w+1)}^{i} (prod_{m=j+1}^{i} a_m) x_j``; ``w`` shifted
  multiply-adds under plain autograd.

``reference_partial_accumulation`` is the token-by-token loop both are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ._checks import check_kv, check_per_head, check_positive_int, work_dtype

MODES = ("exact", "window")


# ---------------------------------------------------------------------------------------------
# Public op
# ---------------------------------------------------------------------------------------------


def partial_accumulation(
    k: torch.Tensor,
    v: torch.Tensor,
    alpha: torch.Tensor,
    omega: torch.Tensor,
    mode: str = "exact",
    window: int = 12,
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partially accumulated keys and values of Eq. 9.

    Args:
        k: keys ``[b, h_kv, n, d]`` (after RoPE, decision channel zeroed by the caller).
        v: values ``[b, h_kv, n, d_v]``.
        alpha: accumulate decisions ``[b, h_kv, n]`` in [0, 1]; ``alpha[..., 0]`` is ignored (0).
        omega: importance weights ``[b, h_kv, n]``, > 0 (z must not vanish).
        mode: ``"exact"`` (full recurrence) or ``"window"`` (each position looks back ``window`` tokens).
        window: window length ``w >= 1`` for ``mode="window"``.
        chunk: scan chunk length for ``mode="exact"`` (speed/memory knob only, result independent).

    Returns:
        ``(k_tilde [b, h_kv, n, d], v_tilde [b, h_kv, n, d_v])`` in the dtypes of ``k`` and ``v``;
        computed in float32 (float64 if the input is float64). Differentiable w.r.t. all four inputs.
    """
    check_kv(k, v)
    check_per_head("alpha", alpha, k)
    check_per_head("omega", omega, k)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    check_positive_int("window", window)
    check_positive_int("chunk", chunk)
    # CUDA: a Triton kernel from kernels/ is dispatched here once it exists; CPU uses PyTorch.
    return _partial_accumulation_torch(k, v, alpha, omega, mode, window, chunk)


def _partial_accumulation_torch(k, v, alpha, omega, mode, window, chunk):
    wd = work_dtype(k)
    a = F.pad(alpha[..., 1:].to(wd), (1, 0))  # alpha_0 := 0, so d/d alpha_0 = 0 as well
    w = omega.to(wd).unsqueeze(-1)
    x = torch.cat([w * k.to(wd), w * v.to(wd), w], dim=-1)  # [b, h, n, d + d_v + 1]
    if mode == "exact":
        h = _ScanFunction.apply(a, x, chunk)
    else:
        h = _windowed_scan(a, x, window)
    d_k, d_v = k.shape[-1], v.shape[-1]
    z = h[..., -1:]
    k_tilde = h[..., :d_k] / z
    v_tilde = h[..., d_k : d_k + d_v] / z
    return k_tilde.to(k.dtype), v_tilde.to(v.dtype)


# ---------------------------------------------------------------------------------------------
# exact: chunked parallel scan h_i = a_i h_{i-1} + x_i
# ---------------------------------------------------------------------------------------------


def _decay_matrix(a: torch.Tensor) -> torch.Tensor:
    """``a [..., C] -> D [..., C, C]`` with ``D[i, j] = prod_{m=j+1}^{i} a_m`` for i >= j, else 0.

    Built as a cumulative product along i of ``a_i`` masked to 1 for ``i <= j``: exact for a in [0, 1]
    including hard zeros (no log 0) and ones.
    """
    C = a.shape[-1]
    idx = torch.arange(C, device=a.device)
    after = idx[None, :] > idx[:, None]  # [j, i]: i > j
    # Row j of dt holds column j of D, so the cumprod runs along the contiguous last dim.
    dt = torch.where(after, a.unsqueeze(-2), torch.ones((), dtype=a.dtype, device=a.device))
    dt = torch.cumprod(dt, dim=-1)
    dt = dt.masked_fill(idx[None, :] < idx[:, None], 0.0)  # i < j: future, no contribution
    return dt.transpose(-1, -2)


def _linear_scan(a: torch.Tensor, x: torch.Tensor, chunk: int) -> torch.Tensor:
    """``h_i = a_i h_{i-1} + x_i`` with ``h_{-1} = 0``.  ``a [..., n]``, ``x [..., n, D]`` -> ``h [..., n, D]``.

    No autograd (used inside ``_ScanFunction``). Within chunks of ``chunk`` tokens the scan is a
    ``[C, C] @ [C, D]`` matmul from a zero state; the true state entering each chunk is obtained by
    scanning the chunk-end states (gate = product of the chunk's gates) with this same function.
    """
    n = a.shape[-1]
    if n <= chunk:
        return _decay_matrix(a) @ x
    n_chunks = -(-n // chunk)
    pad = n_chunks * chunk - n
    if pad:
        a = F.pad(a, (0, pad), value=1.0)
        x = F.pad(x, (0, 0, 0, pad))
    a_c = a.unflatten(-1, (n_chunks, chunk))  # [..., nc, C]
    x_c = x.unflatten(-2, (n_chunks, chunk))  # [..., nc, C, D]
    h = _decay_matrix(a_c) @ x_c  # scan inside each chunk, zero entering state
    prefix = torch.cumprod(a_c, dim=-1)  # prod of gates from the chunk start to i (inclusive)
    ends = _linear_scan(prefix[..., -1], h[..., -1, :], chunk)  # true state at each chunk end
    carry = F.pad(ends[..., :-1, :], (0, 0, 1, 0))  # state entering each chunk
    h.add_(prefix.unsqueeze(-1) * carry.unsqueeze(-2))
    return h.flatten(-3, -2)[..., :n, :]


class _ScanFunction(torch.autograd.Function):
    """Autograd for ``h = _linear_scan(a, x)`` saving only ``a`` and ``h``.

    Adjoint: ``g_i = dh_i + a_{i+1} g_{i+1}`` (the same scan run backwards in time), then
    ``dx_i = g_i`` and ``da_i = <g_i, h_{i-1}>``. Exact for a in [0, 1] including 0 and 1.
    """

    @staticmethod
    def forward(ctx, a, x, chunk):
        h = _linear_scan(a, x, chunk)
        ctx.save_for_backward(a, h)
        ctx.chunk = chunk
        return h

    @staticmethod
    @once_differentiable
    def backward(ctx, dh):
        a, h = ctx.saved_tensors
        a_next = F.pad(a[..., 1:], (0, 1))  # a_{i+1}; nothing after the last token
        g = _linear_scan(a_next.flip(-1), dh.flip(-2), ctx.chunk).flip(-2)
        da = None
        if ctx.needs_input_grad[0]:
            da = torch.zeros_like(a)
            da[..., 1:] = (g[..., 1:, :] * h[..., :-1, :]).sum(-1)
        return da, g, None


# ---------------------------------------------------------------------------------------------
# window: the paper's approximation
# ---------------------------------------------------------------------------------------------


def _windowed_scan(a: torch.Tensor, x: torch.Tensor, window: int) -> torch.Tensor:
    """``h_i = sum_{s=0}^{w-1} (prod_{m=i-s+1}^{i} a_m) x_{i-s}``, terms with ``i - s < 0`` dropped.

    ``a [..., n]``, ``x [..., n, D]``. Plain autograd; memory O(n (D + w)).
    """
    n = a.shape[-1]
    h = x
    decay = torch.ones_like(a)  # offset s = 0; below, decay covers positions i in [s, n)
    for s in range(1, min(window, n)):
        decay = decay[..., 1:] * a[..., 1 : n - s + 1]  # prod_{m=i-s+1}^{i} a_m for i in [s, n)
        h = h + F.pad(decay.unsqueeze(-1) * x[..., : n - s, :], (0, 0, s, 0))
    return h


# ---------------------------------------------------------------------------------------------
# Naive reference (token loop, autograd)
# ---------------------------------------------------------------------------------------------


def reference_partial_accumulation(
    k: torch.Tensor,
    v: torch.Tensor,
    alpha: torch.Tensor,
    omega: torch.Tensor,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 9 by a Python loop over tokens, literally as written (``window=None``: exact).

    With ``window=w`` each position restarts the recurrence ``w - 1`` tokens back. Layouts as in
    :func:`partial_accumulation`; computes in the input dtype. Tests only.
    """
    n = k.shape[2]
    k_out, v_out = [], []
    for i in range(n):
        start = 0 if window is None else max(0, i - window + 1)
        z, num_k, num_v = None, None, None
        for j in range(start, i + 1):
            w_j = omega[..., j, None]
            if z is None:  # first token of the (possibly windowed) recurrence
                z, num_k, num_v = w_j, w_j * k[..., j, :], w_j * v[..., j, :]
            else:
                a_j = alpha[..., j, None]
                z = a_j * z + w_j
                num_k = a_j * num_k + w_j * k[..., j, :]
                num_v = a_j * num_v + w_j * v[..., j, :]
        k_out.append(num_k / z)
        v_out.append(num_v / z)
    return torch.stack(k_out, dim=2), torch.stack(v_out, dim=2)
