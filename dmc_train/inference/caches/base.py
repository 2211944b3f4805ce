"""The interface every KV cache of the engine implements, and what the model hands it per layer.

A cache serves one model and many sequences. It owns the attention over what it keeps, because
what a query may see is the cache's business (DMC's merged slots, a policy's kept entries, LESS's
low-rank state). The model calls, per layer:

    out = cache.prefill(layer, seq_id, q, k, v, info)     # one new sequence, its whole prompt at once
    out = cache.prefill_varlen(layer, seq_ids, q, k, v, info, lens)   # several new ones, packed without padding
    out = cache.decode(layer, seq_ids, q, k, v, info)     # one new token for each of B sequences

and around a decode step's layers ``cache.begin_decode(seq_ids)`` / ``cache.end_decode()``: a cache does there,
once per step, what every layer's ``decode`` shares (the full cache grows all its rows and plans the paged
attention once); ``decode`` runs only inside a step begun for its sequences.

Layouts: prefill ``q [1, H, n, d]``, ``k [1, H_kv, n, d]``, ``v [1, H_kv, n, d_v]`` -> ``[1, H, n, d_v]``;
decode ``q [B, H, d]``, ``k [B, H_kv, d]``, ``v [B, H_kv, d_v]`` -> ``[B, H, d_v]``; varlen prefill: the
prompts of B sequences packed one after the other along the token axis, ``q [1, H, T, d]`` (``T = sum(lens)``),
positions restarting at 0 for each, attention within each sequence only. q and k have RoPE
applied (keys un-rotated with ``info.rotate`` set: DMC ``rope_order=pre``). GQA: query head j reads
KV head ``j // G``, ``G = H / H_kv``.

Storage: each (sequence, layer, KV head) is one row of the shared :class:`~dmc_train.inference.pool.PagePool`
(``self.rows[seq_id]`` is ``[layers, H_kv]``); a cache may also keep a constant-size state per row
(DMC's open slot, a policy's scores, LESS's ``H, z``) and reports it in :meth:`state_bytes`.

Subclasses: ``full.py`` (every token), ``dmc.py`` (Algorithm 1), ``evicting.py`` (every eviction
policy of ``dmc_train/policies``: a fixed budget, the victim overwritten in place), ``less.py`` (a policy's
cache plus a constant-size per-row state fed with the evicted (k, v) pairs), ``lightcache.py`` (LightCache's
compressed widths and window).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from dmc_train.errors import InferenceError, OutOfPages
from dmc_train.inference.pool import PageLoan, PagePool
from kernels.paged import DecodePlan, appends_in_attention_call, decode_attention, paged_append_decode


@dataclass
class TokenInfo:
    """Per-token facts the model computed beside q, k, v.

    ``positions``: token positions (prefill ``[1, n]``, decode ``[B]``). ``alpha`` / ``omega``: DMC's
    hard decisions (1 = merge into the open slot) and importances, prefill ``[1, H_kv, n]``, decode
    ``[B, H_kv]``, fp32; None for models without DMC. ``rotate(x [..., d], positions)``: set when the
    keys arrive un-rotated (DMC ``rope_order=pre``) and the cache must rotate what it stores.
    """

    positions: torch.Tensor
    alpha: Optional[torch.Tensor] = None
    omega: Optional[torch.Tensor] = None
    rotate: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None

    def tokens(self, part: slice) -> "TokenInfo":
        """The facts of the tokens ``part`` (along the token axis) of a prefill."""
        alpha, omega = (None if t is None else t[..., part] for t in (self.alpha, self.omega))
        return TokenInfo(self.positions[:, part], alpha, omega, self.rotate)


@dataclass
class HeadsFirst:
    """A layer's compiled attention that exists only once the layer's heads do (an eviction policy whose victims read
    the query): the model projects, then ``build(heads [B, H + 2 H_kv, d])`` gives the compiled attention, which runs
    with the layer's output in one call (:meth:`KVCache.compiled_attention`)."""

    build: Callable[[torch.Tensor], Any]


