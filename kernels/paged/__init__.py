"""Paged decode attention: one query token per row against a KV cache stored in fixed-size pages.

A *row* is one (sequence, KV head). Its cached keys / values live in pages shared by all rows, and its
row of the block table lists which pages hold them, in order (the layout of vLLM, FlashInfer and
flash-attn's ``flash_attn_with_kvcache``):

- q ``[R, G, d]``: the decode query of the row's G query heads (GQA: G query heads read one KV head).
- k_pages ``[num_pages, page_size, d]``, v_pages ``[num_pages, page_size, d_v]``.
- block_table ``[R, max_pages]`` int32 / int64: token i of row r is at
  ``k_pages[block_table[r, i // page_size], i % page_size]`` (same for v). Entries past the pages a
  row uses are ignored (may hold -1); so are the slots of its last page past ``seq_lens[r]``.
- seq_lens ``[R]`` int32 / int64: cached tokens of each row, ``1 <= seq_lens[r] <= max_pages * page_size``.

Every cached token is visible to the decode query (no causal mask). Rows may be ragged and their
pages in any order.

Public ops (each validates its inputs, then calls the dispatch once: ``OPS`` below is the table of which backend's
implementation takes which inputs, and :mod:`kernels.backend` chooses the backend per device: ``triton``, or
``flash`` then ``triton``, for CUDA tensors; ``cpu_compiled`` on CPU, whose kernels take fp32 pages; ``torch`` for
the rest; ``DMC_KERNELS`` forces one). :func:`reads_block_table` and :func:`appends_in_attention_call` ask the same
table before a step's tensors exist. A new backend adds its rows to ``OPS`` (``docs/DESIGN.md``, "Adding a
backend"):

- :func:`paged_attention`: decode attention. CPU, fp32: ``cpu.py`` (``cpu_kernel.c``, compiled on first use:
  each row reads its own pages in place, online softmax, rows over the OpenMP threads; without a C compiler
  the PyTorch path); PyTorch: ``varlen.py`` (rows grouped by page count, one batched matmul per group over
  a gathered copy: cost ~ the tokens held plus a page per row); Triton: ``triton_kernels.py``
  (split-K over tiles of several pages, G query heads per program, the splits merged by their log-sum-exps in a
  second kernel); flash-attn's ``flash_attn_with_kvcache``
  (``flash.py``) when it is installed and fits (CUDA, fp16/bf16, page size divisible by 256) and no
  scores are requested. With ``scores="probs"`` / ``"logits"`` it also returns, from the same attention
  pass, each entry's attention score for an eviction policy (H2O, TOVA, Keyformer): ``s [R, L]`` fp32,
  ``L = max(seq_lens)`` (0 when R = 0); ``s[r, i]`` for entry i (the i-th token of row r, in
  block-table order) is the sum over the row's G query heads of the softmax weight ("probs": each row
  sums to G) or of the logit ``q[r, g] . k_i * scale`` ("logits"); entries ``i >= seq_lens[r]`` are 0.
- :func:`paged_decode_plan` + :func:`paged_attention_planned`: the same decode attention in two parts for a
  caller that attends many times over the same lengths (the engine: every layer of a decode step). The plan
  (what depends on the block table and lengths only: row groups, page ids, tail masks; vLLM's attention
  metadata) is built once, unvalidated (the caller built the table); a call only gathers and attends.
- :func:`attention_column_sums`: the prefill counterpart, ``[b, H_kv, n]`` fp32: for causal attention
  over a prompt, how much softmax weight each key gets, summed over all queries and the G query heads
  of its KV head (optionally with temperature ``tau`` and additive noise, Keyformer's Gumbel scores).
  PyTorch only: ``column_sums.py`` (blockwise over queries, at most ``block x n`` scores per head).
- :func:`paged_write`: store entries at positions of rows (append; an eviction policy's in-place
  overwrite). PyTorch: ``writes.py``.
- :func:`dmc_cache_update`: one DMC decode step per row (merge into the open slot or append: the appending
  rows' lengths counted, their new pages taken from the caller's spare ones), the open slot's normalised state
  into its page entry, and the rows' new lengths returned for the attention. CPU, fp32 pages: ``cpu.py`` (one
  call); Triton: ``triton_kernels.py``; PyTorch: ``writes.py``.
- :func:`dmc_decode`: a layer's DMC decode step, :func:`dmc_cache_update` then :func:`paged_attention` over the
  rows; :func:`paged_append_decode`: the same for a cache that keeps every token (each row appends its new entry,
  pages taken from the spare ones). One call each on CPU (``cpu.py``).

References (``reference.py``, re-exported here): :func:`reference_paged_attention` (loop over rows and
tokens), :func:`reference_attention_column_sums` (loop over queries and heads).

This package depends on torch only (it sits below ``dmc_train``).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from kernels.backend import Impl, Op, lazy

from ._checks import check_column_sum_inputs, check_paged_inputs, check_scores
from .column_sums import attention_column_sums_torch
from .cpu import (
    DecodeAttention,
    append_decode_fits,
    cpu_kernel_fits,
    cpu_kernel_runs,
    decode_attention_fits,
    decode_step_cpu,
    dmc_cache_update_cpu,
    dmc_decode_cpu,
    dmc_decode_fits,
    paged_attention_cpu,
    paged_attention_planned_cpu,
    planned_fits,
    update_fits,
)
from .flash import flash_fits, flash_planned_fits, flash_takes, paged_attention_flash
from .reference import reference_attention_column_sums, reference_paged_attention
from .varlen import DecodePlan, attend_planned, paged_attention_torch, plan_decode
from .writes import dmc_cache_update_torch, paged_write_torch, take_spare_pages_torch, write_slots_torch

__all__ = ["DecodePlan", "OPS", "appends_in_attention_call", "attention_column_sums", "dmc_cache_update",
           "dmc_decode", "decode_attention", "paged_append_decode", "paged_attention", "paged_attention_planned",
           "paged_decode_plan", "paged_write", "reads_block_table", "reference_attention_column_sums",
           "reference_paged_attention"]


# The PyTorch side of the ops that combine others: each calls the public ops (which dispatch in turn).

def _dmc_decode_by_ops(k_pages, v_pages, block_table, seq_lens, rows, alpha, omega, k, v, open_state, open_tokens, q,
                       scale, spare, spare_left):
    lens = dmc_cache_update(k_pages, v_pages, block_table, seq_lens, rows, alpha, omega, k, v, open_state, open_tokens,
                            spare, spare_left)
    return paged_attention(q, k_pages, v_pages, block_table[rows], lens, scale, check_values=False)


def _append_decode_by_ops(k_pages, v_pages, block_table, seq_lens, rows, k, v, q, scale, spare, spare_left):
    take_spare_pages_torch(block_table, seq_lens, rows, None, k_pages.shape[1], spare, spare_left)
    lens = seq_lens[rows]
    paged_write(k_pages, v_pages, block_table, rows, lens, k.reshape(-1, k.shape[-1]), v.reshape(-1, v.shape[-1]))
    seq_lens[rows] = lens + 1
    return paged_attention(q, k_pages, v_pages, block_table[rows], lens + 1, scale, check_values=False)


def _write_appended(k_pages, v_pages, append) -> None:
    if append is not None:
        k, v, slots = append
        write_slots_torch(k_pages, v_pages, slots, k.reshape(-1, k.shape[-1]), v.reshape(-1, v.shape[-1]))


def _planned_by_table(q, k_pages, v_pages, plan, scale, scores, return_lse, index, append):
    """Each row's new entry written first (:func:`write_slots_torch`), then :func:`paged_attention` over the plan's
    table (its ``[index]``)."""
    _write_appended(k_pages, v_pages, append)
    table = plan.block_table if index is None else plan.block_table[index]
    return paged_attention(q, k_pages, v_pages, table, plan.lens, scale, scores=scores, return_lse=return_lse,
                           check_values=False)


def _planned_by_ops(q, k_pages, v_pages, plan, scale, scores, return_lse, index, append):
    """:func:`_planned_by_table` for a plan that keeps the table (a kernel reads it), else the entries written and
    the attention over the plan's row groups (:func:`attend_planned`)."""
    if plan.groups is None:
        return _planned_by_table(q, k_pages, v_pages, plan, scale, scores, return_lse, index, append)
    _write_appended(k_pages, v_pages, append)
    return attend_planned(q, k_pages, v_pages, plan, scale, scores=scores, return_lse=return_lse, index=index)


