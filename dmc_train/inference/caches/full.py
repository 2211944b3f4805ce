"""The full (vanilla) KV cache: every token's key and value, one entry per token per (layer, KV head)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dmc_train.inference.caches.base import DecodeStep, KVCache, TokenInfo


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax attention ``q [b, H, n, d]``, ``k/v [b, H_kv, n, d]`` -> ``[b, H, n, d_v]`` (GQA)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


class FullCache(KVCache):
    """Keeps everything; attention as in training (causal at prefill, over all entries at decode)."""

    name = "full"
    prefill_equals_decode = True
    _table = None  # (rows [layers, B * H_kv], their block table) of the planned steps while the batch is unchanged

    def prefill(self, layer, seq_id, q, k, v, info: TokenInfo):
        n = k.shape[2]
        rows = self.rows[seq_id][layer]
        self.pool.grow(rows, torch.full_like(rows, n))
        pos = torch.arange(n, device=self.device).repeat(self.num_kv_heads)
        self.pool.write(rows.repeat_interleave(n), pos, k[0].reshape(-1, k.shape[-1]), v[0].reshape(-1, v.shape[-1]))
        return causal_attention(q, k, v, self.scale)

    def prefill_varlen(self, layer, seq_ids, q, k, v, info: TokenInfo, lens):
        """Every sequence's rows grown and written at once (one ``grow``, one ``write``); causal attention
        within each sequence."""
        rows = torch.stack([self.rows[s][layer] for s in seq_ids])  # [B, H_kv]
        n = torch.tensor(lens, device=self.device)
        self.pool.grow(rows.flatten(), n.repeat_interleave(self.num_kv_heads))
        token_rows = rows.repeat_interleave(n, dim=0).T.flatten()  # [H_kv * T]: head-major, as k[0] flattens
        self.pool.write(token_rows, info.positions[0].repeat(self.num_kv_heads), k[0].reshape(-1, k.shape[-1]),
                        v[0].reshape(-1, v.shape[-1]))
        bounds = n.cumsum(0).tolist()
        return torch.cat([causal_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], self.scale)
                          for a, b in zip([0] + bounds[:-1], bounds)], dim=2)

    def begin_decode(self, seq_ids):
        """Every row appends one entry, planned once for every layer (:class:`DecodeStep`). Where the backend appends
        in the attention call (the compiled CPU kernel, :attr:`appends_in_call`) the pool lends the pages the rows may
        take (:meth:`lend_step`: a page for every row of a sequence whose last page is full, read from one row per
        sequence). Elsewhere every row grows by one entry here, in one ``grow`` for all layers, and the slots written
        and the attention plan are computed once (every layer's rows of a sequence hold its tokens: equal lengths); a
        row takes a page only every ``page_size``-th step: in the others only the lengths change, and the rows' block
        table (stacked per batch, ``[layers, B * H_kv, pages]``) is the previous step's."""
        if self.appends_in_call:
            self._step = self.lend_step(seq_ids, sum(self.decode_pages_needed(seq_ids)))
            return
        rows = self.step_rows(seq_ids)
        table = self._table[1] if self._table is not None and self._table[0] is rows else None
        lens = self.pool.seq_lens[rows[0]].long()
        grown = lens + 1
        if table is None or bool((lens % self.pool.page_size == 0).any()):  # some row takes a page
            self.pool.grow(rows.flatten(), grown.repeat(self.num_layers))
            table = self.pool.block_table[rows]
            self._table = (rows, table)
        else:
            self.pool.seq_lens[rows] = grown.to(self.pool.seq_lens.dtype)
        self._step = DecodeStep(tuple(seq_ids), rows, flat=self.pool.slots(rows, lens),
                                plan=self.pool.plan_table(table, grown))

    def decode_pages_needed(self, seq_ids):
        """A page for each row of a sequence whose last page is full (one row read per sequence: its rows hold
        equal lengths)."""
        lens = self.pool.seq_lens[self.batch_rows(seq_ids)[:, 0, 0]].tolist()
        return [self.num_layers * self.num_kv_heads if n % self.pool.page_size == 0 else 0 for n in lens]

    def compiled_attention(self, layer, num_heads, positions):
        """In a step with lent pages: the layer's append and attention as the compiled function the layer kernel calls
        (:meth:`step_call`)."""
        return self.step_call(self._step, layer, num_heads)

    def decode(self, layer, seq_ids, q, k, v, info: TokenInfo):
        """The layer's part of the step begun: each row's new entry appended, then the attention over the rows."""
        return self.append_attend(self._step_of(seq_ids), layer, q, k, v).view(q.shape[0], q.shape[1], -1)