@dataclass
class DecodeStep:
    """One decode step of ``seq_ids``, planned once for every layer (:meth:`KVCache.begin_decode`) and executed layer
    by layer the way the backend chosen for the cache's pages runs appends (:attr:`KVCache.appends_in_call`):

    - ``rows [layers, N]``: every layer's rows (``N = B * H_kv``, sequence-major: row ``b H_kv + j`` is sequence b's
      KV head j);
    - ``loan``: the pages lent to the step (:meth:`KVCache.lend_step`), which rows take as they append inside the
      kernel call (the compiled CPU kernels; DMC on every backend: a row's merge-or-append is decided in the call);
      None when the rows were grown before the layers, their new entries already counted;
    - ``flat [layers, N]``: then the flat page slot each row writes its new entry at (its end, or an eviction
      policy's victim), and ``plan``: the attention plan over the lengths after the step (:meth:`PagePool.plan`);
    - ``call``: the layers' work as a compiled function a layer kernel calls (built by the first layer that asks,
      :meth:`KVCache.step_call`; False where none runs).

    A cache with more to plan extends it (the eviction policies' victims and per-row state:
    :class:`~dmc_train.inference.caches.evicting.EvictionStep`)."""

    seq_ids: tuple
    rows: torch.Tensor
    loan: Optional[PageLoan] = None
    flat: Optional[torch.Tensor] = None
    plan: Optional[DecodePlan] = None
    call: Any = None  # kernels.paged.DecodeAttention, or False where the compiled kernel does not run