def _keeps_table(q, k_pages, v_pages, plan, *_) -> bool:
    """A plan built for a kernel that reads the block table itself (:func:`paged_decode_plan`)."""
    return plan.groups is None


def _no_compiled_call(*inputs) -> None:
    return None


_triton = "kernels.paged.triton_kernels"

# Which backend takes which inputs: per op, each backend's implementation, its fit over the op's inputs (as the
# public op passes them) and, where a caller asks before the inputs exist, what the pages' device and dtype decide.
OPS = {
    "paged_attention": Op({
        "flash": Impl(paged_attention_flash, fits=flash_fits, takes=flash_takes),
        "triton": Impl(lazy(_triton, "paged_attention_triton")),
        "cpu_compiled": Impl(paged_attention_cpu, fits=cpu_kernel_fits, takes=cpu_kernel_runs),
        "torch": Impl(paged_attention_torch),
    }),
    "paged_attention_planned": Op({
        "flash": Impl(_planned_by_table, fits=flash_planned_fits),
        "triton": Impl(lazy(_triton, "paged_attention_planned_triton"), fits=_keeps_table),
        "cpu_compiled": Impl(paged_attention_planned_cpu, fits=planned_fits),
        "torch": Impl(_planned_by_ops),
    }),
    "paged_write": Op({
        "triton": Impl(lazy(_triton, "paged_write_triton")),
        "torch": Impl(paged_write_torch),
    }),
    "dmc_cache_update": Op({
        "triton": Impl(lazy(_triton, "dmc_cache_update_triton")),
        "cpu_compiled": Impl(dmc_cache_update_cpu, fits=update_fits),
        "torch": Impl(dmc_cache_update_torch),
    }),
    "dmc_decode": Op({
        "cpu_compiled": Impl(dmc_decode_cpu, fits=dmc_decode_fits, takes=cpu_kernel_runs),
        "torch": Impl(_dmc_decode_by_ops),
    }),
    "paged_append_decode": Op({
        "cpu_compiled": Impl(decode_step_cpu, fits=append_decode_fits, takes=cpu_kernel_runs),
        "torch": Impl(_append_decode_by_ops),
    }),
    "decode_attention": Op({
        "cpu_compiled": Impl(DecodeAttention, fits=decode_attention_fits, takes=cpu_kernel_runs),
        "torch": Impl(_no_compiled_call),
    }),
}


