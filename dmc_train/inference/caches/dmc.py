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
pages an append may take are reserved and every layer's rows and block tables taken, so a layer takes no page: it
is the update in the cache's own state (:func:`kernels.paged.dmc_cache_update`, which also counts the appends in
the rows' lengths) and the attention over each row's own entries. :meth:`DMCCache.end_decode` returns the unused
pages (same results as each layer alone).
**Parallel prefill**: the decisions and the accumulation for the whole prompt in one pass
(:func:`teacher_forced_dmc`, the chunked scan of ``kernels.dmc``), then only the closed slots and the open
slot's state are written — never token by token.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from dmc_train.inference.caches.base import KVCache, TokenInfo
from dmc_train.inference.pool import PagePool
from dmc_train.models.dmc_settings import DMCSettings
from kernels.dmc import dmc_attention, partial_accumulation
from kernels.paged import dmc_cache_update


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


class _DecodeStep(NamedTuple):
    """What :meth:`DMCCache.begin_decode` prepares for every layer of a decode step: the step's ``seq_ids``, the
    ``reservation`` of :meth:`PagePool.reserve_next`, the rows ``[L, R]`` (``R = B H_kv``, sequence-major) and
    their block tables ``[L, R, pages]`` (final once the pages are reserved: a row grows into its reserved page by
    its length alone)."""

    seq_ids: tuple
    reservation: tuple
    rows: torch.Tensor
    tables: torch.Tensor


class DMCCache(KVCache):
    """Algorithm 1 over the page pool (module docstring)."""

    name = "dmc"
    needs_decisions = True
    prefill_equals_decode = True  # the parallel prefill is Algorithm 1's result (tests/inference)
    _step: Optional[_DecodeStep] = None  # the decode step begun

    def __init__(self, pool: PagePool, num_layers: int, num_kv_heads: int, scale: float, settings: DMCSettings):
        super().__init__(pool, num_layers, num_kv_heads, scale)
        self.settings = settings
        self.ring = settings.window if settings.accumulation == "window" else 1
        rows, d, dv = pool.block_table.shape[0], pool.k_pages.shape[-1], pool.v_pages.shape[-1]
        # [rows, ring, d + d_v + 1]: the layout of kernels.paged.dmc_cache_update; open_k, open_v, open_w are views
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
        (:meth:`PagePool.reserve_next`; :meth:`end_decode` returns the unused ones), and every layer's rows and
        block tables are taken. A layer's :meth:`decode` then updates the cache's own state and attends: two kernel
        calls when the kernels read the block table (the compiled CPU kernels, Triton)."""
        rows = self.batch_rows(seq_ids).transpose(0, 1).reshape(self.num_layers, -1)  # [L, B * H_kv]
        reserved = self.pool.reserve_next(rows.flatten())
        if reserved is not None:  # None: a row at the model's positions, each layer grows its own rows
            self._step = _DecodeStep(tuple(seq_ids), reserved, rows, self.pool.block_table[rows])

    def end_decode(self):
        """Return the reserved pages no row appended to."""
        step, self._step = self._step, None
        if step is not None:
            self.pool.return_unused(step.reservation)

    def decode(self, layer, seq_ids, q, k, v, info: TokenInfo):
        """One token per sequence: Algorithm 1 on each row's open slot (:func:`kernels.paged.dmc_cache_update`,
        which grows the appending rows by one entry and returns the rows' lengths), then the attention over
        them. In a step begun by :meth:`begin_decode` the pages an append takes are reserved; otherwise the layer
        takes them first (:meth:`PagePool.grow_pages`): the same results."""
        step = self._step
        if step is not None and step.seq_ids == tuple(seq_ids):
            rows, table = step.rows[layer], step.tables[layer]
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
