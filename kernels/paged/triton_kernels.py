"""Triton kernels of the paged ops (the ``triton`` backend's, :mod:`kernels.backend`: chosen for CUDA tensors; on
CPU tensors they run under ``TRITON_INTERPRET=1``, which is how they are tested here). Layouts as in
``kernels/paged/__init__.py``; all math in fp32 (loads are cast before ``tl.dot``).

- ``paged_attention_triton``: split-K decode attention. Program ``(r, s)`` takes row r's G query heads
  (padded to 16 for ``tl.dot``) and the pages ``[s * P, (s + 1) * P)`` of the row, runs an online
  softmax over them and writes a partial output and its log-sum-exp; the splits are merged with
  their log-sum-exps. Long rows are spread over many programs; short rows end after their pages.
  With ``scores`` the same pass also stores each entry's logits: per head into an fp32 buffer
  ``[R, G, L]`` ("probs": turned into softmax weights afterwards by one elementwise
  ``exp(logit - lse)`` with the merged log-sum-exp of the head, then summed over G), or already summed
  over the G heads into ``[R, L]`` ("logits"). K is read once.
- ``paged_write_triton``: one program per entry written.
- ``dmc_cache_update_triton``: one program per row: Algorithm 1's merge-or-append on the open slot's
  fp32 state, the row's length counted on an append, then the normalised state into its page entry.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import pack_outputs
from .writes import take_spare_pages_torch


@triton.jit
def _paged_decode_kernel(Q, KP, VP, BT, LENS, OUT, LSE, S, scale,
                         s_qr, s_qg, s_kp, s_ks, s_vp, s_vs, s_btr, s_or, s_os, s_og, s_lr, s_ls, s_sr, s_sg,
                         G, D, DV, PAGES_PER_SPLIT: tl.constexpr, PAGE: tl.constexpr, BLOCK_G: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, STORE_S: tl.constexpr):
    # STORE_S: 0 nothing; 1 the logits of every head into S [R, G, L]; 2 their sum over the G heads into S [R, L]
    r = tl.program_id(0)
    s = tl.program_id(1)
    n = tl.load(LENS + r).to(tl.int32)
    g = tl.arange(0, BLOCK_G)
    dd = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    t = tl.arange(0, PAGE)
    q = tl.load(Q + r * s_qr + g[:, None] * s_qg + dd[None, :], mask=(g[:, None] < G) & (dd[None, :] < D),
                other=0.0).to(tl.float32)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    first = s * PAGES_PER_SPLIT
    last = tl.minimum(first + PAGES_PER_SPLIT, (n + PAGE - 1) // PAGE)
    for p in range(first, last):
        page = tl.load(BT + r * s_btr + p).to(tl.int64)
        valid = p * PAGE + t < n
        k = tl.load(KP + page * s_kp + t[:, None] * s_ks + dd[None, :], mask=valid[:, None] & (dd[None, :] < D),
                    other=0.0).to(tl.float32)
        scores = tl.dot(q, tl.trans(k)) * scale
        if STORE_S == 1:
            tl.store(S + r * s_sr + g[:, None] * s_sg + (p * PAGE + t)[None, :], scores,
                     mask=(g[:, None] < G) & valid[None, :])
        if STORE_S == 2:  # padded heads have q = 0, hence logits 0
            tl.store(S + r * s_sr + p * PAGE + t, tl.sum(scores, 0), mask=valid)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        decay = tl.exp(m - m_new)
        prob = tl.exp(scores - m_new[:, None])
        denom = denom * decay + tl.sum(prob, 1)
        v = tl.load(VP + page * s_vp + t[:, None] * s_vs + dv[None, :], mask=valid[:, None] & (dv[None, :] < DV),
                    other=0.0).to(tl.float32)
        acc = acc * decay[:, None] + tl.dot(prob, v)
        m = m_new
    safe = tl.where(denom > 0, denom, 1.0)
    out = acc / safe[:, None]
    lse = tl.where(denom > 0, m + tl.log(safe), float("-inf"))
    tl.store(OUT + r * s_or + s * s_os + g[:, None] * s_og + dv[None, :], out,
             mask=(g[:, None] < G) & (dv[None, :] < DV))
    tl.store(LSE + r * s_lr + s * s_ls + g, lse, mask=g < G)


def _pow2(x: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(x))


def paged_attention_triton(q, k_pages, v_pages, block_table, seq_lens, scale: float, scores: str | None = None,
                           return_lse: bool = False, pages_per_split: int = 16):
    """:func:`kernels.paged.paged_attention` on validated inputs; ``out [R, G, d_v]`` in q's dtype, then
    ``s [R, L] fp32`` when ``scores`` is ``"probs"`` / ``"logits"`` and ``lse [R, G] fp32`` with ``return_lse``."""
    R, G, d = q.shape
    page, dv = k_pages.shape[1], v_pages.shape[2]
    q, k_pages, v_pages = q.contiguous(), k_pages.contiguous(), v_pages.contiguous()
    block_table = block_table.contiguous()
    L = int(seq_lens.max()) if R else 0
    max_pages = -(-L // page)
    splits = max(1, -(-max_pages // pages_per_split))
    out = torch.empty(R, splits, G, dv, dtype=torch.float32, device=q.device)
    lse = torch.empty(R, splits, G, dtype=torch.float32, device=q.device)
    if scores == "probs":  # per-head logits; the entries past a row's length stay -inf (weight 0)
        s = torch.full((R, G, L), float("-inf"), dtype=torch.float32, device=q.device)
        s_sr, s_sg = s.stride(0), s.stride(1)
    elif scores == "logits":  # summed over the heads; 0 past a row's length
        s = torch.zeros(R, L, dtype=torch.float32, device=q.device)
        s_sr, s_sg = s.stride(0), 0
    else:
        s, s_sr, s_sg = lse, 0, 0  # unused
    if R:
        _paged_decode_kernel[(R, splits)](
            q, k_pages, v_pages, block_table, seq_lens, out, lse, s, scale,
            q.stride(0), q.stride(1), k_pages.stride(0), k_pages.stride(1), v_pages.stride(0), v_pages.stride(1),
            block_table.stride(0), out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
            s_sr, s_sg, G, d, dv, PAGES_PER_SPLIT=pages_per_split, PAGE=page, BLOCK_G=_pow2(G), BLOCK_D=_pow2(d),
            BLOCK_DV=_pow2(dv), STORE_S={None: 0, "probs": 1, "logits": 2}[scores])
    weight = torch.softmax(lse, dim=1)  # merge the splits by their log-sum-exps (empty splits: -inf -> 0)
    out = (weight[..., None] * out).sum(1).to(q.dtype)
    total = torch.logsumexp(lse, dim=1)  # [R, G]
    if scores == "probs":
        s = s.sub_(total[..., None]).exp_().sum(1)  # softmax weights, summed over G
    return pack_outputs(out, s if scores is not None else None, total if return_lse else None)


@triton.jit
def _paged_write_kernel(KP, VP, BT, ROWS, POS, K, V, s_kp, s_ks, s_vp, s_vs, s_btr, s_k, s_v, D, DV,
                        PAGE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(ROWS + i).to(tl.int64)
    pos = tl.load(POS + i).to(tl.int64)
    page = tl.load(BT + row * s_btr + pos // PAGE).to(tl.int64)
    dd = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    k = tl.load(K + i * s_k + dd, mask=dd < D)
    v = tl.load(V + i * s_v + dv, mask=dv < DV)
    tl.store(KP + page * s_kp + (pos % PAGE) * s_ks + dd, k.to(KP.dtype.element_ty), mask=dd < D)
    tl.store(VP + page * s_vp + (pos % PAGE) * s_vs + dv, v.to(VP.dtype.element_ty), mask=dv < DV)


def paged_write_triton(k_pages, v_pages, block_table, rows, positions, k, v) -> None:
    n, d = k.shape
    if n == 0:
        return
    k, v = k.contiguous(), v.contiguous()
    _paged_write_kernel[(n,)](k_pages, v_pages, block_table, rows.contiguous(), positions.contiguous(), k, v,
                              k_pages.stride(0), k_pages.stride(1), v_pages.stride(0), v_pages.stride(1),
                              block_table.stride(0), k.stride(0), v.stride(0), d, v.shape[1],
                              PAGE=k_pages.shape[1], BLOCK_D=_pow2(d, 1), BLOCK_DV=_pow2(v.shape[1], 1))


@triton.jit
def _dmc_update_kernel(KP, VP, BT, SEQ_LENS, LENS, ROWS, ALPHA, OMEGA, K, V, OS, OT,
                       s_kp, s_ks, s_vp, s_vs, s_btr, s_k, s_v, s_sr, s_sj, D, DV,
                       RING: tl.constexpr, PAGE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    # OS: the open-slot state, ring slot j of a row at OS + row * s_sr + j * s_sj: [omega k | omega v | omega]
    i = tl.program_id(0)
    row = tl.load(ROWS + i).to(tl.int64)
    fresh = tl.load(ALPHA + i) == 0  # the hard decision: 0 appends
    w = tl.load(OMEGA + i).to(tl.float32)
    dd = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    md = dd < D
    mv = dv < DV
    k = tl.load(K + i * s_k + dd, mask=md, other=0.0).to(tl.float32)
    v = tl.load(V + i * s_v + dv, mask=mv, other=0.0).to(tl.float32)
    count = tl.where(fresh, 0, tl.load(OT + row))
    slot = count % RING
    num_k = tl.zeros([BLOCK_D], tl.float32)
    num_v = tl.zeros([BLOCK_DV], tl.float32)
    z = 0.0
    for j in tl.static_range(RING):
        # exact (RING = 1): merges add to the sums; window: the newest token replaces the oldest
        keep = (~fresh) & (j != slot) if RING > 1 else ~fresh
        newest = tl.where(j == slot, w, 0.0)
        at = OS + row * s_sr + j * s_sj
        new_k = tl.where(keep, tl.load(at + dd, mask=md, other=0.0), 0.0) + newest * k
        new_v = tl.where(keep, tl.load(at + D + dv, mask=mv, other=0.0), 0.0) + newest * v
        new_w = tl.where(keep, tl.load(at + D + DV), 0.0) + newest
        tl.store(at + dd, new_k, mask=md)
        tl.store(at + D + dv, new_v, mask=mv)
        tl.store(at + D + DV, new_w)
        num_k += new_k
        num_v += new_v
        z += new_w
    tl.store(OT + row, count + 1)
    length = tl.load(SEQ_LENS + row) + fresh.to(tl.int32)  # an append's entry: its page is assigned
    tl.store(SEQ_LENS + row, length.to(SEQ_LENS.dtype.element_ty))
    tl.store(LENS + i, length.to(LENS.dtype.element_ty))
    pos = length.to(tl.int64) - 1
    page = tl.load(BT + row * s_btr + pos // PAGE).to(tl.int64)
    tl.store(KP + page * s_kp + (pos % PAGE) * s_ks + dd, (num_k / z).to(KP.dtype.element_ty), mask=md)
    tl.store(VP + page * s_vp + (pos % PAGE) * s_vs + dv, (num_v / z).to(VP.dtype.element_ty), mask=mv)


def dmc_cache_update_triton(k_pages, v_pages, block_table, seq_lens, rows, alpha, omega, k, v, open_state,
                            open_tokens, spare=None, spare_left=None) -> torch.Tensor:
    """:func:`kernels.paged.dmc_cache_update` on validated inputs: the pages the appends start taken in tensor ops
    (:func:`~.writes.take_spare_pages_torch`), then one program per row."""
    if spare is not None:
        take_spare_pages_torch(block_table, seq_lens, rows, alpha, k_pages.shape[1], spare, spare_left)
    n = rows.shape[0]
    lens = torch.empty(n, dtype=seq_lens.dtype, device=seq_lens.device)
    if n == 0:
        return lens
    k, v = k.reshape(n, -1).contiguous(), v.reshape(n, -1).contiguous()
    alpha, omega = alpha.reshape(n).contiguous(), omega.reshape(n).float().contiguous()
    _dmc_update_kernel[(n,)](
        k_pages, v_pages, block_table, seq_lens, lens, rows.contiguous(), alpha, omega, k, v, open_state, open_tokens,
        k_pages.stride(0), k_pages.stride(1), v_pages.stride(0), v_pages.stride(1), block_table.stride(0),
        k.stride(0), v.stride(0), open_state.stride(0), open_state.stride(1), k.shape[1], v.shape[1],
        RING=open_state.shape[1], PAGE=k_pages.shape[1], BLOCK_D=_pow2(k.shape[1], 1), BLOCK_DV=_pow2(v.shape[1], 1))
    return lens
