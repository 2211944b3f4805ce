"""DMC training attention (Nawrot et al. 2024, Fig. 3 and App. H) in O(n) memory.

Query i attends to the partially accumulated states k~_j, v~_j (see ``accumulation.py``) with the
additive bias

    bias[i, j] = log(1 - alpha_{j+1})   for j < i    (state j survives iff token j+1 appended)
               = 0                      for j = i    (own current state, always visible)
               = -inf                   for j > i    (future)

so with hard alpha in {0, 1} it is exactly the inference-time visibility of Algorithm 1.

Implementations behind :func:`dmc_attention` (both custom autograd functions that save only q, k~,
v~, alpha, the output and the row log-sum-exp, never an n x n tensor):

- ``"fused_cpu"`` (default on CPU, ``_attention_cpu.py``): PyTorch's fused CPU flash-attention
  kernels on keys shifted by one position with the bias in one channel, plus the diagonal merged
  through log-sum-exps. Pass DMC's decision channel as ``free_channel`` to keep the head size d.
- ``"blocked"`` (any device, ``_attention_blocked.py``): query blocks x key ranges with an online
  softmax in plain tensor ops.

Gradient w.r.t. alpha: with the gate ``g_j = 1 - alpha_{j+1}`` the unnormalised weight of (i, j < i)
is ``exp(s_ij) g_j``, smooth in alpha on all of [0, 1]; both implementations return the exact
(one-sided) derivative also at alpha = 1, where ``d log(1 - alpha)`` would be ``0 * inf``.
:func:`dense_dmc_attention` (the full ``[b, h_q, n, n]`` bias + softmax, the test reference) returns 0
there instead.

GQA: ``h_q = G h_kv``; query head j uses KV head ``j // G``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._attention_blocked import BlockedDMCAttention, diagonal_range
from ._attention_cpu import FusedCPUDMCAttention, fused_cpu_available
from ._checks import check_gqa, check_kv, check_per_head, check_positive_int, work_dtype

IMPLS = ("auto", "fused_cpu", "blocked")


def dmc_attention(
    q: torch.Tensor,
    k_tilde: torch.Tensor,
    v_tilde: torch.Tensor,
    alpha: torch.Tensor,
    scale: float | None = None,
    block: int = 128,
    key_block: int = 512,
    free_channel: int | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """DMC training attention with the Fig. 3 bias, without any n x n tensor.

    Args:
        q: queries ``[b, h_q, n, d]`` (h_q = G * h_kv).
        k_tilde: partially accumulated keys ``[b, h_kv, n, d]``.
        v_tilde: partially accumulated values ``[b, h_kv, n, d_v]``.
        alpha: accumulate *probabilities* ``[b, h_kv, n]`` in [0, 1] (not logits); the bias of key
            j is ``log(1 - alpha[..., j + 1])`` (-inf for alpha = 1). ``alpha[..., 0]`` is unused.
        scale: score scale, default ``1 / sqrt(d)``.
        block, key_block: query rows per block and key columns per step (``"blocked"`` only).
        free_channel: a channel of q / k_tilde that takes no part in attention (DMC's decision
            channel): it is treated as 0 whatever it holds, and gets gradient 0. ``"fused_cpu"``
            carries the bias in it instead of appending a channel (faster).
        impl: ``"auto"`` (``"fused_cpu"`` on CPU, else ``"blocked"``), ``"fused_cpu"`` or ``"blocked"``.

    Returns:
        ``out [b, h_q, n, d_v]`` in the dtype of ``q``; computed in float32 (float64 stays float64).
        Differentiable w.r.t. q, k_tilde, v_tilde and alpha.
    """
    check_kv(k_tilde, v_tilde, "k_tilde", "v_tilde")
    check_gqa(q, k_tilde, "k_tilde")
    check_per_head("alpha", alpha, k_tilde, "k_tilde")
    check_positive_int("block", block)
    check_positive_int("key_block", key_block)
    d = q.shape[-1]
    if free_channel is not None and (
        isinstance(free_channel, bool) or not isinstance(free_channel, int) or not 0 <= free_channel < d
    ):
        raise ValueError(f"free_channel must be None or a channel index in [0, {d}), got {free_channel!r}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    on_cpu = q.device.type == "cpu"
    if impl == "fused_cpu" and not (on_cpu and fused_cpu_available()):
        raise ValueError(f"impl='fused_cpu' needs CPU tensors and torch's fused CPU flash attention (got {q.device})")
    # CUDA: FlexAttention (with backward) or a Triton kernel from kernels/ is dispatched here.
    if impl == "fused_cpu" or (impl == "auto" and on_cpu and fused_cpu_available()):
        return FusedCPUDMCAttention.apply(q, k_tilde, v_tilde, alpha, float(scale), free_channel)
    if free_channel is not None:
        q = q.index_fill(-1, torch.tensor([free_channel], device=q.device), 0)
    return BlockedDMCAttention.apply(q, k_tilde, v_tilde, alpha, float(scale), block, key_block)


# ---------------------------------------------------------------------------------------------
# Dense reference (Fig. 3 literally)
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
    """Reference for :func:`dmc_attention`: full ``[b, h_q, n, n]`` bias + softmax under autograd.

    Same layouts and semantics; k~ / v~ / alpha are repeated over the query heads of each group.
    At alpha = 1 exactly its alpha-gradient is 0 (:func:`dmc_attention` gives the one-sided derivative).
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
