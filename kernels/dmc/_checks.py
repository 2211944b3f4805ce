"""Input validation shared by the DMC operations: fail early, name the argument and what is allowed."""

from __future__ import annotations

import torch


def work_dtype(t: torch.Tensor) -> torch.dtype:
    """Internal compute precision: float64 stays float64 (gradcheck), everything else runs in float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def empty_in_layout_of(q: torch.Tensor, last: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised ``[b, h, n, last]`` tensor whose first three dims lie in memory in the order of
    ``q``'s (``q [b, h, n, d]``; the last dim innermost).

    Attention outputs use it: a caller whose q is a permuted view (megatron's ``[n, b, h, d]``) gets an
    output whose permute back and ``reshape`` to ``[n, b, h * d]`` is a view, not a second copy that
    the next layer's backward would keep beside the one attention saves.
    """
    order = sorted(range(3), key=q.stride, reverse=True)  # outermost first (stable on size-1 ties)
    out = torch.empty(*(q.shape[i] for i in order), last, dtype=dtype, device=q.device)
    return out.permute(*(order.index(i) for i in range(3)), 3)


def check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def check_ndim(name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor with layout {layout}, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have layout {layout} ({ndim} dims), got shape {tuple(t.shape)}")
    if t.shape[2 if ndim == 4 else -1] == 0:
        raise ValueError(f"{name} must have at least one token, got shape {tuple(t.shape)}")


def check_kv(k: torch.Tensor, v: torch.Tensor, k_name: str = "k", v_name: str = "v") -> None:
    check_ndim(k_name, k, 4, "[b, h_kv, n, d]")
    check_ndim(v_name, v, 4, "[b, h_kv, n, d_v]")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"{k_name} {tuple(k.shape)} and {v_name} {tuple(v.shape)} must agree in [b, h_kv, n]")


def check_per_head(name: str, t: torch.Tensor, k: torch.Tensor, k_name: str = "k") -> None:
    """alpha / omega: one value per (batch, KV head, token), i.e. [b, h_kv, n] matching k."""
    check_ndim(name, t, 3, "[b, h_kv, n]")
    if t.shape != k.shape[:3]:
        raise ValueError(
            f"{name} has shape {tuple(t.shape)}, expected [b, h_kv, n] = {tuple(k.shape[:3])} to match {k_name}"
        )


def check_gqa(q: torch.Tensor, k: torch.Tensor, k_name: str = "k") -> int:
    """Return the group size G = hq // hk after checking q [b, hq, n, d] against k [b, hk, n, d]."""
    check_ndim("q", q, 4, "[b, h_q, n, d]")
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q {tuple(q.shape)} and {k_name} {tuple(k.shape)} must agree in batch, tokens and head dim"
        )
    hq, hk = q.shape[1], k.shape[1]
    if hq % hk != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hk}) for GQA")
    return hq // hk