def reads_block_table(device: torch.device, dtype: torch.dtype | None) -> bool:
    """True when paged decode attention over pages of ``dtype`` on ``device`` runs a kernel that reads each row's
    pages through the block table itself (Triton, flash-attn, the compiled CPU kernel): a :class:`DecodePlan` then
    keeps only the table and lengths, and no caller needs to choose pages or groups."""
    return OPS["paged_attention"].pick_for(device, dtype).backend != "torch"


def appends_in_attention_call(device: torch.device, dtype: torch.dtype) -> bool:
    """True when a decode step's update and attention over pages of ``dtype`` on ``device`` run as one kernel call
    (:func:`dmc_decode`, :func:`paged_append_decode`: the compiled CPU kernel, fp32)."""
    return OPS["paged_append_decode"].pick_for(device, dtype).backend != "torch"


def paged_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    scores: str | None = None,
    return_lse: bool = False,
    check_values: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Decode attention of one query token per row over the row's paged KV cache.

    Args:
        q: queries ``[R, G, d]``; row r is one (sequence, KV head), its G query heads share that KV head.
        k_pages: key pages ``[num_pages, page_size, d]``.
        v_pages: value pages ``[num_pages, page_size, d_v]``.
        block_table: ``[R, max_pages]`` int32 / int64; token i of row r is in page
            ``block_table[r, i // page_size]`` at slot ``i % page_size``. Entries past the row's used
            pages are ignored; the used ones must be in ``[0, num_pages)``.
        seq_lens: ``[R]`` int32 / int64, cached tokens per row, in ``[1, max_pages * page_size]``.
        scale: score scale, default ``1 / sqrt(d)``.
        scores: None, ``"probs"`` or ``"logits"``: also return each cached entry's score from the same
            attention pass (for eviction policies such as H2O, TOVA, Keyformer).
        return_lse: also return the log-sum-exp of each query head's logits (LESS combines the sparse
            attention with its state by it).
        check_values: also check the values of ``seq_lens`` and of the used ``block_table`` entries (a
            read on the host each call); a caller that builds them itself (the engine's page pool) skips it.

    Returns:
        ``out [R, G, d_v]`` in q's dtype: ``softmax(q[r] K_r^T * scale) V_r`` over the row's
        ``seq_lens[r]`` cached tokens; computed in float32 (float64 stays float64). Inference only
        (gradients untested). Validation reads ``seq_lens`` and ``block_table`` on the host.

        With ``scores``: ``(out, s)``, ``s [R, L]`` float32 with ``L = max(seq_lens)`` (0 if R = 0).
        For entry ``i < seq_lens[r]`` (token i of row r, in block-table order): ``"probs"``:
        ``s[r, i] = sum_g softmax(q[r, g] K_r^T * scale)[i]`` (each row sums to G); ``"logits"``:
        ``s[r, i] = sum_g q[r, g] . k_i * scale``. Entries ``i >= seq_lens[r]`` are 0. flash-attn cannot
        return scores, so then the Triton (CUDA) or PyTorch path runs.

        With ``return_lse``: ``lse [R, G]`` float32, ``log sum_i exp(q[r, g] . k_i * scale)``, appended last:
        ``(out, lse)`` or ``(out, s, lse)``.

    Raises:
        ValueError: on bad inputs, including a ``scores`` other than None / "probs" / "logits".
    """
    check_scores(scores)
    check_paged_inputs(q, k_pages, v_pages, block_table, seq_lens, check_values)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return OPS["paged_attention"](q, k_pages, v_pages, block_table, seq_lens, float(scale), scores,
                                  return_lse)


def paged_decode_plan(block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int, page_bytes: int,
                      dtype: torch.dtype | None = None, max_len: int | None = None) -> DecodePlan:
    """The :class:`DecodePlan` of rows holding ``seq_lens [R]`` entries with block table ``[..., R, max_pages]``
    (leading dims: e.g. the layers of a decode step whose rows hold equal lengths; a call picks one with
    ``index``); ``page_bytes``: a K page plus a V page. Not validated: the caller builds the table (the
    engine's pool). When a kernel reads the table itself (:func:`reads_block_table` for the pages' ``dtype``;
    None: the PyTorch path's plan), only the table, the lengths and ``max_len``, the caller's bound on the rows
    (the scores' width; None: none known), are kept: no groups, nothing read on the host."""
    if reads_block_table(seq_lens.device, dtype):
        return DecodePlan(seq_lens.shape[0], max_len, seq_lens, None, block_table)
    return plan_decode(block_table, seq_lens, page_size, page_bytes)


def paged_attention_planned(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, plan: DecodePlan,
                            scale: float, scores: str | None = None, return_lse: bool = False,
                            index: int | None = None,
                            append: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                            ) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """:func:`paged_attention` of ``q [R, G, d]`` over the rows of ``plan`` (:func:`paged_decode_plan`; its
    table's ``[index]`` when it has a leading dim): the same outputs. Only q's shape is checked.

    ``append``: ``(k [R, d], v [R, d_v], slots [R] int64)`` (k and v also ``[B, R / B, ...]``, e.g. strided views of
    the model's heads), each row's new entry, stored first at its flat slot
    ``page * page_size + offset`` of the (contiguous) pages, an entry the plan's lengths already count; then the
    attention, which sees it (as ``flash_attn_with_kvcache`` appends and attends in one call). The compiled CPU
    kernel does both in one call; elsewhere the entries are written first (:func:`write_slots_torch`)."""
    if q.dim() != 3 or q.shape[0] != plan.rows:
        raise ValueError(f"q must be [R, G, d] with R = {plan.rows} rows of the plan, got {tuple(q.shape)}")
    return OPS["paged_attention_planned"](q, k_pages, v_pages, plan, float(scale), scores, return_lse,
                                          index, append)


def attention_column_sums(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    tau: float = 1.0,
    noise: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    block: int = 128,
    v: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Column sums of causal prefill attention: the attention each prompt key receives (PyTorch only).

    Args:
        q: queries ``[b, H, n, d]`` (any float dtype; computed in float32).
        k: keys ``[b, H_kv, n, d]``; ``H`` must be a multiple of ``H_kv``, ``G = H // H_kv``, and query head
            h reads KV head ``h // G`` (GQA).
        scale: logit scale (e.g. ``1 / sqrt(d)``).
        tau: softmax temperature, > 0: the weights are ``softmax_j((q_i . k_j * scale + noise_ij) / tau)``.
        noise: None, or a callable ``noise(q_positions [m] int64, k_positions [m_k] int64)`` returning a
            tensor broadcastable to ``[b, H, m, m_k]``: the additive noise of a block of queries (e.g.
            Keyformer's Gumbel noise). It is called once per block with the block's query positions
            ``arange(i0, i1)`` and the positions of the keys that block can see, ``arange(i1)`` (causal:
            so ``m_k = i1 <= n``, not always n); the noise of key positions past a query is unused.
        block: queries per block; at most ``block x n`` scores per (b, H) exist at once (never ``n x n``).
        v: values ``[b, H_kv, n, d_v]``, or None: with them the causal attention's output comes from the same
            probabilities (one pass for the attention and its scores: H2O's prefill); tau 1 and no noise only.

    Returns:
        ``[b, H_kv, n]`` float32: entry ``[b, j, c]`` = the sum over queries ``i >= c`` and over the G
        query heads of KV head j of the causal softmax weight of key c (query i sees keys ``<= i``).
        Each KV head's columns sum to ``G * n``. With ``v``: ``(out, sums)``, ``out [b, H, n, d_v]`` in q's dtype
        the causal attention (as ``scaled_dot_product_attention(..., is_causal=True)``, to float rounding).
    """
    check_column_sum_inputs(q, k, tau, block, v, noise)
    return attention_column_sums_torch(q, k, float(scale), float(tau), noise, block, v)


def paged_write(k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: torch.Tensor, rows: torch.Tensor,
                positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store ``k [N, d]``, ``v [N, d_v]`` at entry ``positions [N]`` of ``rows [N]`` (in place).

    The pages must already be assigned in ``block_table``; an existing entry is overwritten (how a
    fixed-budget policy replaces its victim). Values are cast to the pages' dtype.
    """
    if not (rows.shape == positions.shape == k.shape[:1] == v.shape[:1]):
        raise ValueError(f"rows {tuple(rows.shape)}, positions {tuple(positions.shape)}, k {tuple(k.shape)} and "
                         f"v {tuple(v.shape)} must agree on N")
    OPS["paged_write"](k_pages, v_pages, block_table, rows, positions, k, v)


def dmc_cache_update(k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, rows: torch.Tensor, alpha: torch.Tensor, omega: torch.Tensor,
                     k: torch.Tensor, v: torch.Tensor, open_state: torch.Tensor, open_tokens: torch.Tensor,
                     spare: torch.Tensor | None = None, spare_left: torch.Tensor | None = None) -> torch.Tensor:
    """One DMC decode step (Algorithm 1) for ``rows [N]`` (distinct), in place; returns their lengths after it.

    ``alpha``: the hard decisions as the model gives them (float; ``0.`` appends: close the open slot and start a
    new one with this token; ``1.``: merge the token into the open slot); ``omega``: importances; both hold N
    values, ``[N]`` or ``[B, H_kv]`` (``N = B H_kv`` rows, sequence-major). ``k [N, d]`` or ``[B, H_kv, d]``,
    ``v`` likewise with ``d_v``. ``seq_lens`` holds the rows' lengths before the step: the op adds one for each
    appending row. An append whose row's last page is full starts a page: with ``spare [P]`` (int32 page ids,
    host) and ``spare_left [1]`` (int64, host) it takes ``spare[spare_left - 1]`` (then the one before, in row
    order) into ``block_table`` and counts ``spare_left`` down; without, the caller has assigned that page. The
    open slot's normalised state goes into entry ``seq_lens[row] - 1``. Returns ``lens [N]`` (``seq_lens``' dtype):
    ``seq_lens[rows]`` after the step, what the attention over the rows reads. Raises ValueError, changing
    nothing, when the spare pages are too few or a row would pass its block-table row.

    State of each pool row (fp32): ``open_state [rows, ring, d + d_v + 1]``, per ring slot the omega-weighted key
    and value side by side and their omega last; ``open_tokens [rows]`` int64, the tokens of the open segment.
    ``ring = 1``: exact accumulation; ``ring = w``: the window of the last w tokens (``writes.py``). Inputs already
    in the kernel's dtype and layout are used as they are (no conversion call).
    """
    _check_dmc_inputs(rows, alpha, omega, k, v, open_state, open_tokens)
    return OPS["dmc_cache_update"](k_pages, v_pages, block_table, seq_lens, rows, alpha, omega, k, v,
                                   open_state, open_tokens, spare, spare_left)


def dmc_decode(k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
               rows: torch.Tensor, alpha: torch.Tensor, omega: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               open_state: torch.Tensor, open_tokens: torch.Tensor, q: torch.Tensor, scale: float,
               spare: torch.Tensor | None = None, spare_left: torch.Tensor | None = None) -> torch.Tensor:
    """A layer's DMC decode step: :func:`dmc_cache_update` (arguments as there), then :func:`paged_attention` of
    ``q [N, G, d]`` (row r's G query heads) over the rows' entries, the new ones included -> ``[N, G, d_v]``. One
    kernel call on CPU with fp32 pages (no block table gathered, no lengths returned); elsewhere the two ops."""
    _check_dmc_inputs(rows, alpha, omega, k, v, open_state, open_tokens)
    if q.dim() != 3 or q.shape[0] != rows.shape[0]:
        raise ValueError(f"q must be [N, G, d] with N = {rows.shape[0]} rows, got {tuple(q.shape)}")
    return OPS["dmc_decode"](k_pages, v_pages, block_table, seq_lens, rows, alpha, omega, k, v,
                             open_state, open_tokens, q, float(scale), spare, spare_left)


def paged_append_decode(k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: torch.Tensor,
                        seq_lens: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor,
                        scale: float, spare: torch.Tensor, spare_left: torch.Tensor) -> torch.Tensor:
    """A layer's decode step of a cache that keeps every token: each of ``rows [N]`` (distinct) appends its new
    entry ``k [N, d]`` / ``v [N, d_v]`` (or ``[B, N / B, ...]``, e.g. strided views of the model's heads) at
    ``seq_lens[row]``, which grows by one (a row whose last page is full first takes ``spare[spare_left - 1]``, as
    :func:`dmc_cache_update`), then :func:`paged_attention` of ``q [N, G, d]`` over the rows -> ``[N, G, d_v]``. One
    kernel call on CPU with fp32 pages; elsewhere tensor ops and the attention op. Raises ValueError, changing
    nothing, when the spare pages are too few or a row would pass its block-table row."""
    if q.dim() != 3 or not (q.shape[0] == rows.shape[0] == k.shape[:-1].numel() == v.shape[:-1].numel()):
        raise ValueError(f"q must be [N, G, d] and k, v hold N entries for the N = {rows.shape[0]} rows, got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    return OPS["paged_append_decode"](k_pages, v_pages, block_table, seq_lens, rows, k, v, q,
                                      float(scale), spare, spare_left)


def decode_attention(k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     heads: tuple[int, int], scale: float, spare: torch.Tensor | None,
                     spare_left: torch.Tensor | None,
                     open_state: torch.Tensor | None = None,
                     open_tokens: torch.Tensor | None = None) -> DecodeAttention | None:
    """A layer's decode step, :func:`paged_append_decode` (or, with DMC's open-slot state, :func:`dmc_decode`, the
    decisions given per layer: :meth:`DecodeAttention.with_decisions`), as a compiled function that a layer kernel
    calls between its projection and its output (:func:`kernels.layer.layer_decode`,
    :func:`kernels.layer.layer_attend_output`), reading q, k and v from the layer's projected heads ``[B, H + 2
    H_kv, d]`` (``heads = (H, H_kv)``) and writing ``[B, H d_v]``; the rows are given per layer
    (:meth:`DecodeAttention.for_rows`). ``spare`` None: no pages lent, for a cache whose rows are grown and whose
    entries are chosen before the call (an eviction policy's, :meth:`DecodeAttention.at_slots`). None where the
    compiled CPU kernel does not run (:func:`appends_in_attention_call`)."""
    return OPS["decode_attention"](k_pages, v_pages, block_table, seq_lens, heads, float(scale), spare,
                                   spare_left, open_state, open_tokens)


def _check_dmc_inputs(rows, alpha, omega, k, v, open_state, open_tokens) -> None:
    n, width = rows.shape[0], open_state.shape[-1]
    if open_state.dtype != torch.float32 or open_tokens.dtype != torch.int64:
        raise ValueError("the open-slot state must be float32 (open_state) and int64 (open_tokens)")
    if not (alpha.numel() == omega.numel() == k.shape[:-1].numel() == v.shape[:-1].numel() == n
            and width == k.shape[-1] + v.shape[-1] + 1):
        raise ValueError(f"alpha {tuple(alpha.shape)}, omega {tuple(omega.shape)}, k {tuple(k.shape)} and v "
                         f"{tuple(v.shape)} must hold one token for each of the {n} rows, and open_state "
                         f"{tuple(open_state.shape)} d + d_v + 1 values per ring slot")
