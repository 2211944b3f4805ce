"""LESS's attention (Dong et al., 2024): the kept entries' softmax attention plus a low-rank state that
holds every evicted pair (Eq. 3), combined in log space.

For one query head, kept entries ``K_C, V_C`` and the state ``(H, z)`` of the pairs evicted so far:

    out = (sum_kept e^{s_j} v_j + phi_q(q) H) / (sum_kept e^{s_j} + phi_q(q) z),   s_j = q k_j * scale

computed as ``w * sparse + (1 - w) * linear`` with ``sparse`` the softmax attention over the kept
entries (log-sum-exp ``lse``), ``linear = phi_q(q) H / (phi_q(q) z)`` and
``w = sigmoid(lse - log(max(phi_q(q) z, eps)))``: no exponent ever overflows. ``phi_q(q) z`` is clamped
at ``eps`` (1e-6, as the authors' code), so with an empty state (``H = 0``, ``z = 0``) the output is
``w * sparse`` with ``1 - w <= eps * e^{-lse}``: the sparse attention within a relative
``eps / sum_kept e^{s_j}``.

- :func:`less_combine`: the combination, given the sparse output and its log-sum-exp (the inference
  engine's decode step, any layout with matching leading dimensions).
- :func:`less_attention`: the whole-sequence (parallel) form for training and teacher-forced
  evaluation, given what every query sees and what was evicted before it (dense ``n x n`` per head).
- :func:`eviction_masks`: those two masks from an eviction policy's log (when each entry left).
- :func:`phi_q`, :func:`phi_k`: the learned kernels, one MLP per head with the heads' weights batched
  (``dmc_train/models/less/kernels.py`` holds them as parameters; the inference cache as tensors).

Layouts: ``q [b, H, n, d]``, ``k [b, H_kv, n, d]``, ``v [b, H_kv, n, d_v]``, ``phi_q [b, H, n, r]``,
``phi_k [b, H_kv, n, r]``, masks ``[b, H_kv, n, n]`` (query t, entry j); GQA: query head h reads KV head
``h // G`` and its state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

EPS = 1e-6


def _per_head(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W (+ bias)`` with each head's own weights: ``x [h, m, d]`` (heads first, rows ``m``), ``w [h, d, e]``,
    ``bias [h, e]`` -> ``[h, m, e]``: one batched product on the views (no copies)."""
    out = torch.bmm(x, w)
    return out if bias is None else out + bias[:, None]


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """``x [b, h, n, d]`` -> ``[h, b * n, d]`` (a view when ``b`` or ``n`` is 1, as at decode; else a copy)."""
    return x.transpose(0, 1).reshape(x.shape[1], -1, x.shape[-1])


def _mlp(x, w1, b1, w2, b2, dropout: float = 0.0, training: bool = False):
    """``s(s(x W1 + b1) W2 + b2)`` per head: ``x [h, m, d]`` (heads first), ``w1 [h, d, e]``, ``b1 [h, e]``,
    ``w2 [h, e, r]``, ``b2 [h, r]`` -> ``[h, m, r]``."""
    hidden = F.dropout(F.gelu(_per_head(x, w1, b1)), dropout, training)
    return F.gelu(_per_head(hidden, w2, b2))


