"""Paged decode ops compiled for the CPU: ``cpu_kernel.c``, built on first use with the system's C compiler.

The PyTorch path (``varlen.py``) gathers every row's pages into a padded copy and attends with batched matmuls;
on CPU that costs a copy of the cache per layer, padding when rows hold different lengths (DMC's heads, an
eviction policy's rows), and a plan of row groups per call. This kernel does what the Triton kernel does on
GPUs: each row reads its own pages in place, in blocks of 16 entries with an online softmax (the row's query
heads sharing each key and value loaded), rows spread over the OpenMP threads (as many as
``torch.get_num_threads()``). Same contract and outputs as
:func:`kernels.paged.paged_attention` (``scores`` "probs" / "logits", ``return_lse``), fp32 only. Beside it,
DMC's decode-step update (:func:`kernels.paged.dmc_cache_update`: Algorithm 1 on each row's open slot, in the
cache's own state, and the slot's entry written) in one call instead of a dozen tensor ops, and a layer's decode
step, the update (DMC's, or a plain append) and the attention, in one call (:func:`kernels.paged.dmc_decode`,
:func:`kernels.paged.paged_append_decode`).

The shared library is compiled once per machine on first use (:mod:`kernels.compiled`: cached in
``$DMC_KERNELS_CACHE``, default ``~/.cache/dmc_train/kernels``) and loaded with ctypes. Without a C compiler (or
if the build fails) :func:`library` warns once and returns None: the PyTorch path runs instead.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Optional

import torch

from kernels import compiled

from ._checks import pack_outputs

SOURCE = Path(__file__).with_name("cpu_kernel.c")
MAX_GROUPS = 256  # query heads per KV head: their running max and sums, a block's logits and partial sums on the stack
SCORE_MODES = {None: 0, "probs": 1, "logits": 2}


@functools.cache
def library() -> Optional[ctypes.CDLL]:
    """The compiled kernel (built on first use, :func:`kernels.compiled.load`), or None (with one warning) when
    it cannot be built here."""
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    dmc_step = [ptr, ptr, ptr, ptr, i64, i64, ptr, i64, i64, i64, ptr, i64, i64, ptr, ptr, ptr, i64, i64, ptr, ptr,
                i64, i64, i64, i64, i64, ptr, ptr]  # DMC_STEP_ARGS
    return compiled.load(SOURCE, "the CPU paged-attention kernel", {
        "paged_decode_f32": [ptr, ptr, ptr, ptr, i64, ptr, i32, i64, i64, i64, i64, i64, ctypes.c_float, ptr, ptr, ptr,
                             i64, i32, i32, ptr, i64, i64, ptr, i64, i64, i64, ptr],
        "dmc_update_f32": dmc_step + [ptr],
        "decode_step_f32": dmc_step + [ptr, i64, ctypes.c_float, ptr, i32],
        "decode_call_f32": [ptr, ptr, ptr, ptr]})


def cpu_kernel_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """True when paged decode attention on tensors of ``device`` and ``dtype`` (the pages') runs this kernel."""
    return device.type == "cpu" and dtype == torch.float32 and library() is not None


def cpu_kernel_fits(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, *_) -> bool:
    """True when this kernel takes these inputs (CPU, fp32, at most :data:`MAX_GROUPS` query heads per row): the fit
    of :func:`kernels.paged.paged_attention`'s inputs."""
    return (q.dtype == k_pages.dtype == v_pages.dtype == torch.float32 and q.shape[1] <= MAX_GROUPS
            and not (q.requires_grad and torch.is_grad_enabled())  # no backward: autograd takes the PyTorch path
            and cpu_kernel_runs(q.device, q.dtype))


def planned_fits(q, k_pages, v_pages, plan, *_) -> bool:
    """The fit of :func:`kernels.paged.paged_attention_planned`'s inputs: a plan that keeps the block table (built
    for a kernel that reads it) and :func:`cpu_kernel_fits`."""
    return plan.groups is None and cpu_kernel_fits(q, k_pages, v_pages)


def paged_attention_planned_cpu(q, k_pages, v_pages, plan, scale: float, scores: str | None = None,
                                return_lse: bool = False, index: int | None = None, append=None):
    """:func:`kernels.paged.paged_attention_planned` by the compiled kernel (:func:`planned_fits`; no checks)."""
    table = plan.block_table if index is None else plan.block_table[index]
    return paged_attention_cpu(q, k_pages, v_pages, table, plan.lens, scale, scores, return_lse, append)


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def paged_attention_cpu(q, k_pages, v_pages, block_table, seq_lens, scale: float, scores: str | None = None,
                        return_lse: bool = False, append=None):
    """:func:`kernels.paged.paged_attention` by the compiled kernel (inputs as there; :func:`cpu_kernel_fits`).
    ``append``: ``(k, v, slots [R])``, each row's new entry (``k [R, d]`` or ``[B, R / B, d]``, e.g. a strided view
    of the model's heads; v likewise), written into the pages (contiguous) at its flat slot by the same call before
    the row is attended (:func:`kernels.paged.paged_attention_planned`)."""
    R, G, d = q.shape
    dv = v_pages.shape[2]
    q, k_pages, v_pages = q.contiguous(), k_pages.contiguous(), v_pages.contiguous()
    k_new, v_new, slots = (None, None, None) if append is None else append
    strides = (0, 0), (0, 0), 1
    if append is not None:
        k_new, v_new = _f32(k_new), _f32(v_new)
        slots = slots if slots.dtype == torch.int64 and slots.is_contiguous() else slots.to(torch.int64).contiguous()
        (inner, *k_strides), (_, *v_strides) = _row_strides(k_new), _row_strides(v_new)
        strides = k_strides, v_strides, inner
    table = block_table if block_table.dtype == torch.int32 else block_table.to(torch.int32)
    if table.stride(-1) != 1:
        table = table.contiguous()
    lens = seq_lens if seq_lens.dtype in (torch.int32, torch.int64) else seq_lens.to(torch.int64)
    lens = lens.contiguous()
    out = torch.empty(R, G, dv, device="cpu")
    lse = torch.empty(R, G, device="cpu") if return_lse else None
    width = int(lens.max()) if scores is not None and R else 0
    s = torch.empty(R, width, device="cpu") if scores is not None else None
    failed = library().paged_decode_f32(
        q.data_ptr(), k_pages.data_ptr(), v_pages.data_ptr(), table.data_ptr(), table.stride(0) if R else 0,
        lens.data_ptr(), lens.dtype == torch.int32, R, G, d, dv, k_pages.shape[1], scale, out.data_ptr(), _ptr(lse),
        _ptr(s), width, SCORE_MODES[scores], torch.get_num_threads(), _ptr(k_new), *strides[0], _ptr(v_new),
        *strides[1], strides[2], _ptr(slots))
    if failed:
        raise MemoryError(f"paged attention on CPU: no memory for the scores of {R} rows of up to {width} entries")
    return pack_outputs(out, s, lse)


def decode_step_fits(k_pages, block_table, seq_lens, open_state=None) -> bool:
    """True when this kernel takes :func:`kernels.paged.dmc_cache_update`'s inputs (or, without ``open_state``,
    :func:`kernels.paged.paged_append_decode`'s): fp32 pages on CPU, the pool's int32 block table and lengths, and
    the state's last dim contiguous."""
    return (block_table.dtype == seq_lens.dtype == torch.int32 and seq_lens.is_contiguous()
            and block_table.stride(-1) == 1 and (open_state is None or open_state.stride(-1) == 1)
            and cpu_kernel_runs(k_pages.device, k_pages.dtype))


def update_fits(k_pages, v_pages, block_table, seq_lens, rows, alpha, omega, k, v, open_state, *_) -> bool:
    """The fit of :func:`kernels.paged.dmc_cache_update`'s inputs (:func:`decode_step_fits`)."""
    return decode_step_fits(k_pages, block_table, seq_lens, open_state)


def dmc_decode_fits(k_pages, v_pages, block_table, seq_lens, rows, alpha, omega, k, v, open_state, open_tokens, q,
                    *_) -> bool:
    """The fit of :func:`kernels.paged.dmc_decode`'s inputs: the update's and the attention's."""
    return decode_step_fits(k_pages, block_table, seq_lens, open_state) and cpu_kernel_fits(q, k_pages, v_pages)


def append_decode_fits(k_pages, v_pages, block_table, seq_lens, rows, k, v, q, *_) -> bool:
    """The fit of :func:`kernels.paged.paged_append_decode`'s inputs: the append's and the attention's."""
    return decode_step_fits(k_pages, block_table, seq_lens) and cpu_kernel_fits(q, k_pages, v_pages)


def decode_attention_fits(k_pages, v_pages, block_table, seq_lens, heads: tuple[int, int], scale, spare, spare_left,
                          open_state=None, open_tokens=None) -> bool:
    """The fit of :func:`kernels.paged.decode_attention`'s inputs: :func:`decode_step_fits`, at most
    :data:`MAX_GROUPS` query heads per KV head."""
    return heads[0] // heads[1] <= MAX_GROUPS and decode_step_fits(k_pages, block_table, seq_lens, open_state)


def _f32(t: torch.Tensor) -> torch.Tensor:
    """``t`` as fp32 with its last dim contiguous: itself when it already is (no tensor call)."""
    if t.dtype != torch.float32:
        t = t.to(torch.float32)
    return t if t.stride(-1) == 1 else t.contiguous()


def _row_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """``(inner, outer stride, inner stride)`` of the rows of ``t [N, c]`` or ``[b, inner, c]``: row r starts at
    ``(r // inner) * outer + (r % inner) * inner_stride``."""
    return (1, t.stride(0), 0) if t.dim() == 2 else (t.shape[1], t.stride(0), t.stride(1))


def _step_args(k_pages, v_pages, block_table, seq_lens, rows, alpha, omega, k, v, open_state, open_tokens, spare,
               spare_left) -> tuple[tuple, tuple]:
    """The arguments of the kernel's decode-step update (``DMC_STEP_ARGS`` in cpu_kernel.c; ``alpha``, ``omega``,
    ``open_state``, ``open_tokens`` None: a plain append) and the tensors they point into (kept alive by the caller
    during the call). Inputs that already have the kernel's dtype and layout are passed as they are."""
    if rows.dtype != torch.int64 or not rows.is_contiguous():
        rows = rows.to(torch.int64).contiguous()
    if alpha is not None:
        alpha, omega = (_f32(t).contiguous() for t in (alpha, omega))  # N values (contiguous(): no call when it is)
    k, v = _f32(k), _f32(v)
    (inner, sk_outer, sk_inner), (_, sv_outer, sv_inner) = _row_strides(k), _row_strides(v)
    state, s_row, s_ring, ring = _state_args(open_state)
    args = (rows.data_ptr(), _ptr(alpha), _ptr(omega), k.data_ptr(), sk_outer, sk_inner, v.data_ptr(), sv_outer,
            sv_inner, inner, state, s_row, s_ring, _ptr(open_tokens), seq_lens.data_ptr(),
            block_table.data_ptr(), block_table.stride(0), block_table.shape[1], k_pages.data_ptr(), v_pages.data_ptr(),
            rows.shape[0], ring, k.shape[-1], v.shape[-1], k_pages.shape[1], *_loan_args(spare, spare_left))
    return args, (rows, alpha, omega, k, v)


def _state_args(open_state: Optional[torch.Tensor]) -> tuple[Optional[int], int, int, int]:
    """``(pointer, row stride, ring stride, ring)`` of DMC's open-slot state ``[rows, ring, width]`` for the kernel, or
    NULL (a plain append)."""
    if open_state is None:
        return None, 0, 0, 1
    return open_state.data_ptr(), open_state.stride(0), open_state.stride(1), open_state.shape[1]


_NO_PAGES = torch.zeros(1, dtype=torch.int32)


def _loan_args(spare: Optional[torch.Tensor], spare_left: Optional[torch.Tensor]) -> tuple[Optional[int], ...]:
    """The kernel's ``spare`` and ``left`` pointers of a page loan (checked: int32 pages, an int64 count). A NULL
    ``spare`` means "the caller assigned the pages", so an empty loan (whose storage may be NULL) points at a page
    the count ``spare_left = 0`` never lets the kernel take."""
    if spare is None:
        return None, None
    if spare.dtype != torch.int32 or not spare.is_contiguous() or spare_left is None or spare_left.dtype != torch.int64:
        raise ValueError("spare pages must be a contiguous int32 tensor with an int64 count spare_left")
    return (spare.data_ptr() if spare.numel() else _NO_PAGES.data_ptr()), spare_left.data_ptr()


def _check_pages_taken(failed: int, spare_left: Optional[torch.Tensor], max_pages: int) -> None:
    """The kernel's decode-step update changed nothing when it failed: say why."""
    if failed == 1:
        raise ValueError(f"the step's appends need more pages than the {int(spare_left)} spare ones left; lend "
                         f"more (PagePool.lend_pages)")
    if failed == 2:
        raise ValueError(f"a row would hold more entries than its block-table row's {max_pages} pages")


def dmc_cache_update_cpu(k_pages, v_pages, block_table, seq_lens, rows, alpha, omega, k, v, open_state,
                         open_tokens, spare=None, spare_left=None) -> torch.Tensor:
    """:func:`kernels.paged.dmc_cache_update` by the compiled kernel (inputs as there; :func:`decode_step_fits`)."""
    args, _alive = _step_args(k_pages, v_pages, block_table, seq_lens, rows, alpha, omega, k, v, open_state,
                              open_tokens, spare, spare_left)
    lens = torch.empty(rows.shape[0], dtype=torch.int32, device="cpu")
    _check_pages_taken(library().dmc_update_f32(*args, lens.data_ptr()), spare_left, block_table.shape[1])
    return lens


def dmc_decode_cpu(k_pages, v_pages, block_table, seq_lens, rows, alpha, omega, k, v, open_state, open_tokens, q,
                   scale: float, spare=None, spare_left=None) -> torch.Tensor:
    """:func:`kernels.paged.dmc_decode` by the compiled kernel (inputs as there; :func:`dmc_decode_fits`)."""
    return decode_step_cpu(k_pages, v_pages, block_table, seq_lens, rows, k, v, q, scale, spare, spare_left, alpha,
                           omega, open_state, open_tokens)


def decode_step_cpu(k_pages, v_pages, block_table, seq_lens, rows, k, v, q, scale: float, spare=None,
                    spare_left=None, alpha=None, omega=None, open_state=None, open_tokens=None) -> torch.Tensor:
    """A layer's decode step in one call of the compiled kernel: each row's update (DMC's with ``alpha``, ``omega``
    and the open-slot state, :func:`kernels.paged.dmc_decode`; without, a plain append,
    :func:`kernels.paged.paged_append_decode`), then its attention (:func:`decode_step_fits` and
    :func:`cpu_kernel_fits`)."""
    args, _alive = _step_args(k_pages, v_pages, block_table, seq_lens, rows, alpha, omega, k, v, open_state,
                              open_tokens, spare, spare_left)
    n, groups, _ = q.shape
    q = q.contiguous()
    out = torch.empty(n, groups, v_pages.shape[-1], device="cpu")
    failed = library().decode_step_f32(*args, q.data_ptr(), groups, scale, out.data_ptr(), torch.get_num_threads())
    _check_pages_taken(failed, spare_left, block_table.shape[1])
    return out


class _DecodeCall(ctypes.Structure):
    """``struct decode_call`` of cpu_kernel.c (same fields, same order)."""

    _fields_ = [("rows", ctypes.c_void_p), ("n", ctypes.c_int64), ("seq_lens", ctypes.c_void_p),
                ("block_table", ctypes.c_void_p), ("table_stride", ctypes.c_int64), ("max_pages", ctypes.c_int64),
                ("k_pages", ctypes.c_void_p), ("v_pages", ctypes.c_void_p), ("page_size", ctypes.c_int64),
                ("d", ctypes.c_int64), ("dv", ctypes.c_int64), ("groups", ctypes.c_int64),
                ("kv_heads", ctypes.c_int64), ("token_stride", ctypes.c_int64), ("spare", ctypes.c_void_p),
                ("left", ctypes.c_void_p), ("alpha", ctypes.c_void_p), ("omega", ctypes.c_void_p),
                ("state", ctypes.c_void_p), ("s_row", ctypes.c_int64), ("s_ring", ctypes.c_int64),
                ("ring", ctypes.c_int64), ("open_tokens", ctypes.c_void_p), ("shift", ctypes.c_void_p),
                ("threshold", ctypes.c_float), ("offset", ctypes.c_float), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("num_threads", ctypes.c_int), ("slots", ctypes.c_void_p),
                ("scores", ctypes.c_void_p), ("scores_width", ctypes.c_int64), ("scores_mode", ctypes.c_int)]


class DecodeAttention:
    """A layer's decode step over a cache's rows (:func:`kernels.paged.paged_append_decode`, or with an open-slot
    state :func:`kernels.paged.dmc_decode`) as a C function a layer kernel calls with its projected heads
    (:func:`kernels.layer.layer_decode`, :func:`kernels.layer.layer_attend_output`): ``function`` (the address of
    ``decode_call_f32``) and ``context`` (the address of its arguments) for the rows given by :meth:`for_rows` (and
    DMC's decisions by :meth:`with_decisions`, or the rule to take them in the call by :meth:`deciding`; or, for a
    cache that chose where each row writes, the entries by :meth:`at_slots`), ``width``
    (``H d_v``, the attention's values per token) and
    :meth:`check` (the call's return code as an error). Built by :func:`kernels.paged.decode_attention`; keeps the
    tensors it points into alive."""

    def __init__(self, k_pages, v_pages, block_table, seq_lens, heads: tuple[int, int], scale: float, spare,
                 spare_left, open_state=None, open_tokens=None):
        (h, kv), d, dv = heads, k_pages.shape[-1], v_pages.shape[-1]
        self._alive = (k_pages, v_pages, block_table, seq_lens, spare, spare_left, open_state, open_tokens)
        self._max_pages, self._spare_left, self._rows, self._decisions = block_table.shape[1], spare_left, None, None
        self._slots = None
        self.width = h * dv
        spare_ptr, left_ptr = _loan_args(spare, spare_left)
        state, s_row, s_ring, ring = _state_args(open_state)
        # the rows, decisions, slots and scores are set per call (for_rows, with_decisions, deciding, at_slots)
        self.call = _DecodeCall(
            seq_lens=seq_lens.data_ptr(), block_table=block_table.data_ptr(), table_stride=block_table.stride(0),
            max_pages=block_table.shape[1], k_pages=k_pages.data_ptr(), v_pages=v_pages.data_ptr(),
            page_size=k_pages.shape[1], d=d, dv=dv, groups=h // kv, kv_heads=kv, token_stride=(h + kv) * d + kv * dv,
            spare=spare_ptr, left=left_ptr, state=state, s_row=s_row, s_ring=s_ring, ring=ring,
            open_tokens=_ptr(open_tokens), scale=scale, num_threads=torch.get_num_threads())
        self.function = ctypes.cast(library().decode_call_f32, ctypes.c_void_p).value
        self.context = ctypes.addressof(self.call)

    def for_rows(self, rows: torch.Tensor) -> "DecodeAttention":
        """Attend over ``rows [B * H_kv]`` (int64, contiguous; sequence-major: row ``b H_kv + j`` is token b's KV head
        j) in the next call."""
        self._rows = rows
        self.call.rows, self.call.n = rows.data_ptr(), rows.shape[0]
        return self

    def with_decisions(self, alpha: torch.Tensor, omega: torch.Tensor) -> "DecodeAttention":
        """DMC's decisions for the rows of the next call: ``alpha``, ``omega`` ``[B, H_kv]`` (fp32, as the model gives
        them; :func:`kernels.paged.dmc_cache_update`)."""
        self._decisions = tuple(_f32(t).contiguous() for t in (alpha, omega))
        self.call.alpha, self.call.omega = (t.data_ptr() for t in self._decisions)
        self.call.shift = None
        return self

    def deciding(self, shift: torch.Tensor, threshold: float, offset: float, eps: float) -> "DecodeAttention":
        """DMC's decisions taken in the call from the decision channel's values before RoPE, which the layer kernel
        hands over (:func:`kernels.layer.layer_decode` with ``channel``): ``alpha = [k_c + shift > threshold]``,
        exactly PyTorch's add and compare; ``omega = sigmoid(mean over the KV head's query heads of q_c + offset) +
        eps``, within a few ulp of :func:`kernels.dmc.decisions.omega` (a scalar sigmoid in C, not PyTorch's
        vectorised one). ``shift [B, H_kv]`` fp32 contiguous: ``-c0``, ``-inf`` at a sequence's first token."""
        self._decisions = (shift,)
        self.call.shift, self.call.threshold, self.call.offset, self.call.eps = shift.data_ptr(), threshold, offset, eps
        self.call.alpha = self.call.omega = None
        return self

    def at_slots(self, slots: torch.Tensor, scores: Optional[torch.Tensor] = None,
                 mode: Optional[str] = None) -> "DecodeAttention":
        """In the next call each row writes its new entry at entry ``slots [n]`` of its row (int64, contiguous; an
        entry its length already counts: an eviction policy's victim, or the entry its row grew by) instead of
        appending; with ``mode`` ("probs" / "logits") the attention also writes each entry's score into ``scores [n,
        L]`` (fp32, contiguous; as :func:`kernels.paged.paged_attention`'s, 0 past a row's length). Built without
        pages to lend (the caller grew the rows)."""
        self._slots = (slots, scores)
        self.call.slots = slots.data_ptr()
        self.call.scores, self.call.scores_width = _ptr(scores), 0 if scores is None else scores.shape[-1]
        self.call.scores_mode = SCORE_MODES[mode]
        return self

    def check(self, code: int) -> None:
        """Raise the error of the call's nonzero ``code`` (nothing changed, but when out of memory)."""
        if code == -1:
            raise MemoryError("paged decode on CPU: no memory for the step's decisions or an entry's scores")
        if code == 3:
            raise ValueError("a DMC decode step needs its decisions: with_decisions(alpha, omega) or deciding(...)")
        _check_pages_taken(code, self._spare_left, self._max_pages)
