"""Triton kernels of the paged ops (the ``triton`` backend's, :mod:`kernels.backend`: chosen for CUDA tensors; on
CPU tensors they run under ``TRITON_INTERPRET=1``, which is how they are tested here). Layouts as in
``kernels/paged/__init__.py``; all math in fp32 (loads are cast before ``tl.dot``).

- ``paged_attention_triton``: split-K decode attention (flash-decoding). The grid is ``(R, splits)``, ``splits``
  from the number of rows and the block table's width alone (:func:`split_count`: as many as fill the device), so
  a decode step launches the same grid whatever its rows hold and never reads the lengths on the host (a CUDA graph
  can capture it). Program ``(r, s)`` reads row r's length, takes its share ``s`` of the row's tiles of ``TILE``
  entries (a tile spans ``TILE / page_size`` pages, each entry's page read from the block table) with row r's G
  query heads (padded to 16 for ``tl.dot``), runs an online softmax over them and writes a partial output and its
  log-sum-exp; a share past the row's tiles is empty. A second kernel merges the splits by their log-sum-exps (one
  program per row). With ``scores`` the same pass also stores each entry's logits: per head into an fp32 buffer
  ``[R, G, L]`` ("probs": the merge turns them into softmax weights with the merged log-sum-exp of the head and
  sums them over G), or already summed over the G heads into ``[R, L]`` ("logits"); K and V are read once. ``L``,
  the scores' width, is ``max_len`` when the caller bounds the rows (a decode step's plan: an eviction policy's
  budget), else the longest row read from the lengths.
- ``paged_write_triton``: one program per entry written.
- ``dmc_cache_update_triton``: the pages the appends start taken from the step's loan in one program
  (``take_spare_pages_triton``), then one program per row: Algorithm 1's merge-or-append on the open slot's
  fp32 state, the row's length counted on an append, then the normalised state into its page entry.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._checks import pack_outputs
from .writes import write_slots_torch

TILE = 64  # entries per inner step of the decode kernel (several pages at page size 16)


@triton.jit
def _paged_decode_kernel(Q, KP, VP, BT, LENS, OUT, LSE, S, scale,
                         s_qr, s_qg, s_kp, s_ks, s_vp, s_vs, s_btr, s_or, s_os, s_og, s_lr, s_ls, s_sr, s_sg,
                         G, D, DV, PAGE: tl.constexpr, TILE: tl.constexpr, BLOCK_G: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, STORE_S: tl.constexpr):
    # STORE_S: 0 nothing; 1 the logits of every head into S [R, G, L]; 2 their sum over the G heads into S [R, L]
    r = tl.program_id(0)
    s = tl.program_id(1)
    n = tl.load(LENS + r).to(tl.int32)
    g = tl.arange(0, BLOCK_G)
    dd = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    j = tl.arange(0, TILE)
    q = tl.load(Q + r * s_qr + g[:, None] * s_qg + dd[None, :], mask=(g[:, None] < G) & (dd[None, :] < D),
                other=0.0).to(tl.float32)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    tiles = (n + TILE - 1) // TILE
    share = (tiles + tl.num_programs(1) - 1) // tl.num_programs(1)  # this row's tiles per split
    first = s * share
    last = tl.minimum(first + share, tiles)
    for tile in range(first, last):
        entry = tile * TILE + j
        valid = entry < n
        page = tl.load(BT + r * s_btr + entry // PAGE, mask=valid, other=0).to(tl.int64)
        slot = (entry % PAGE).to(tl.int64)
        k = tl.load(KP + page[:, None] * s_kp + slot[:, None] * s_ks + dd[None, :],
                    mask=valid[:, None] & (dd[None, :] < D), other=0.0).to(tl.float32)
        scores = tl.dot(q, tl.trans(k)) * scale
        if STORE_S == 1:
            tl.store(S + r * s_sr + g[:, None] * s_sg + entry[None, :], scores,
                     mask=(g[:, None] < G) & valid[None, :])
        if STORE_S == 2:  # padded heads have q = 0, hence logits 0
            tl.store(S + r * s_sr + entry, tl.sum(scores, 0), mask=valid)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        decay = tl.exp(m - m_new)
        prob = tl.exp(scores - m_new[:, None])
        denom = denom * decay + tl.sum(prob, 1)
        v = tl.load(VP + page[:, None] * s_vp + slot[:, None] * s_vs + dv[None, :],
                    mask=valid[:, None] & (dv[None, :] < DV), other=0.0).to(tl.float32)
        acc = acc * decay[:, None] + tl.dot(prob, v)
        m = m_new
    safe = tl.where(denom > 0, denom, 1.0)
    out = acc / safe[:, None]
    lse = tl.where(denom > 0, m + tl.log(safe), float("-inf"))
    tl.store(OUT + r * s_or + s * s_os + g[:, None] * s_og + dv[None, :], out,
             mask=(g[:, None] < G) & (dv[None, :] < DV))
    tl.store(LSE + r * s_lr + s * s_ls + g, lse, mask=g < G)


@triton.jit
def _merge_splits_kernel(PART, PART_LSE, LENS, OUT, LSE, S, PROBS_OUT, splits, L,
                         s_pr, s_ps, s_pg, s_lr, s_ls, s_or, s_og, s_sr, s_sg, s_probs,
                         G, DV, BLOCK_G: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_L: tl.constexpr,
                         PROBS: tl.constexpr):
    # one program per row: the splits' partial outputs weighted by exp(lse_split - lse); PROBS: S's per-head logits
    # [R, G, L] -> the softmax weights summed over G into PROBS_OUT [R, L] (0 past the row's length)
    r = tl.program_id(0)
    g = tl.arange(0, BLOCK_G)
    dv = tl.arange(0, BLOCK_DV)
    heads = g < G
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    for s in range(0, splits):
        m = tl.maximum(m, tl.load(PART_LSE + r * s_lr + s * s_ls + g, mask=heads, other=float("-inf")))
    shift = tl.where(m > float("-inf"), m, 0.0)
    denom = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    for s in range(0, splits):  # an empty split has lse -inf: weight 0
        w = tl.exp(tl.load(PART_LSE + r * s_lr + s * s_ls + g, mask=heads, other=float("-inf")) - shift)
        part = tl.load(PART + r * s_pr + s * s_ps + g[:, None] * s_pg + dv[None, :],
                       mask=heads[:, None] & (dv[None, :] < DV), other=0.0)
        denom += w
        acc += w[:, None] * part
    safe = tl.where(denom > 0, denom, 1.0)
    total = tl.where(denom > 0, shift + tl.log(safe), float("-inf"))
    tl.store(OUT + r * s_or + g[:, None] * s_og + dv[None, :], (acc / safe[:, None]).to(OUT.dtype.element_ty),
             mask=heads[:, None] & (dv[None, :] < DV))
    tl.store(LSE + r * G + g, total, mask=heads)
    if PROBS:
        n = tl.load(LENS + r).to(tl.int32)
        for i0 in range(0, L, BLOCK_L):
            i = i0 + tl.arange(0, BLOCK_L)
            held = heads[:, None] & (i < n)[None, :]
            logit = tl.load(S + r * s_sr + g[:, None] * s_sg + i[None, :], mask=held, other=0.0)
            p = tl.where(held, tl.exp(logit - tl.where(heads, total, 0.0)[:, None]), 0.0)
            tl.store(PROBS_OUT + r * s_probs + i, tl.sum(p, 0), mask=i < L)


def _pow2(x: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(x))


@functools.cache
def _programs_to_fill(device: torch.device) -> int:
    """Programs that keep ``device`` busy: 4 per streaming multiprocessor on a GPU; 1 elsewhere (the interpreter)."""
    if device.type != "cuda":
        return 1
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


def split_count(rows: int, capacity: int, device: torch.device) -> int:
    """Splits per row of :func:`paged_attention_triton`: as many as, with ``rows`` rows, fill the device (one when the
    rows alone do), at most the tiles of a row of ``capacity`` entries (the block table's width)."""
    return max(1, min(-(-capacity // TILE), -(-_programs_to_fill(device) // max(rows, 1))))


def paged_attention_triton(q, k_pages, v_pages, block_table, seq_lens, scale: float, scores: str | None = None,
                           return_lse: bool = False, max_len: int | None = None, splits: int | None = None):
    """:func:`kernels.paged.paged_attention` on validated inputs; ``out [R, G, d_v]`` in q's dtype, then
    ``s [R, L] fp32`` when ``scores`` is ``"probs"`` / ``"logits"`` and ``lse [R, G] fp32`` with ``return_lse``.
    ``max_len``: a bound on the rows' lengths, the scores' width ``L`` (without it and with scores, the longest row,
    read on the host); ``splits``: default :func:`split_count`."""
    R, G, d = q.shape
    dv = v_pages.shape[2]
    q, k_pages, v_pages = q.contiguous(), k_pages.contiguous(), v_pages.contiguous()
    block_table = block_table.contiguous()
    L = 0 if scores is None else max_len if max_len is not None else int(seq_lens.max()) if R else 0
    splits = splits or split_count(R, block_table.shape[1] * k_pages.shape[1], q.device)
    part = torch.empty(R, splits, G, dv, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(R, splits, G, dtype=torch.float32, device=q.device)
    out = torch.empty(R, G, dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(R, G, dtype=torch.float32, device=q.device)
    probs = None
    if scores == "probs":  # per-head logits, turned into summed softmax weights by the merge
        s = torch.empty(R, G, L, dtype=torch.float32, device=q.device)
        probs = torch.empty(R, L, dtype=torch.float32, device=q.device)
    elif scores == "logits":  # summed over the heads; 0 past a row's length
        s = torch.zeros(R, L, dtype=torch.float32, device=q.device)
    else:
        s = part_lse  # unused
    s_sr, s_sg = (s.stride(0), s.stride(1)) if scores is not None else (0, 0)
    if scores == "logits":
        s_sg = 0
    if R:
        _paged_decode_kernel[(R, splits)](
            q, k_pages, v_pages, block_table, seq_lens, part, part_lse, s, scale,
            q.stride(0), q.stride(1), k_pages.stride(0), k_pages.stride(1), v_pages.stride(0), v_pages.stride(1),
            block_table.stride(0), part.stride(0), part.stride(1), part.stride(2), part_lse.stride(0),
            part_lse.stride(1), s_sr, s_sg, G, d, dv, PAGE=k_pages.shape[1], TILE=TILE, BLOCK_G=_pow2(G),
            BLOCK_D=_pow2(d), BLOCK_DV=_pow2(dv), STORE_S={None: 0, "probs": 1, "logits": 2}[scores])
        _merge_splits_kernel[(R,)](
            part, part_lse, seq_lens, out, lse, s, lse if probs is None else probs, splits, L,
            part.stride(0), part.stride(1), part.stride(2), part_lse.stride(0), part_lse.stride(1), out.stride(0),
            out.stride(1), s_sr, s_sg, 0 if probs is None else probs.stride(0), G, dv, BLOCK_G=_pow2(G, 1),
            BLOCK_DV=_pow2(dv, 1), BLOCK_L=128, PROBS=probs is not None)
    s = probs if scores == "probs" else s
    return pack_outputs(out, s if scores is not None else None, lse if return_lse else None)


def paged_attention_planned_triton(q, k_pages, v_pages, plan, scale: float, scores: str | None = None,
                                   return_lse: bool = False, index: int | None = None, append=None):
    """:func:`kernels.paged.paged_attention_planned` on a plan that keeps the block table: each row's new entry
    written first (:func:`~.writes.write_slots_torch`), then :func:`paged_attention_triton` with the plan's bound on
    the rows (the scores' width; no read of the lengths)."""
    if append is not None:
        k, v, slots = append
        write_slots_torch(k_pages, v_pages, slots, k.reshape(-1, k.shape[-1]), v.reshape(-1, v.shape[-1]))
    table = plan.block_table if index is None else plan.block_table[index]
    return paged_attention_triton(q, k_pages, v_pages, table, plan.lens, scale, scores, return_lse, plan.max_len)


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


@triton.jit
def _take_spare_pages_kernel(BT, SEQ_LENS, ROWS, ALPHA, SPARE, LEFT, n, s_btr, width,
                             PAGE: tl.constexpr, BLOCK: tl.constexpr):
    # one program, the rows in order: each appending row (alpha 0) whose last page is full takes SPARE[left - 1],
    # the next such row SPARE[left - 2], ...; LEFT counted down by them all (a loan too short leaves it below 0 and
    # takes nothing past its start: PagePool.settle refuses it; a row past its table's width takes nothing)
    left = tl.load(LEFT)
    taken = tl.sum(tl.zeros([BLOCK], tl.int32), 0)
    for start in range(0, n, BLOCK):
        i = start + tl.arange(0, BLOCK)
        inside = i < n
        row = tl.load(ROWS + i, mask=inside, other=0).to(tl.int64)
        length = tl.load(SEQ_LENS + row, mask=inside, other=1).to(tl.int32)
        needs = inside & (length % PAGE == 0) & (tl.load(ALPHA + i, mask=inside, other=1.0) == 0)
        at = left - (tl.cumsum(needs.to(tl.int32), 0) + taken)
        column = length // PAGE
        take = needs & (at >= 0) & (column < width)
        tl.store(BT + row * s_btr + column, tl.load(SPARE + at, mask=take, other=-1), mask=take)
        taken += tl.sum(needs.to(tl.int32), 0)
    tl.store(LEFT, left - taken)


def take_spare_pages_triton(block_table, seq_lens, rows, alpha, page_size: int, spare, spare_left) -> None:
    """:func:`~.writes.take_spare_pages_torch` in one program on the device, reading nothing on the host: the loan's
    size is the caller's to get right (:meth:`PagePool.lend_pages` lends one page for every row whose last page is
    full, the most a step can take; :meth:`PagePool.settle` refuses a count that went below zero)."""
    n = rows.shape[0]
    if n == 0:
        return
    alpha = alpha.reshape(n).contiguous()
    _take_spare_pages_kernel[(1,)](block_table, seq_lens, rows.contiguous(), alpha, spare, spare_left, n,
                                   block_table.stride(0), block_table.shape[1], PAGE=page_size,
                                   BLOCK=min(1024, _pow2(n)))


def dmc_cache_update_triton(k_pages, v_pages, block_table, seq_lens, rows, alpha, omega, k, v, open_state,
                            open_tokens, spare=None, spare_left=None) -> torch.Tensor:
    """:func:`kernels.paged.dmc_cache_update` on validated inputs: the pages the appends start taken on the device
    (:func:`take_spare_pages_triton`), then one program per row."""
    if spare is not None:
        take_spare_pages_triton(block_table, seq_lens, rows, alpha, k_pages.shape[1], spare, spare_left)
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