def _batch_first(y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``y [h, b * n, r]`` -> ``[b, h, n, r]`` with ``like [b, h, n, d]``'s ``b, h, n`` (a view)."""
    b, h, n, _ = like.shape
    return y.view(h, b, n, y.shape[-1]).transpose(0, 1)


def _fp32(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The kernels' weights in fp32 (differentiable casts: a bf16 / fp16 model's weights get their gradients)."""
    return {name: t.float() for name, t in w.items()}


def phi_q(q: torch.Tensor, w: dict[str, torch.Tensor], dropout: float = 0.0, training: bool = False):
    """``|s(s(q W_q1 + b_q1) W_q2 + b_q2)|``: ``q [b, H, n, d]`` -> ``[b, H, n, r]`` (fp32, whatever the dtypes of
    ``q`` and the weights)."""
    w = _fp32(w)
    features = _mlp(_heads_first(q.float()), w["q1"], w["q1_bias"], w["q2"], w["q2_bias"], dropout, training)
    return _batch_first(features.abs(), q)


def phi_k(k: torch.Tensor, w: dict[str, torch.Tensor], dropout: float = 0.0, training: bool = False):
    """``|k~ + (k~ W_int) * D2|`` with ``k~ = |D1| * s(s(k W_k1 + b_k1) W_k2 + b_k2)``: ``k [b, H_kv, n, d]`` ->
    ``[b, H_kv, n, r]`` (fp32, whatever the dtypes of ``k`` and the weights)."""
    w = _fp32(w)
    k_t = w["d1"].abs()[:, None] * _mlp(_heads_first(k.float()), w["k1"], w["k1_bias"], w["k2"], w["k2_bias"],
                                        dropout, training)  # [H_kv, b * n, r]
    return _batch_first((k_t + _per_head(k_t, w["k_int"]) * w["d2"][:, None]).abs(), k)


def less_combine(sparse: torch.Tensor, lse: torch.Tensor, lin_num: torch.Tensor, lin_den: torch.Tensor,
                 eps: float = EPS) -> torch.Tensor:
    """``sparse [..., d_v]`` with ``lse [...]``, the state's numerator ``phi_q H [..., d_v]`` and denominator
    ``phi_q z [...]`` (all of one dtype) -> the LESS output ``[..., d_v]`` (module docstring)."""
    den = lin_den.clamp(min=eps)
    w = torch.sigmoid(lse - den.log())[..., None]
    return torch.lerp(lin_num / den[..., None], sparse, w)  # w * sparse + (1 - w) * linear


def eviction_masks(evicted_at: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``evicted_at [b, H_kv, n]`` (the query position from which entry j is no longer kept; -1: never)
    -> ``(visible, evicted)``, each ``[b, H_kv, n, n]`` bool: query t attends to entry j / entry j is in
    the state when query t attends."""
    n = evicted_at.shape[-1]
    t = torch.arange(n, device=evicted_at.device)[:, None]
    ev = evicted_at[:, :, None, :]
    causal = torch.arange(n, device=evicted_at.device)[None, :] <= t
    return causal & ((ev < 0) | (ev > t)), (ev >= 0) & (ev <= t)


def less_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, evicted: torch.Tensor,
                   phi_q: torch.Tensor, phi_k: torch.Tensor, scale: float, eps: float = EPS) -> torch.Tensor:
    """LESS attention of every query of a sequence (module docstring): ``visible[t, j]`` the kept entries
    query t attends to, ``evicted[t, j]`` the pairs in the state when query t attends. Differentiable in
    ``phi_q`` and ``phi_k`` (and q, k, v); computed in fp32 (fp64 stays fp64); returns ``[b, H, n, d_v]`` in
    q's dtype. GQA without copies of the KV side: the G query heads of a KV head are its rows
    ``[b, H_kv, G * n, .]`` (query head h = KV head h // G), the masks broadcast over G."""
    b, h, n, _ = q.shape
    hk = k.shape[1]
    g = h // hk
    wd = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf, kf, vf = q.to(wd).reshape(b, hk, g * n, -1), k.to(wd), v.to(wd)
    visible, evicted = visible[:, :, None], evicted[:, :, None]  # [b, H_kv, 1, n, n]
    logits = (qf @ kf.transpose(2, 3) * scale).view(b, hk, g, n, n).masked_fill(~visible, float("-inf"))
    lse = logits.logsumexp(-1).view(b, hk, g * n)
    sparse = torch.softmax(logits, dim=-1).view(b, hk, g * n, n) @ vf
    phi = phi_q.to(wd).reshape(b, hk, g * n, -1) @ phi_k.to(wd).transpose(2, 3)
    weights = (phi.view(b, hk, g, n, n) * evicted).view(b, hk, g * n, n)  # [b, H_kv, G * n, n]
    out = less_combine(sparse, lse, weights @ vf, weights.sum(-1), eps)  # [b, H_kv, G * n, d_v]
    return out.view(b, h, n, -1).to(q.dtype)
