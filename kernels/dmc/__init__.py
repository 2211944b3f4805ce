"""DMC tensor ops (Dynamic Memory Compression, Nawrot et al. 2024), beside their references.

Layouts: q ``[b, h_q, n, d]``; k, v and the accumulated k~, v~ ``[b, h_kv, n, d]`` (v may have its
own head size ``d_v``); alpha, omega ``[b, h_kv, n]`` (one decision / importance per KV head and
token). GQA: ``h_q = G h_kv``, query head j reads KV head ``j // G``.

Public ops (each validates its inputs, then dispatches once):

- :func:`partial_accumulation`: Eq. 9, ``exact`` (chunked parallel scan) or ``window``.
- :func:`dmc_attention`: the Fig. 3 bias in O(n) memory, custom autograd.

Implementations. Accumulation, by the backend :mod:`kernels.backend` chooses for the tensors' device (the table
``OPS`` below): ``triton``'s kernels (``accumulation_triton.py``: CUDA tensors when Triton is installed; CPU tensors
under ``TRITON_INTERPRET=1`` with ``DMC_KERNELS=triton``), imported on first use (Triton decides compiled vs
interpreted when a kernel is defined); the PyTorch scan (``accumulation.py``) for every other backend. Attention:
PyTorch's own kernels on every backend, chosen by ``_attention_impl``: the fused flash kernels
(``attention_fused.py``: CPU flash on CPU; cuDNN / FlashAttention-2 / the memory-efficient kernel on CUDA) wherever
they take the inputs, else the portable blocked version (``attention_blocked.py``). A backend adds an accumulation
by a row in ``OPS`` (``docs/DESIGN.md``, "Adding a backend").

References (``reference.py``, re-exported here): :func:`reference_partial_accumulation` (token loop),
:func:`dense_dmc_attention` / :func:`dmc_attention_bias` (full n x n bias),
:func:`simulate_dmc_inference` / :class:`DMCHeadCache` (Algorithm 1 token by token),
:func:`reference_pre_rope_dmc_attention` / :func:`rotate_half_rope` (the ``rope_order=pre`` model).

This package depends on torch only (it sits below ``dmc_train``).
"""

from __future__ import annotations

import math

import torch

from kernels.backend import Impl, Op, lazy

from ._checks import check_gqa, check_kv, check_per_head, check_positive_int
from .accumulation import partial_accumulation_torch
from .attention_blocked import BlockedDMCAttention
from .attention_fused import FusedDMCAttention, fused_ops
from .reference import (
    DMCHeadCache,
    dense_dmc_attention,
    dmc_attention_bias,
    reference_partial_accumulation,
    reference_pre_rope_dmc_attention,
    rotate_half_rope,
    simulate_dmc_inference,
)

MODES = ("exact", "window")
IMPLS = ("auto", "fused", "blocked")

__all__ = [
    "IMPLS",
    "MODES",
    "DMCHeadCache",
    "dense_dmc_attention",
    "dmc_attention",
    "dmc_attention_bias",
    "partial_accumulation",
    "reference_partial_accumulation",
    "reference_pre_rope_dmc_attention",
    "rotate_half_rope",
    "simulate_dmc_inference",
]


# ---------------------------------------------------------------------------------------------
# Which backend takes which inputs (kernels.backend), and dmc_attention's choice of PyTorch kernels
# ---------------------------------------------------------------------------------------------

OPS = {
    "partial_accumulation": Op({
        "triton": Impl(lazy("kernels.dmc.accumulation_triton", "partial_accumulation_triton")),
        "torch": Impl(partial_accumulation_torch),
    }),
}


