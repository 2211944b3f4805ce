"""One fixed-budget cache for every eviction policy: the budget, the per-entry state, the victim choice,
the in-place write and the page reservation; the policy itself is a scorer (``dmc_train/policies/``).

Per (sequence, layer, KV head) row of the page pool, ``schedule=decode``:

- **prefill**: causal attention over the whole prompt; the prompt is then compressed once to the
  budget with the scores it produced (the policy's :meth:`~dmc_train.policies.Scorer.prompt_scores`)
  and only the kept entries are written, in position order;
- **decode**: a row below its budget appends. A full row picks its victim (lowest priority outside
  the fixed part) and the new token's key and value overwrite the victim's page entry in place
  (``pool.write``), so the row never holds more than ``budget`` entries and never takes another
  page. The query then attends over the row, and the same attention pass returns what the scorer
  needs (probabilities or logits per entry, summed over the G query heads) to update its scores.

``schedule=prefill`` (kvpress's): the prompt is compressed to ``max(1, int(P * (1 - ratio)))``
entries; decoded tokens are appended without eviction.

State beside the pages, per row and entry slot (counted in :meth:`state_bytes`): ``positions``
(int32, -1 = empty), ``scores`` (fp32), ``codes`` (uint8, hashing policies); per row the prompt
length and the generation length (Keyformer's temperature). Layouts ``[rows, budget(, nbytes)]``.
Subclasses that absorb what is evicted (LESS) override :meth:`absorb`.
"""

from __future__ import annotations

from typing import Optional

import torch

from dmc_train.inference.caches.base import KVCache, TokenInfo
from dmc_train.inference.caches.full import causal_attention
from dmc_train.inference.pool import PagePool
from dmc_train.policies.base import Entries, Scorer, Step, choose_victims, insert
from dmc_train.policies.parallel import compress_prompt, prompt_keep


