"""The DMC cache (Algorithm 1): per (sequence, layer, KV head) the closed slots plus the open slot.

Every row of the page pool holds that head's slots: the closed ones, then the open one (the
normalised running average ``k~ = u / z`` of the open segment, rewritten on every merge). Beside
the pages each row keeps the open slot's exact running state in fp32:

- ``exact`` accumulation: the numerators ``u_k = sum w_i k_i``, ``u_v`` and ``z = sum w_i`` of the
  open segment (ring of size 1, merges add);
- ``window`` accumulation (as the authors' inference): the open segment's last ``w`` omega-weighted
  tokens in a ring of size ``w`` (merges overwrite the oldest), so a segment longer than the window
  drops its oldest token from the sums — inference then equals windowed training.

Decode (one token per sequence): hard decision ``alpha = 1`` merges into the open slot, ``0`` closes
it and appends a new one. **RoPE order** ``pre`` (the authors' order): the keys arrive raw, the open
slot's state stays raw and its page entry is its rotation at the current position; a closed slot
keeps the rotation at its segment's last token. **Once per decode step** (:meth:`DMCCache.begin_decode`): the
pages an append may take are reserved, so a layer takes no page. With kernels that read the block table (the
compiled CPU kernels, Triton) a layer is then two kernel calls, the update in the cache's own state
(:func:`kernels.paged.dmc_cache_update`) and the attention over each row's own entries; on the PyTorch path
the state is gathered and the attention's pages chosen for every layer, so a layer plans only its tail mask.
:meth:`DMCCache.end_decode` writes back and returns the unused pages (same results as each layer alone).
**Parallel prefill**: the decisions and the accumulation for the whole prompt in one pass
(:func:`teacher_forced_dmc`, the chunked scan of ``kernels.dmc``), then only the closed slots and the open
slot's state are written — never token by token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from dmc_train.inference.caches.base import KVCache, TokenInfo
from dmc_train.inference.pool import PagePool
from dmc_train.models.dmc_settings import DMCSettings
from kernels.dmc import dmc_attention, partial_accumulation
from kernels.paged import dmc_cache_update, dmc_open_slot_step, reads_block_table


def teacher_forced_dmc(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, info: TokenInfo, settings: DMCSettings,
                       scale: float):
    """DMC attention over a whole sequence with hard decisions (Fig. 3 = Algorithm 1's visibility).

    ``q [b, H, n, d]``, ``k/v [b, H_kv, n, d]``, ``info.alpha/omega [b, H_kv, n]`` (alpha[..., 0] = 0),
    ``info.positions [b, n]``. With ``info.rotate`` (``rope_order=pre``) the keys are raw: the
    accumulated key of position t is rotated at t. Returns ``(out [b, H, n, d_v], k~ [b, H_kv, n, d], v~)``:
    the outputs and every position's state (keys rotated).
    """
    k_t, v_t = partial_accumulation(k, v, info.alpha, info.omega, mode=settings.accumulation, window=settings.window)
    if info.rotate is not None:
        k_t = info.rotate(k_t, info.positions[:, None])
    out = dmc_attention(q, k_t, v_t, info.alpha, scale=scale, free_channel=settings.channel)
    return out, k_t, v_t


class _KernelStep(NamedTuple):
    """What :meth:`DMCCache.begin_decode` prepares when kernels read the block table: the step's ``seq_ids``, the
    ``reservation`` of :meth:`PagePool.reserve_next`, the rows ``[L, R]`` and their block tables ``[L, R, pages]``
    (final once the pages are reserved: a row grows into its reserved page by its length alone)."""

    seq_ids: tuple
    reservation: tuple
    rows: torch.Tensor
    tables: torch.Tensor


@dataclass
class _DecodeStep:
    """What :meth:`DMCCache.begin_decode` prepares for every layer of a decode step (``L`` layers, ``R = B H_kv``
    rows per layer, sequence-major). ``rows [L, R]``; ``lens [L, R]`` int64: the rows' lengths, set by each
    layer's ``decode`` to those after the step; ``state [L, R, ring, d + d_v + 1]`` and ``tokens [L, R]``: the
    rows' open-slot state, side by side (:func:`kernels.paged.dmc_open_slot_step`), written back by
    ``end_decode``; ``ones [B, H_kv, 1]``: the column that gives a token's omega in the state; ``reserved``: the pages
    :meth:`PagePool.reserve_next` gave (returned by ``end_decode`` if unused). ``layers``: per layer
    ``(rows, lens, grown, merge_slot, append_slot, state, tokens, pages)``, views of the above (no call per layer
    to take them), where ``grown [R]`` is ``lens + 1`` (an append's length), ``merge_slot`` / ``append_slot [R]``
    are the flat page slots of the open slot's entry after a merge (entry ``len - 1``) and after an append (entry
    ``len``, on a reserved page when the last is full), and ``pages [R, n]`` what one attention group reads at the
    step's most entries (None: the layer plans its own groups)."""

    seq_ids: tuple
    rows: torch.Tensor
    lens: torch.Tensor
    state: torch.Tensor
    tokens: torch.Tensor
    ones: torch.Tensor
    reserved: tuple
    layers: list


class DMCCache(KVCache):
    """Algorithm 1 over the page pool (module docstring)."""

    name = "dmc"
    needs_decisions = True
    prefill_equals_decode = True  # the parallel prefill is Algorithm 1's result (tests/inference)
    _step: Optional[_DecodeStep] = None  # the decode step begun (PyTorch attention path)
    _reserved: Optional[_KernelStep] = None  # the decode step begun (kernel path)

    def __init__(self, pool: PagePool, num_layers: int, num_kv_heads: int, scale: float, settings: DMCSettings):
        super().__init__(pool, num_layers, num_kv_heads, scale)
        self.settings = settings
        self.ring = settings.window if settings.accumulation == "window" else 1
        rows, d, dv = pool.block_table.shape[0], pool.k_pages.shape[-1], pool.v_pages.shape[-1]
        # [rows, ring, d + d_v + 1]: the layout of kernels.paged.dmc_cache_update (and of its dmc_open_slot_step, so
        # that the PyTorch path's step gathers and writes back the state in one call); open_k, open_v, open_w: views
        self.open_state = torch.zeros(rows, self.ring, d + dv + 1)
        self.open_k = self.open_state[..., :d]  # omega-weighted keys of the open segment (exact: their sum)
        self.open_v = self.open_state[..., d:-1]
        self.open_w = self.open_state[..., -1]  # their omegas (exact: z)
        self.open_tokens = torch.zeros(rows, dtype=torch.long)  # tokens in the open segment

    def state_bytes(self, seq_id: int) -> int:
        per_row = sum(t[0].nbytes for t in (self.open_k, self.open_v, self.open_w, self.open_tokens))
        return per_row * self.rows[seq_id].numel()

    def prefill(self, layer, seq_id, q, k, v, info: TokenInfo):
        out, k_t, v_t = teacher_forced_dmc(q, k, v, info, self.settings, self.scale)
        rows = self.rows[seq_id][layer]
        alpha, omega = info.alpha[0], info.omega[0]  # [H_kv, n]
        closes = torch.ones_like(alpha, dtype=torch.bool)  # state j is a slot iff token j + 1 appends (or j is last)
        closes[:, :-1] = alpha[:, 1:] == 0
        self.pool.grow(rows, closes.sum(-1))
        h, j = closes.nonzero(as_tuple=True)
        slot = closes.long().cumsum(-1)[h, j] - 1
        self.pool.write(rows[h], slot, k_t[0, h, j], v_t[0, h, j])
        self._start_open_state(rows, k[0], v[0], alpha, omega)
        return out

    def _start_open_state(self, rows, k, v, alpha, omega) -> None:
        """The open slot's state after a prompt: its segment's tokens (the last ``w`` of them in window mode).
        ``k [H_kv, n, d]``, ``alpha / omega [H_kv, n]``."""
        segment = (1 - alpha).cumsum(-1)
        last = segment == segment[:, -1:]
        length = last.sum(-1)
        rank = last.long().cumsum(-1) - 1  # position within the open segment
        keep = last if self.ring == 1 else last & (rank >= (length - self.ring)[:, None])  # exact: sum them all
        h, j = keep.nonzero(as_tuple=True)
        slot = rank[h, j] % self.ring
        w = omega.float()[h, j]
        for name in ("open_k", "open_v", "open_w"):
            getattr(self, name)[rows] = 0
        self.open_k.index_put_((rows[h], slot), w[:, None] * k[h, j].float(), accumulate=True)
        self.open_v.index_put_((rows[h], slot), w[:, None] * v[h, j].float(), accumulate=True)
        self.open_w.index_put_((rows[h], slot), w, accumulate=True)
        self.open_tokens[rows] = length

    def begin_decode(self, seq_ids):
        """Once per step for every layer: each row whose last page is full gets the page an append would take
        (:meth:`PagePool.reserve_next`; :meth:`end_decode` returns the unused ones). When the kernels read each
        row's pages through the block table (the compiled CPU kernels, Triton:
        :func:`kernels.paged.reads_block_table`) that is all: a layer updates the cache's own state and attends
        in two kernel calls. On the PyTorch path the open slot's two possible entries are also located, the
        open-slot state is gathered (written back by :meth:`end_decode`), and the attention's pages are chosen at
        every row's most entries (length + 1): a layer's :meth:`decode` then reads nothing on the host but its
        plan's longest row."""
        rows = self.batch_rows(seq_ids).transpose(0, 1).reshape(self.num_layers, -1)  # [L, B * H_kv]
        reserved = self.pool.reserve_next(rows.flatten())
        if reserved is None:  # a row at the model's positions: per-layer path
            return
        if reads_block_table(self.pool.k_pages.device, self.pool.dtype):
            self._reserved = _KernelStep(tuple(seq_ids), reserved, rows, self.pool.block_table[rows])
            return
        try:
            lens = self.pool.seq_lens[rows].long()
            slots = self.pool.slots(rows[..., None], torch.stack([lens - 1, lens], -1))
            state = self.open_state[rows]
            grown = lens + 1  # an append's length
            tokens, pages = self.open_tokens[rows], self.pool.group_pages(rows, grown)
            views = [rows, lens, grown, *slots.unbind(-1), state, tokens]
            per_layer = zip(*(t.unbind() for t in views), [None] * len(rows) if pages is None else pages.unbind())
            ones = torch.ones(len(seq_ids), self.num_kv_heads, 1, dtype=self.pool.dtype)
            self._step = _DecodeStep(tuple(seq_ids), rows, lens, state, tokens, ones, reserved, list(per_layer))
        except BaseException:
            self.pool.return_unused(reserved)
            raise

    def end_decode(self):
        """Write the step's lengths and open-slot state back (PyTorch path); return the reserved pages no row
        appended to."""
        step, self._step = self._step, None
        reserved, self._reserved = self._reserved, None
        if reserved is not None:
            self.pool.return_unused(reserved.reservation)
        if step is None:
            return
        rows = step.rows
        self.pool.seq_lens[rows] = step.lens.to(torch.int32)
        self.open_state[rows] = step.state
        self.open_tokens[rows] = step.tokens
        self.pool.return_unused(step.reserved)

    def decode(self, layer, seq_ids, q, k, v, info: TokenInfo):
        step = self._step
        if step is None or step.seq_ids != tuple(seq_ids):
            kernel_step = self._reserved
            if kernel_step is not None and kernel_step.seq_ids != tuple(seq_ids):
                kernel_step = None
            return self._decode_layer(layer, seq_ids, q, k, v, info, kernel_step)
        rows, lens, grown, merge_slot, append_slot, state, tokens, pages = step.layers[layer]
        b, h, d = q.shape
        append = torch.logical_not(info.alpha).reshape(-1)  # alpha is 0. or 1.
        lens.copy_(torch.where(append, grown, lens))
        kv1 = torch.cat([k, v, step.ones], -1).view(len(append), -1)
        avg = dmc_open_slot_step(state, tokens, append, info.omega.reshape(-1), kv1)
        k_open, v_open = avg.split([d, avg.shape[1] - d], -1)
        if info.rotate is not None:  # pre: the open slot's raw average, rotated at the current position
            k_open = info.rotate(k_open, info.positions.repeat_interleave(self.num_kv_heads))
        self.pool.write_slots(torch.where(append, append_slot, merge_slot), k_open, v_open)
        plan = self.pool.plan(rows, lens) if pages is None else self.pool.plan_group(pages, rows, lens)
        out = self.pool.attend_planned(plan, q.view(len(append), h // self.num_kv_heads, d), self.scale)
        return out.view(b, h, -1)

    def _decode_layer(self, layer, seq_ids, q, k, v, info: TokenInfo, reserved: Optional[_KernelStep] = None):
        """:meth:`decode` of one layer by :func:`kernels.paged.dmc_cache_update` on the cache's own state, which
        grows the appending rows by one entry and returns the rows' lengths, then the attention over them.
        ``reserved`` (:meth:`begin_decode`'s): the rows already hold the page an append takes, and their rows and
        block tables of every layer were taken once; without it the layer first takes the pages its appends need
        (:meth:`PagePool.grow_pages`): the same results."""
        if reserved is not None:
            rows, table = reserved.rows[layer], reserved.tables[layer]
        else:
            rows = self.layer_rows(layer, seq_ids).flatten()
            self.pool.grow_pages(rows, self.pool.seq_lens[rows] + (info.alpha.reshape(-1) == 0))
            table = self.pool.block_table[rows]
        lens = dmc_cache_update(self.pool.k_pages, self.pool.v_pages, self.pool.block_table, self.pool.seq_lens, rows,
                                info.alpha, info.omega, k, v, self.open_state, self.open_tokens)
        if info.rotate is not None:  # pre: the open slot's raw average, rotated at the current position
            z = self.open_w[rows].sum(-1, keepdim=True)
            positions = info.positions.repeat_interleave(self.num_kv_heads)
            self.pool.write(rows, lens - 1, info.rotate(self.open_k[rows].sum(1) / z, positions),
                            self.open_v[rows].sum(1) / z)
        b, h, d = q.shape
        plan = self.pool.plan_table(table, lens)
        out = self.pool.attend_planned(plan, q.view(len(rows), h // self.num_kv_heads, d), self.scale)
        return out.view(b, h, -1)
