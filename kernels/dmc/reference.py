"""The plain forms of the DMC ops that the tests trust (Nawrot et al. 2024). Tests and small n only.

Layouts: q ``[b, h_q, n, d]``; k, v, k~, v~ ``[b, h_kv, n, d]`` (v: ``d_v``); alpha, omega
``[b, h_kv, n]``. GQA: ``h_q = G h_kv``, query head j reads KV head ``j // G``.

- :func:`reference_partial_accumulation`: Eq. 9 by a Python loop over tokens (reference for
  :func:`kernels.dmc.partial_accumulation`).
- :func:`dmc_attention_bias` / :func:`dense_dmc_attention`: the Fig. 3 bias as a full ``[b, h, n, n]``
  tensor and softmax attention with it (reference for :func:`kernels.dmc.dmc_attention`):

      bias[i, j] = log(1 - alpha_{j+1})   for j < i    (state j survives iff token j+1 appended)
                 = 0                      for j = i    (own current state, always visible)
                 = -inf                   for j > i    (future)

  so with hard alpha in {0, 1} it is exactly the inference-time visibility of Algorithm 1.
- :func:`simulate_dmc_inference` / :class:`DMCHeadCache`: Algorithm 1 token by token with an
  explicit growing cache per head.
- :func:`rotate_half_rope` / :func:`reference_pre_rope_dmc_attention`: the ``rope_order=pre`` model
  (raw keys accumulated, the running average k~_t rotated at the position of t), composed of the
  references above.

Which cache does the query at step t attend to in :func:`simulate_dmc_inference`? The cache *after*
token t's update:

    cache_t = [ k~_j for j < t with alpha_{j+1} = 0 ]  (closed slots: segment j ended because j+1 appended)
            + [ k~_t ]                                   (open slot: t's own running segment)

where k~ is Eq. 9 with hard alpha. This is exactly the training visibility of Fig. 3 (query i sees
state j < i iff alpha_{j+1} = 0, its own state always), so training with hard decisions and this
simulation give the same attention outputs. It is also what a decoder does: update the cache with
(k_t, v_t), then attend with q_t over it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._checks import check_gqa, check_kv, check_per_head, work_dtype
from .attention_blocked import diagonal_range

# ---------------------------------------------------------------------------------------------
# Partial accumulation (Eq. 9): token loop
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
    :func:`kernels.dmc.partial_accumulation`; computes in the input dtype. Tests only.
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


# ---------------------------------------------------------------------------------------------
# Training attention (Fig. 3 literally): dense n x n bias
# ---------------------------------------------------------------------------------------------


def dmc_attention_bias(alpha: torch.Tensor) -> torch.Tensor:
    """The Fig. 3 additive bias ``[b, h, n, n]`` for ``alpha [b, h, n]`` (n x n: tests and small n).

    ``log(1 - alpha)`` is computed so that alpha = 1 gives -inf with a zero (not NaN) gradient.
    """
    n = alpha.shape[-1]
    a_next = alpha[..., 1:]
    keep = a_next < 1
    safe = torch.where(keep, a_next, torch.zeros_like(a_next))
    per_key = torch.where(keep, torch.log1p(-safe), torch.full_like(a_next, -math.inf))
    per_key = F.pad(per_key, (0, 1))
    return diagonal_range(per_key, 0, n, 0, n, 0.0, -math.inf)


def dense_dmc_attention(
    q: torch.Tensor,
    k_tilde: torch.Tensor,
    v_tilde: torch.Tensor,
    alpha: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Reference for :func:`kernels.dmc.dmc_attention`: full ``[b, h_q, n, n]`` bias + softmax under autograd.

    Same layouts and semantics; k~ / v~ / alpha are repeated over the query heads of each group.
    At alpha = 1 exactly its alpha-gradient is 0 (:func:`kernels.dmc.dmc_attention` gives the one-sided
    derivative).
    """
    check_kv(k_tilde, v_tilde, "k_tilde", "v_tilde")
    G = check_gqa(q, k_tilde, "k_tilde")
    check_per_head("alpha", alpha, k_tilde, "k_tilde")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    wd = work_dtype(q)
    k = k_tilde.to(wd).repeat_interleave(G, dim=1)
    v = v_tilde.to(wd).repeat_interleave(G, dim=1)
    bias = dmc_attention_bias(alpha.to(wd)).repeat_interleave(G, dim=1)
    scores = (q.to(wd) @ k.transpose(-1, -2)) * scale + bias
    return (torch.softmax(scores, dim=-1) @ v).to(q.dtype)


# ---------------------------------------------------------------------------------------------
# Inference (Algorithm 1) token by token
# ---------------------------------------------------------------------------------------------