class EvictingCache(KVCache):
    """A fixed budget per (sequence, layer, KV head), kept by ``scorer`` (module docstring)."""

    def __init__(self, pool: PagePool, num_layers: int, num_kv_heads: int, scale: float, scorer: Scorer,
                 budget: int, context: int):
        super().__init__(pool, num_layers, num_kv_heads, scale)
        scorer.check_budget(budget)
        self.scorer, self.budget, self.name = scorer, budget, scorer.name
        # not an error: a budget as large as the context is the full cache with extra bookkeeping
        self.note = (f"budget {budget} >= the model's {context} positions: {scorer.name} keeps every entry"
                     if budget >= context else None)
        self.evicting = scorer.cfg.schedule == "decode"
        rows = pool.block_table.shape[0]
        width = budget if self.evicting else 0  # the prefill schedule keeps no state past the prompt
        self.positions = torch.full((rows, width), -1, dtype=torch.int32)
        self.scores = torch.zeros(rows, width)
        self.codes = torch.zeros(rows, width, -(-scorer.code_bits // 8), dtype=torch.uint8)
        self.prompt_len = torch.zeros(rows, dtype=torch.int32)
        self.horizon = torch.zeros(rows, dtype=torch.int32)

    def add(self, seq_id: int, max_new_tokens: int = 0) -> None:
        super().add(seq_id, max_new_tokens)
        rows = self.rows[seq_id].flatten()
        self.positions[rows], self.scores[rows], self.codes[rows] = -1, 0, 0
        self.horizon[rows] = max_new_tokens

    def state_bytes(self, seq_id: int) -> int:
        per_row = sum(t[0].nbytes for t in (self.positions, self.scores, self.codes, self.prompt_len, self.horizon))
        return per_row * self.rows[seq_id].numel()

    wants_evicted = False  # True: read the victims' entries and pass them to absorb()

    def absorb(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Evicted pairs before they are overwritten (LESS): ``rows [b, H_kv]`` (whole sequences: every KV head
        of a sequence evicts alike), ``k [b, H_kv, m, d]``, ``v [b, H_kv, m, d_v]``."""

    def attend(self, layer: int, rows: torch.Tensor, q: torch.Tensor, scores: Optional[str]):
        """Paged attention of ``q [B, H, d]`` over ``rows [B * H_kv]``: ``(out [B * H_kv, G, d_v], per-entry
        scores [B * H_kv, L] or None)``."""
        b, h, d = q.shape
        q = q.reshape(b * self.num_kv_heads, h // self.num_kv_heads, d)
        if scores is None:
            return self.pool.attend(rows, q, self.scale), None
        return self.pool.attend(rows, q, self.scale, scores=scores)

    # -- the model's calls ------------------------------------------------------------------------
    def prefill(self, layer, seq_id, q, k, v, info: TokenInfo):
        out = causal_attention(q, k, v, self.scale)
        rows = self.rows[seq_id][layer]
        h, p = k.shape[1], k.shape[2]
        scores = self.scorer.prompt_scores(q, k, layer)[0]  # [H_kv, P]
        keep, fixed = prompt_keep(self.scorer, self.budget, p)
        kept = compress_prompt(self.scorer, scores, keep, fixed, h)  # [H_kv, keep] positions
        heads = torch.arange(h)[:, None].expand(-1, keep)
        if self.wants_evicted and keep < p:  # every head drops p - keep entries
            dropped = torch.ones(h, p, dtype=torch.bool)
            dropped[heads, kept] = False
            hh, jj = dropped.nonzero(as_tuple=True)
            self.absorb(layer, rows[None], k[0, hh, jj].view(1, h, p - keep, -1), v[0, hh, jj].view(1, h, p - keep, -1))
        self.pool.grow(rows, torch.full_like(rows, keep))
        slots = torch.arange(keep).repeat(h)
        self.pool.write(rows.repeat_interleave(keep), slots, k[0, heads, kept].reshape(h * keep, -1),
                        v[0, heads, kept].reshape(h * keep, -1))
        self.prompt_len[rows] = p
        if self.evicting:
            self.positions[rows, :keep] = kept.int()
            self.scores[rows, :keep] = scores.gather(1, kept)
            if self.scorer.code_bits:
                self.codes[rows, :keep] = self.scorer.codes(k[0, heads, kept])
        return out

    def decode(self, layer, seq_ids, q, k, v, info: TokenInfo):
        b, hk = len(seq_ids), self.num_kv_heads
        rows = self.layer_rows(layer, seq_ids).flatten()
        n = len(rows)
        k, v = k.reshape(n, -1), v.reshape(n, -1)
        lens = self.pool.seq_lens[rows].long()
        if not self.evicting:  # prefill schedule: decoded tokens are appended
            self.pool.grow(rows, lens + 1)
            self.pool.write(rows, lens, k, v)
            return self.attend(layer, rows, q, None)[0].view(b, -1, v.shape[-1])
        t = info.positions.repeat_interleave(hk)
        step = Step(layer, torch.arange(hk).repeat(b), t, t - self.prompt_len[rows].long(),
                    self.horizon[rows].long(), hk)
        entries = Entries(self.positions[rows].long(), self.scores[rows],
                          self.codes[rows] if self.scorer.code_bits else None)
        full, victim = choose_victims(self.scorer, entries, q.reshape(n, -1, q.shape[-1]).float(), step, self.budget)
        slot = torch.where(full, victim, lens)
        if self.wants_evicted and bool(full.any()):  # whole sequences are full (every KV head alike)
            r = full.nonzero()[:, 0]
            page, offset = self.pool.locate(rows[r], victim[r])
            self.absorb(layer, rows[r].view(-1, hk), self.pool.k_pages[page, offset].view(-1, hk, 1, k.shape[-1]),
                        self.pool.v_pages[page, offset].view(-1, hk, 1, v.shape[-1]))
        self.pool.grow(rows, lens + (~full).long())
        self.pool.write(rows, slot, k, v)
        insert(self.scorer, entries, slot, k, t)
        out, attention = self.attend(layer, rows, q, self.scorer.attention)
        if attention is not None:
            attention = torch.nn.functional.pad(attention, (0, self.budget - attention.shape[1]))
        self.scorer.update(entries, attention, step)
        self.positions[rows], self.scores[rows] = entries.positions.int(), entries.scores
        if entries.codes is not None:
            self.codes[rows] = entries.codes
        return out.view(b, -1, out.shape[-1])

    def decode_pages_needed(self, seq_ids: list[int]) -> list[int]:
        """A page for every row below its budget whose last page is full; a full row takes none."""
        if not self.evicting:
            return super().decode_pages_needed(seq_ids)
        lens = self.pool.seq_lens[self.batch_rows(seq_ids).flatten(1)].long()  # [B, layers * H_kv]
        return ((lens % self.pool.page_size == 0) & (lens < self.budget)).sum(1).tolist()
