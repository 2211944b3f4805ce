"""Input validation of the paged attention op: fail early, name the argument and what is allowed."""

from __future__ import annotations

import torch

INDEX_DTYPES = (torch.int32, torch.int64)


def work_dtype(t: torch.Tensor) -> torch.dtype:
    """Internal compute precision: float64 stays float64, everything else runs in float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype`` (no call when it is: a decode step of a small model on CPU is bound by calls)."""
    return t if t.dtype == dtype else t.to(dtype)


def check_tensor(name: str, t, layout: str, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor with layout {layout}, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have layout {layout} ({ndim} dims), got shape {tuple(t.shape)}")


def check_paged_inputs(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    check_values: bool = True,
) -> None:
    """Shapes, dtypes and devices of :func:`kernels.paged.paged_attention`'s inputs, then (``check_values``)
    the values of ``seq_lens`` and of the ``block_table`` entries the rows use (read on the host)."""
    check_tensor("q", q, "[R, G, d]", 3)
    check_tensor("k_pages", k_pages, "[num_pages, page_size, d]", 3)
    check_tensor("v_pages", v_pages, "[num_pages, page_size, d_v]", 3)
    check_tensor("block_table", block_table, "[R, max_pages]", 2)
    check_tensor("seq_lens", seq_lens, "[R]", 1)
    for name, t in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating point tensor, got {t.dtype}")
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens)):
        if t.dtype not in INDEX_DTYPES:
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    for name, t in (("k_pages", k_pages), ("v_pages", v_pages), ("block_table", block_table), ("seq_lens", seq_lens)):
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    R = q.shape[0]
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens)):
        if t.shape[0] != R:
            raise ValueError(f"{name} has {t.shape[0]} rows, expected R = {R} (q.shape[0])")
    if k_pages.shape[2] != q.shape[2]:
        raise ValueError(f"k_pages head size {k_pages.shape[2]} must equal q's head size d = {q.shape[2]}")
    if k_pages.shape[:2] != v_pages.shape[:2]:
        raise ValueError(
            f"k_pages {tuple(k_pages.shape)} and v_pages {tuple(v_pages.shape)} must agree in [num_pages, page_size]"
        )
    if R == 0 or not check_values:
        return
    num_pages, page_size = k_pages.shape[:2]
    cap = block_table.shape[1] * page_size
    bad = (seq_lens < 1) | (seq_lens > cap)
    if bool(bad.any()):
        r = int(bad.int().argmax())
        raise ValueError(f"seq_lens must be in [1, max_pages * page_size] = [1, {cap}]; row {r} has {int(seq_lens[r])}")
    # Out-of-range page indices would silently wrap (negative) or fail deep inside the gather.
    used = torch.arange(block_table.shape[1], device=q.device) < (seq_lens[:, None] + page_size - 1) // page_size
    bad = used & ((block_table < 0) | (block_table >= num_pages))
    if bool(bad.any()):
        r, j = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"block_table entries of used pages must be page indices in [0, num_pages) = [0, {num_pages}); "
            f"block_table[{r}, {j}] = {int(block_table[r, j])}"
        )


SCORES = (None, "probs", "logits")


def check_scores(scores) -> None:
    """``scores`` of :func:`kernels.paged.paged_attention`: None, "probs" or "logits"."""
    if not (scores is None or (isinstance(scores, str) and scores in SCORES)):
        raise ValueError(f"scores must be None, 'probs' or 'logits', got {scores!r}")


def check_column_sum_inputs(q: torch.Tensor, k: torch.Tensor, tau: float, block: int, v=None, noise=None) -> None:
    """Shapes, dtypes and devices of :func:`kernels.paged.attention_column_sums`' inputs."""
    check_tensor("q", q, "[b, H, n, d]", 4)
    check_tensor("k", k, "[b, H_kv, n, d]", 4)
    for name, t in (("q", q), ("k", k)):
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating point tensor, got {t.dtype}")
    if k.device != q.device:
        raise ValueError(f"k must be on q's device {q.device}, got {k.device}")
    b, H, n, d = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (b, n, d):
        raise ValueError(f"k {tuple(k.shape)} must agree with q {tuple(q.shape)} in b, n and d")
    if k.shape[1] == 0 or H % k.shape[1]:
        raise ValueError(f"q's {H} heads must be a multiple of k's H_kv = {k.shape[1]} heads")
    if not tau > 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    if v is not None:
        check_tensor("v", v, "[b, H_kv, n, d_v]", 4)
        if v.shape[:3] != k.shape[:3] or v.device != q.device:
            raise ValueError(f"v {tuple(v.shape)} must agree with k {tuple(k.shape)} in b, H_kv and n, on q's device")
        if tau != 1.0 or noise is not None:
            raise ValueError("the attention's output (v given) is the plain softmax's: tau must be 1 and no noise")


def pack_outputs(out, s, lse):
    """``out``, or the tuple of ``out`` and the extras that were asked for (``s``, ``lse``), in that order."""
    extras = tuple(t for t in (s, lse) if t is not None)
    return (out, *extras) if extras else out