class DMCHeadCache:
    """The KV cache of one (sequence, KV head) under Algorithm 1.

    Slots hold normalised keys/values ``[d]`` / ``[d_v]``; ``z`` is the running importance sum of the
    open (last) slot.
    """

    def __init__(self):
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.z: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.keys)

    def update(self, k: torch.Tensor, v: torch.Tensor, alpha: float, omega: torch.Tensor) -> None:
        """Algorithm 1 for one token: ``alpha == 1`` accumulates into the last slot, otherwise (and
        always for the first token) appends. ``k [d]``, ``v [d_v]``, ``omega`` a scalar tensor."""
        if alpha == 1 and self.keys:  # ACCUMULATE: weighted average with the open slot
            z_prev, self.z = self.z, self.z + omega
            self.keys[-1] = (self.keys[-1] * z_prev + k * omega) / self.z
            self.values[-1] = (self.values[-1] * z_prev + v * omega) / self.z
        else:  # APPEND: open a new segment
            self.z = omega
            self.keys.append(k)
            self.values.append(v)

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(K [l, d], V [l, d_v])`` of the current cache."""
        return torch.stack(self.keys), torch.stack(self.values)


def simulate_dmc_inference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    alpha_hard: torch.Tensor,
    omega: torch.Tensor,
    scale: float | None = None,
    return_caches: bool = False,
):
    """Run Algorithm 1 token by token; query t attends (softmax, ``scale``) over the cache *after*
    token t's update: the closed slots (states j < t with ``alpha_{j+1} = 0``) plus the open slot
    (t's own running segment), i.e. the training visibility of Fig. 3.

    Args:
        q: ``[b, h_q, n, d]``; query head j reads KV head ``j // (h_q // h_kv)``.
        k: raw keys ``[b, h_kv, n, d]`` (not accumulated); v: ``[b, h_kv, n, d_v]``.
        alpha_hard: decisions ``[b, h_kv, n]`` in {0, 1}; ``alpha_hard[..., 0]`` is ignored (append).
        omega: importances ``[b, h_kv, n]`` > 0.
        scale: score scale, default ``1 / sqrt(d)``.
        return_caches: also return the final ``caches[b][h_kv]`` (:class:`DMCHeadCache`).

    Returns:
        ``(out [b, h_q, n, d_v], cache_lengths [b, h_kv, n])`` (+ caches): ``cache_lengths[..., t]``
        is the number of slots after token t's update. Computed in float64, ``out`` in q's dtype.
    """
    check_kv(k, v)
    G = check_gqa(q, k)
    check_per_head("alpha_hard", alpha_hard, k)
    check_per_head("omega", omega, k)
    if not bool(((alpha_hard == 0) | (alpha_hard == 1)).all()):
        raise ValueError("alpha_hard must contain only 0 and 1 (hard decisions)")
    b, hq, n, d = q.shape
    hk, dv = k.shape[1], v.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    q64, k64, v64, w64 = (t.detach().to(torch.float64) for t in (q, k, v, omega))
    out = torch.zeros(b, hq, n, dv, dtype=torch.float64)
    lengths = torch.zeros(b, hk, n, dtype=torch.long)
    caches = [[DMCHeadCache() for _ in range(hk)] for _ in range(b)]
    for bi in range(b):
        for h in range(hk):
            cache = caches[bi][h]
            for t in range(n):
                cache.update(k64[bi, h, t], v64[bi, h, t], float(alpha_hard[bi, h, t]), w64[bi, h, t])
                lengths[bi, h, t] = len(cache)
                keys, values = cache.stacked()
                for j in range(h * G, (h + 1) * G):
                    weights = torch.softmax(keys @ q64[bi, j, t] * scale, dim=0)
                    out[bi, j, t] = weights @ values
    out = out.to(q.dtype)
    if return_caches:
        return out, lengths, caches
    return out, lengths


# ---------------------------------------------------------------------------------------------
# RoPE order "pre": accumulate raw keys, rotate the accumulated key at its newest token
# ---------------------------------------------------------------------------------------------


def rotate_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the rotate-half convention (Llama; megatron-core with ``rotary_interleaved=False``):
    ``x * cos + rotate_half(x) * sin`` with ``rotate_half([x1, x2]) = [-x2, x1]``.

    ``x [b, h, n, d]``; ``cos`` / ``sin`` ``[n, d]`` (position t's angles repeated over both halves), or any
    shapes that broadcast to ``x``'s.
    """
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def reference_pre_rope_dmc_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    alpha: torch.Tensor,
    omega: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    scale: float | None = None,
    window: int | None = None,
    free_channel: int | None = None,
) -> torch.Tensor:
    """Fig. 3 attention of the ``rope_order=pre`` model, from raw (un-rotated) q, k, v.

    Keys and values are accumulated with Eq. 9 (:func:`reference_partial_accumulation`) *before*
    RoPE; the accumulated key ``k~_t`` is then rotated at position t (the newest token of its
    segment), every query at its own position, and :func:`dense_dmc_attention` attends with the
    Fig. 3 bias. ``alpha`` may be hard or soft. With hard decisions a closed slot is the raw average
    of its segment rotated at the segment's last token, the open slot the raw running average
    rotated at the current token.

    Args:
        q: ``[b, h_q, n, d]``, k: ``[b, h_kv, n, d]``, v: ``[b, h_kv, n, d_v]``, all raw (the decision
            channel already zeroed by the caller, as in training).
        alpha, omega: ``[b, h_kv, n]``.
        cos, sin: ``[n, d]`` RoPE angles of positions 0..n-1 (:func:`rotate_half_rope`).
        scale: score scale, default ``1 / sqrt(d)``; window: as :func:`reference_partial_accumulation`.
        free_channel: the decision channel, ignored by the scores as in training (RoPE may have rotated
            something into it); None: every channel counts (fixed pooling).

    Returns:
        ``[b, h_q, n, d_v]`` in q's dtype. Tests and small n only.
    """
    k_tilde, v_tilde = reference_partial_accumulation(k, v, alpha, omega, window=window)
    q_rot = rotate_half_rope(q, cos, sin)
    if free_channel is not None:
        q_rot = q_rot.clone()
        q_rot[..., free_channel] = 0
    return dense_dmc_attention(q_rot, rotate_half_rope(k_tilde, cos, sin), v_tilde, alpha, scale=scale)