class KVCache:
    """Base class: rows per sequence, release, byte accounting, paged decode attention."""

    name = "base"
    needs_decisions = False  # True: the model must pass DMC decisions in TokenInfo
    rope_in_cache = False  # True: q and k arrive before RoPE (the cache numbers positions itself: no length limit)
    prefill_chunk: Optional[int] = None  # a prompt arrives in chunks of this many tokens (None: whole)
    # True: prefilling a prompt followed by generated tokens leaves the cache as prefilling the prompt and
    # decoding them did (full, DMC), so the engine recomputes a preempted request in one prefill; False (an
    # eviction policy chooses differently over a whole prompt than step by step): it prefills the prompt and
    # feeds the generated tokens again through decode steps
    prefill_equals_decode = False

    def __init__(self, pool: PagePool, num_layers: int, num_kv_heads: int, scale: float):
        self.pool, self.num_layers, self.num_kv_heads, self.scale = pool, num_layers, num_kv_heads, scale
        self.device = pool.device  # every tensor of the cache's state lives beside the pages
        # how the backend chosen for the pages runs a step's appends, asked once: inside the attention call, taking
        # lent pages (the compiled CPU kernels), or after the rows were grown before the layers (DecodeStep)
        self.appends_in_call = appends_in_attention_call(pool.device, pool.dtype)
        self.rows: dict[int, torch.Tensor] = {}
        self._batch_key, self._batch_rows = None, None
        self._step_rows = None  # (batch rows, rows [layers, B * H_kv]) while the batch is unchanged (step_rows)

    # -- sequences --------------------------------------------------------------------------------
    def add(self, seq_id: int, max_new_tokens: int = 0) -> None:
        """Give a new sequence its rows (empty until prefill); ``max_new_tokens``: how many tokens it will
        generate at most (0: unknown), for caches whose schedule depends on it."""
        if seq_id in self.rows:
            raise InferenceError(f"sequence {seq_id} is already in the cache")
        self._batch_key = None
        self.rows[seq_id] = self.pool.new_rows(self.num_layers * self.num_kv_heads).view(
            self.num_layers, self.num_kv_heads)

    def release(self, seq_id: int) -> None:
        """Return a sequence's pages and rows to the pool (when its request ends or fails)."""
        rows = self.rows.pop(seq_id, None)
        self._batch_key = None
        if rows is not None:
            self.pool.free_rows(rows.flatten())

    # -- the model's calls ------------------------------------------------------------------------
    def prefill(self, layer: int, seq_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                info: TokenInfo) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, layer: int, seq_ids: list[int], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               info: TokenInfo) -> torch.Tensor:
        raise NotImplementedError

    def begin_decode(self, seq_ids: list[int]) -> None:
        """A decode step of ``seq_ids`` starts (its layers' :meth:`decode` calls follow, in order): a cache plans it
        here, once for every layer (``self._step``, a :class:`DecodeStep`)."""

    def end_decode(self) -> None:
        """The decode step ended (or failed): the step planned dropped, its lent pages settled (:meth:`end_step`)."""
        step, self._step = self._step, None
        self.end_step(step)

    _step: Optional[DecodeStep] = None  # the decode step begun

    def _step_of(self, seq_ids: list[int]) -> DecodeStep:
        """The decode step :meth:`begin_decode` began for ``seq_ids``: a layer's :meth:`decode` runs inside one."""
        step = self._step
        if step is None or step.seq_ids != tuple(seq_ids):
            raise InferenceError(f"decode of sequences {list(seq_ids)} outside a step begun for them "
                                 f"(LlamaForInference.decode begins and ends it)")
        return step

    def compiled_attention(self, layer: int, num_heads: int, positions: torch.Tensor):
        """Layer ``layer``'s work in the decode step begun as a compiled function that the layer's kernel calls
        between its projection and its output (:class:`kernels.layer.CompiledAttention`, over the ``num_heads``
        query heads and this cache's KV heads, the step's tokens at ``positions [B]``: the model then runs the whole
        layer in one call, ``LlamaLayer.decode_with``), a :class:`HeadsFirst` (it needs the projected heads first:
        the model then runs the layer in two calls), or None: the model calls :meth:`decode`."""
        return None

    def prefill_varlen(self, layer: int, seq_ids: list[int], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       info: TokenInfo, lens: list[int]) -> torch.Tensor:
        """The prompts of several new sequences at once, packed: ``q [1, H, T, d]``, ``k/v [1, H_kv, T, d]``,
        sequence ``i`` the ``lens[i]`` tokens after the first ``sum(lens[:i])`` -> ``[1, H, T, d_v]``. Default:
        :meth:`prefill` of each sequence's part (attention never crosses sequences); a cache may batch more."""
        outs, start = [], 0
        for seq_id, n in zip(seq_ids, lens):
            part = slice(start, start + n)
            outs.append(self.prefill(layer, seq_id, q[:, :, part], k[:, :, part], v[:, :, part], info.tokens(part)))
            start += n
        return torch.cat(outs, dim=2)

    def decode_pages_needed(self, seq_ids: list[int]) -> list[int]:
        """Most pages one decode step of each of ``seq_ids`` can take (the engine reserves them up front):
        a page for every row whose last page is full."""
        rows = self.batch_rows(seq_ids).flatten(1)  # [B, layers * H_kv]
        full = self.pool.seq_lens[rows].long() % self.pool.page_size == 0
        return full.sum(1).tolist()

    def step_rows(self, seq_ids: list[int]) -> torch.Tensor:
        """Every layer's rows of ``seq_ids``, ``[layers, B * H_kv]`` (sequence-major, contiguous), kept while the
        batch is unchanged."""
        batch = self.batch_rows(seq_ids)
        if self._step_rows is None or self._step_rows[0] is not batch:
            # contiguous: with one KV head the reshape is a strided view, and the kernels read a layer's rows densely
            self._step_rows = (batch, batch.transpose(0, 1).reshape(self.num_layers, -1).contiguous())
        return self._step_rows[1]

    def lend_step(self, seq_ids: list[int], needed: Optional[int] = None) -> DecodeStep:
        """A decode step of ``seq_ids`` whose layers take the pages their appends need from a loan
        (:meth:`lend_step_pages`; ``needed`` as there); :meth:`end_step` settles it."""
        rows = self.step_rows(seq_ids)
        return DecodeStep(tuple(seq_ids), rows, loan=self.lend_step_pages(rows, needed))

    def end_step(self, step: Optional[DecodeStep]) -> None:
        """The end of ``step`` (also after a failure): the pages its appends took off the free list."""
        if step is not None and step.loan is not None:
            self.pool.settle(step.loan)

    def append_attend(self, step: DecodeStep, layer: int, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor) -> torch.Tensor:
        """Layer ``layer``'s part of an appending ``step``: each row's new entry ``k [B, H_kv, d]``, ``v [B, H_kv,
        d_v]`` stored (in the kernel call with the step's lent pages, or at its planned slot), then the attention of
        ``q [B, H, d]`` over the rows, new entries included -> ``[B * H_kv, G, d_v]``."""
        if step.loan is None:
            return self.attend_planned(step, layer, q, (k, v, step.flat[layer]))
        pool = self.pool
        return paged_append_decode(pool.k_pages, pool.v_pages, pool.block_table, pool.seq_lens, step.rows[layer], k,
                                   v, self.row_queries(q), self.scale, *step.loan)

    def attend_planned(self, step: DecodeStep, layer: int, q: torch.Tensor,
                       append: tuple[torch.Tensor, torch.Tensor, torch.Tensor], **outputs):
        """The attention of ``q [B, H, d]`` over layer ``layer``'s rows of a planned ``step`` (loan None; its plan:
        :meth:`step_plan`), each row's new entry ``append = (k, v, flat slots [N])`` written first -> ``[B * H_kv, G,
        d_v]``, with the per-entry scores and log-sum-exps that ``outputs`` asks for (``scores``, ``return_lse``:
        :meth:`PagePool.attend_planned`)."""
        return self.pool.attend_planned(self.step_plan(step), self.row_queries(q), self.scale, index=layer,
                                        append=append, **outputs)

    def row_queries(self, q: torch.Tensor) -> torch.Tensor:
        """A decode step's queries ``q [B, H, d]`` as the rows attend them: ``[B * H_kv, G, d]`` (row ``b H_kv + j``
        holds sequence b's G query heads of KV head j)."""
        b, h, d = q.shape
        return q.reshape(b * self.num_kv_heads, h // self.num_kv_heads, d)

    def step_plan(self, step: DecodeStep) -> DecodePlan:
        """The attention plan of a planned ``step`` (built in :meth:`begin_decode`; a cache may build it later)."""
        return step.plan

    def step_call(self, step: Optional[DecodeStep], layer: int, num_heads: int,
                  open_state: Optional[torch.Tensor] = None, open_tokens: Optional[torch.Tensor] = None):
        """Layer ``layer``'s part of a ``step`` with lent pages as the compiled function its kernel calls
        (:func:`kernels.paged.decode_attention`: a plain append, or DMC's update with the open-slot state; built once
        per step), or None where none runs (no step, no loan, or not the compiled CPU kernels)."""
        if step is None or step.loan is None or step.call is False:
            return None
        if step.call is None:
            pool = self.pool
            step.call = decode_attention(pool.k_pages, pool.v_pages, pool.block_table, pool.seq_lens,
                                         (num_heads, self.num_kv_heads), self.scale, *step.loan, open_state,
                                         open_tokens) or False
        return step.call.for_rows(step.rows[layer]) if step.call else None

    def lend_step_pages(self, rows: torch.Tensor, needed: Optional[int] = None) -> PageLoan:
        """The pages a decode step's appends over ``rows`` (any shape) may take, lent by the pool
        (:meth:`PagePool.lend_pages`): one for every row whose last page is full, the most a step can take
        (``needed``: that count, when the caller knows it more cheaply). Raises :class:`OutOfPages`, changing
        nothing, when fewer are free."""
        if needed is None:
            needed = int((self.pool.seq_lens[rows] % self.pool.page_size == 0).sum())
        if needed > len(self.pool.free_pages):
            raise OutOfPages(f"out of KV pages: a decode step may take {needed}, {len(self.pool.free_pages)} free of "
                             f"{self.pool.num_pages}")
        return self.pool.lend_pages(needed)

    def prefill_pages_bound(self, n: int) -> int:
        """Most pages a prefill of ``n`` tokens can take: every row of the sequence holding all of them (no
        cache keeps more entries than tokens at prefill; a cache with ``prefill_chunk`` is never batched)."""
        return self.num_layers * self.num_kv_heads * -(-n // self.pool.page_size)

    def batch_rows(self, seq_ids: list[int]) -> torch.Tensor:
        """Rows ``[B, layers, H_kv]`` of ``seq_ids`` (stacked once per batch, reused by every layer)."""
        key = tuple(seq_ids)
        if self._batch_key != key:
            self._batch_key, self._batch_rows = key, torch.stack([self.rows[s] for s in seq_ids])
        return self._batch_rows

    def layer_rows(self, layer: int, seq_ids: list[int]) -> torch.Tensor:
        """Rows ``[B, H_kv]`` of ``layer`` for ``seq_ids``."""
        return self.batch_rows(seq_ids)[:, layer]

    # -- what is held -----------------------------------------------------------------------------
    def entries(self, seq_id: int) -> torch.Tensor:
        """Entries held per (layer, KV head) of ``seq_id``: ``[layers, H_kv]`` (int64)."""
        return self.pool.seq_lens[self.rows[seq_id]].long()

    def state_bytes(self, seq_id: int) -> int:
        """Bytes of per-row state beside the pages (0 for caches without one)."""
        return 0

    def bytes_held(self, seq_id: int) -> dict[str, int]:
        """``pages`` (allocated K/V pages), ``entries`` (the part of them in use), ``state`` and ``total``."""
        rows = self.rows[seq_id].flatten()
        pages = self.pool.pages_of(rows) * self.pool.page_bytes
        used = int(self.pool.seq_lens[rows].long().sum()) * self.pool.page_bytes // self.pool.page_size
        state = self.state_bytes(seq_id)
        return {"pages": pages, "entries": used, "state": state, "total": pages + state}
