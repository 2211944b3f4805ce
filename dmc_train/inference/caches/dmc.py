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
pool lends the step the pages its appends may take (:meth:`PagePool.lend_pages`) and every layer's rows are
taken; a layer is then one call, :func:`kernels.paged.dmc_decode`: the update in the cache's own state (an append
that starts a page takes a lent one; the appends counted in the rows' lengths) and the attention over each row's
own entries. :meth:`DMCCache.end_decode` takes the pages the appends took off the free list (same results as
each layer alone).
**Parallel prefill**: the decisions and the accumulation for the whole prompt in one pass
(:func:`teacher_forced_dmc`, the chunked scan of ``kernels.dmc``), then only the closed slots and the open
slot's state are written — never token by token.
"""

from __future__ import annotations

import torch

from dmc_train.errors import InferenceError
from dmc_train.inference.caches.base import KVCache, TokenInfo
from dmc_train.inference.pool import PageLoan, PagePool
from dmc_train.models.dmc_settings import DMCSettings
from kernels.dmc import dmc_attention, partial_accumulation
from kernels.paged import dmc_cache_update, dmc_decode


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


class DMCCache(KVCache):
    """Algorithm 1 over the page pool (module docstring)."""

    name = "dmc"
    needs_decisions = True
    prefill_equals_decode = True  # the parallel prefill is Algorithm 1's result (tests/inference)

    def __init__(self, pool: PagePool, num_layers: int, num_kv_heads: int, scale: float, settings: DMCSettings):
        super().__init__(pool, num_layers, num_kv_heads, scale)
        self.settings = settings
        self.ring = settings.window if settings.accumulation == "window" else 1
        rows, d, dv = pool.block_table.shape[0], pool.k_pages.shape[-1], pool.v_pages.shape[-1]
        # [rows, ring, d + d_v + 1]: the layout of kernels.paged.dmc_cache_update; open_k, open_v, open_w are views
        self.open_state = torch.zeros(rows, self.ring, d + dv + 1, device=self.device)
        self.open_k = self.open_state[..., :d]  # omega-weighted keys of the open segment (exact: their sum)
        self.open_v = self.open_state[..., d:-1]
        self.open_w = self.open_state[..., -1]  # their omegas (exact: z)
        self.open_tokens = torch.zeros(rows, dtype=torch.long, device=self.device)  # tokens in the open segment

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
        """Once per step for every layer: the pages the step's appends may take are lent (:meth:`lend_step`; the
        base's :meth:`end_decode` takes those they took off the free list) and every layer's rows taken. A layer's
        :meth:`decode` is then one kernel call where one runs (the compiled CPU kernel)."""
        if self._step is not None:
            raise InferenceError("a DMC decode step began before the previous one ended (end_decode)")
        self._step = self.lend_step(seq_ids)

    def compiled_attention(self, layer, num_heads, positions):
        """In a begun step: the layer's update and attention as the compiled function the layer kernel calls after
        the model's decisions (:meth:`step_call` with the open-slot state; the model hands it the layer's
        decisions). Asked only with ``rope_order=post`` (the keys arrive rotated)."""
        return self.step_call(self._step, layer, num_heads, self.open_state, self.open_tokens)

    def decode(self, layer, seq_ids, q, k, v, info: TokenInfo):
        """One token per sequence: Algorithm 1 on each row's open slot, which grows the appending rows by one entry,
        then the attention over them (:func:`kernels.paged.dmc_decode`; ``rope_order=pre``: the update, the open
        slot's entry rotated, then the attention), with the pages the step begun lent."""
        step = self._step_of(seq_ids)
        return self._decode_rows(step.rows[layer], step.loan, q, k, v, info)

    def _decode_rows(self, rows, loan: PageLoan, q, k, v, info: TokenInfo) -> torch.Tensor:
        """:meth:`decode` of the layer's ``rows [B * H_kv]`` with the pages of ``loan``."""
        b, h, _ = q.shape
        q = self.row_queries(q)
        pool = self.pool
        step = (pool.k_pages, pool.v_pages, pool.block_table, pool.seq_lens, rows, info.alpha, info.omega, k, v,
                self.open_state, self.open_tokens)
        if info.rotate is None:
            return dmc_decode(*step, q, self.scale, *loan).view(b, h, -1)
        lens = dmc_cache_update(*step, *loan)  # pre: the open slot's raw average, rotated at the current position
        z = self.open_w[rows].sum(-1, keepdim=True)
        positions = info.positions.repeat_interleave(self.num_kv_heads)
        pool.write(rows, lens - 1, info.rotate(self.open_k[rows].sum(1) / z, positions), self.open_v[rows].sum(1) / z)
        return pool.attend(rows, q, self.scale).view(b, h, -1)