def _attention_impl(device: torch.device, dtype: torch.dtype, impl: str) -> str:
    """Resolve ``impl`` of :func:`dmc_attention` for tensors on ``device`` of ``dtype`` to ``"fused"`` or
    ``"blocked"``. ``"auto"``: the fused kernels where they take the inputs
    (:func:`~.attention_fused.fused_ops`), else the portable blocked version."""
    if impl == "fused" and fused_ops(device, dtype) is None:
        raise ValueError(f"impl='fused' has no fused attention kernel for {dtype} tensors on {device}")
    if impl == "auto":
        return "fused" if fused_ops(device, dtype) is not None else "blocked"
    return impl


# ---------------------------------------------------------------------------------------------
# Public ops
# ---------------------------------------------------------------------------------------------


def partial_accumulation(
    k: torch.Tensor,
    v: torch.Tensor,
    alpha: torch.Tensor,
    omega: torch.Tensor,
    mode: str = "exact",
    window: int = 12,
    chunk: int = 32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partially accumulated keys and values of Eq. 9 (see ``accumulation.py``).

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
    return OPS["partial_accumulation"](k, v, alpha, omega, mode, window, chunk)


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

    Query i attends to the partially accumulated states k~_j, v~_j with the additive bias
    ``log(1 - alpha_{j+1})`` for j < i, 0 for j = i and -inf for j > i (see ``reference.py``; with
    hard alpha this is the inference-time visibility of Algorithm 1).

    Implementations (custom autograd functions that save only q, k~, v~, alpha, the output and the
    row log-sum-exp, never an n x n tensor):

    - ``"fused"`` (``attention_fused.py``): PyTorch's fused flash-attention kernels (CPU flash; on CUDA
      cuDNN's on Hopper and newer, FlashAttention-2 before, the memory-efficient kernel for fp32) on keys
      shifted by one position with the bias in one channel, plus the diagonal merged through log-sum-exps.
      Pass DMC's decision channel as ``free_channel`` to keep the head size d.
    - ``"blocked"`` (any device, ``attention_blocked.py``): query blocks x key ranges with an online
      softmax in plain tensor ops.

    Gradient w.r.t. alpha: with the gate ``g_j = 1 - alpha_{j+1}`` the unnormalised weight of
    (i, j < i) is ``exp(s_ij) g_j``, smooth in alpha on all of [0, 1]; both implementations return the
    exact (one-sided) derivative also at alpha = 1, where ``d log(1 - alpha)`` would be ``0 * inf``.
    :func:`dense_dmc_attention` (the full ``[b, h_q, n, n]`` bias + softmax, the test reference)
    returns 0 there instead.

    Args:
        q: queries ``[b, h_q, n, d]`` (h_q = G * h_kv; query head j uses KV head ``j // G``).
        k_tilde: partially accumulated keys ``[b, h_kv, n, d]``.
        v_tilde: partially accumulated values ``[b, h_kv, n, d_v]``.
        alpha: accumulate *probabilities* ``[b, h_kv, n]`` in [0, 1] (not logits); the bias of key
            j is ``log(1 - alpha[..., j + 1])`` (-inf for alpha = 1). ``alpha[..., 0]`` is unused.
        scale: score scale, default ``1 / sqrt(d)``.
        block, key_block: query rows per block and key columns per step (``"blocked"`` only).
        free_channel: a channel of q / k_tilde that takes no part in attention (DMC's decision
            channel): it is treated as 0 whatever it holds, and gets gradient 0. ``"fused"``
            carries the bias in it instead of appending a channel (faster).
        impl: ``"auto"`` (``"fused"`` where its kernels take the inputs, else ``"blocked"``), ``"fused"`` or
            ``"blocked"``.

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
    chosen = _attention_impl(q.device, q.dtype, impl)
    if chosen == "fused":
        ops = fused_ops(q.device, q.dtype)
        return FusedDMCAttention.apply(q, k_tilde, v_tilde, alpha, float(scale), free_channel, ops)
    if free_channel is not None:
        q = q.index_fill(-1, torch.tensor([free_channel], device=q.device), 0)
    return BlockedDMCAttention.apply(q, k_tilde, v_tilde, alpha, float(scale), block, key_block)
