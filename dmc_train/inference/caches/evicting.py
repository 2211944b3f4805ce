"""One fixed-budget cache for every eviction policy: the budget, the per-entry state, the victim choice,
the in-place write and the page reservation; the policy itself is a scorer (``dmc_train/policies/``).

Per (sequence, layer, KV head) row of the page pool, ``schedule=decode``:

- **prefill**: causal attention over the whole prompt; the prompt is then compressed once to the
  budget with the scores it produced (the policy's :meth:`~dmc_train.policies.Scorer.prompt_scores`)
  and only the kept entries are written, in position order;
- **decode**: a row below its budget appends. A full row picks its victim (lowest priority outside
  the fixed part) and the new token's key and value overwrite the victim's page entry in place
  (written by the attention call itself, ``append``), so the row never holds more than ``budget``
  entries and never takes another page. The query then attends over the row, and the same attention
  pass returns what the scorer needs (probabilities or logits per entry, summed over the G query
  heads) to update its scores.

``schedule=prefill`` (kvpress's): the prompt is compressed to ``max(1, int(P * (1 - ratio)))``
entries; decoded tokens are appended without eviction.

State beside the pages, per row and entry slot (counted in :meth:`state_bytes`): ``positions``
(int32, -1 = empty), ``scores`` (fp32), ``codes`` (uint8, hashing policies); per row the prompt
length and the generation length (Keyformer's temperature). Layouts ``[rows, budget(, nbytes)]``. A decode step
gathers its rows' state once; between the steps of an unchanged batch it stays in that layout, written back when the
batch changes (a sequence joins or leaves) or the state is read (:meth:`EvictingCache.row_state`, the ``positions``,
``scores``, ``codes`` properties). Subclasses that absorb what is evicted (LESS) override :meth:`absorb`.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Optional

import torch

from dmc_train.inference.caches.base import DecodeStep, HeadsFirst, KVCache, TokenInfo
from dmc_train.inference.pool import PagePool
from dmc_train.policies.base import (
    Entries,
    Scorer,
    Step,
    insert,
    prompt_attention,
    record_keys,
    record_token,
    victim_slots,
)
from dmc_train.policies.parallel import compress_prompt, prompt_keep
from kernels.paged import DecodePlan, decode_attention


@dataclass(kw_only=True)
class EvictionStep(DecodeStep):
    """A :class:`DecodeStep` of the evicting cache, planned once (:meth:`EvictingCache.begin_decode`): its rows were
    grown before the layers (``loan`` None), and beside them the victims and the policy's state.

    Every row of a sequence holds the same number of entries in every layer and KV head (the prompt's kept
    entries, then one more per step until the budget), so the lengths, the rows at their budget and the
    attention plan are the same for all layers.

    - ``lens [N]`` int64: entries before the step, ``new_lens [N]`` after it; ``full [N]`` bool: rows at their
      budget, which overwrite a victim (the others append at ``lens``); ``n_full``: how many (host);
      ``full_rows``: their indices ``[n_full]`` when only some are full and the cache absorbs what it evicts (LESS);
    - ``plan``: built by the first layer that attends through :meth:`~EvictingCache.attend`;
    - ``state``: the per-row state of ``rows``, gathered once (name -> ``[layers, N, ...]``; or the last step's,
      held for an unchanged batch) and held or written back by :meth:`~EvictingCache.end_decode`;
    - ``policy``: the policy's :class:`Step` (built at the first layer, which brings the positions);
    - ``slots [layers, N]``: the entry each row writes (its victim or ``lens``) and ``flat``: its flat page
      slot, for every layer at once when the policy's priority does not read the query (else None: chosen
      layer by layer); ``recorded``: the new token's position (and zero score) already recorded in every layer's
      state at once (:func:`~dmc_train.policies.base.record_token`), only what reads the keys left per layer;
    - ``call``: the layers' write and attention as a compiled function (:meth:`~EvictingCache.compiled_attention`),
      ``scores [layers, N, budget]``: the per-entry scores its calls write for the policy, ``compiled``: the layers
      it ran, whose policy update waits for :meth:`~EvictingCache.end_decode`; ``choosing``: ``slots`` filled layer
      by layer as the compiled calls choose them from each layer's query."""

    lens: torch.Tensor
    new_lens: torch.Tensor
    full: torch.Tensor
    n_full: int
    full_rows: Optional[torch.Tensor]
    state: dict[str, torch.Tensor]
    policy: Optional[Step] = None
    slots: Optional[torch.Tensor] = None
    recorded: bool = False
    scores: Optional[torch.Tensor] = None
    compiled: list[int] = field(default_factory=list)
    choosing: bool = False


class EvictingCache(KVCache):
    """A fixed budget per (sequence, layer, KV head), kept by ``scorer`` (module docstring); ``budget``: entries
    (None with the prefill schedule, which compresses the prompt by its ratio and evicts nothing after)."""

    def __init__(self, pool: PagePool, num_layers: int, num_kv_heads: int, scale: float, scorer: Scorer,
                 budget: Optional[int], context: int):
        super().__init__(pool, num_layers, num_kv_heads, scale)
        self.evicting = scorer.cfg.schedule == "decode"
        if self.evicting:
            scorer.check_budget(budget)
        self.scorer, self.budget, self.name = scorer, budget, scorer.name
        # not an error: a budget as large as the context is the full cache with extra bookkeeping
        self.note = (f"budget {budget} >= the model's {context} positions: {scorer.name} keeps every entry"
                     if self.evicting and budget >= context else None)
        rows = pool.block_table.shape[0]
        width = budget if self.evicting else 0  # the prefill schedule keeps no state past the prompt
        on = {"device": self.device}
        self._positions = torch.full((rows, width), -1, dtype=torch.int32, **on)
        self._scores = torch.zeros(rows, width, **on)
        self._codes = torch.zeros(rows, width, -(-scorer.code_bits // 8), dtype=torch.uint8, **on)
        self.prompt_len = torch.zeros(rows, dtype=torch.int32, **on)
        self.horizon = torch.zeros(rows, dtype=torch.int32, **on)
        self._layer_ids = torch.arange(num_layers, **on)[:, None, None]  # Step.layer of every layer's entries at once

    positions = property(lambda self: self._current("_positions"), doc="``[rows, budget]`` int32: each entry's token "
                         "position, -1 empty (the running rows' written back first, :meth:`row_state`)")
    scores = property(lambda self: self._current("_scores"), doc="``[rows, budget]`` fp32: each entry's score")
    codes = property(lambda self: self._current("_codes"), doc="``[rows, budget, nbytes]`` uint8: hash codes")

    def add(self, seq_id: int, max_new_tokens: int = 0) -> None:
        self._write_back()
        super().add(seq_id, max_new_tokens)
        rows = self.rows[seq_id].flatten()
        self._positions[rows], self._scores[rows], self._codes[rows] = -1, 0, 0
        self.horizon[rows] = max_new_tokens

    def release(self, seq_id: int) -> None:
        self._write_back()  # before the rows are freed: a new sequence may take them
        super().release(seq_id)

    def state_bytes(self, seq_id: int) -> int:
        per_row = sum(t[0].nbytes for t in (self._positions, self._scores, self._codes, self.prompt_len, self.horizon))
        return per_row * self.rows[seq_id].numel()

    wants_evicted = False  # True: read the victims' entries and pass them to absorb()
    _step: Optional[EvictionStep] = None  # the decode step begun
    _facts: Optional[tuple] = None  # (batch rows, heads, prompt_len, horizon) of the running batch (_row_facts)
    _full_plan: Optional[tuple] = None  # (batch rows, plan) of the last step whose rows were all full (_plan)
    _call: Optional[tuple] = None  # (query heads, the compiled write and attention) (_compiled_call)
    _held: Optional[tuple] = None  # (rows, state) of the last step, not yet written back (_finish)

    def row_state(self) -> dict[str, torch.Tensor]:
        """The per-row state a decode step reads and updates (name -> ``[rows, ...]``, the cache's tensors), the
        running rows' written back first: between the steps of an unchanged batch it stays in the steps' gathered
        layout (:meth:`_finish`)."""
        self._write_back()
        return self._state_tensors()

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        """:meth:`row_state` as stored (the running batch's rows possibly behind the held state)."""
        if not self.evicting:
            return {}
        state = {"positions": self._positions, "scores": self._scores}
        if self.scorer.code_bits:
            state["codes"] = self._codes
        return state

    def _current(self, name: str) -> torch.Tensor:
        """The state tensor ``name``, the held rows written back first."""
        self._write_back()
        return getattr(self, name)

    def _write_back(self) -> None:
        """The held state of the last step into the cache's tensors (:meth:`_finish`)."""
        if self._held is not None:
            rows, state = self._held
            self._held = None
            rows = rows.flatten()
            for name, t in self._state_tensors().items():
                t.index_copy_(0, rows, state[name].view(len(rows), *t.shape[1:]).to(t.dtype))

    def absorb(self, layer: int, state: dict[str, torch.Tensor], where: Optional[torch.Tensor], k: torch.Tensor,
               v: torch.Tensor) -> None:
        """Evicted pairs before they are overwritten (LESS): ``k [b, H_kv, m, d]``, ``v [b, H_kv, m, d_v]`` of whole
        sequences (every KV head of a sequence evicts alike), into rows ``where [b * H_kv]`` of ``state`` (the
        per-row state, :meth:`row_state`: the cache's own tensors, or a decode step's gathered ones; ``where``
        None: all of its rows, in order)."""

    def attend(self, step: EvictionStep, layer: int, q: torch.Tensor, scores: Optional[str],
               append: tuple[torch.Tensor, torch.Tensor, torch.Tensor]):
        """:meth:`attend_planned` of ``q [B, H, d]``, ``append`` written first: ``(out [B * H_kv, G, d_v], per-entry
        scores [B * H_kv, L] or None)``; ``scores``: the scorer's kind (``probs``, ``logits``) or None."""
        if scores is None:
            return self.attend_planned(step, layer, q, append), None
        return self.attend_planned(step, layer, q, append, scores=scores)

    def step_plan(self, step: EvictionStep) -> DecodePlan:
        """The attention plan of ``step``'s rows, built once (by the first layer that attends through it)."""
        if step.plan is None:
            step.plan = self._plan(step.rows, step.new_lens, step.n_full)
        return step.plan

    # -- the model's calls ------------------------------------------------------------------------
    def prefill(self, layer, seq_id, q, k, v, info: TokenInfo):
        return self._prefill_prompts(layer, [seq_id], q, k, v)

    def prefill_varlen(self, layer, seq_ids, q, k, v, info: TokenInfo, lens):
        """The prompts of equal length prefilled together (their attention, scores and compression batched, as
        :meth:`prefill` of each: a prompt's scores read its own tokens alone)."""
        starts = [0]
        for n in lens[:-1]:
            starts.append(starts[-1] + n)
        by_len: dict[int, list[int]] = {}
        for i, n in enumerate(lens):
            by_len.setdefault(n, []).append(i)
        if len(by_len) == 1:  # one length: the packed axis is [b, n] (views, no gather)
            b, n = len(lens), lens[0]
            qg, kg, vg = (x[0].unflatten(1, (b, n)).transpose(0, 1) for x in (q, k, v))  # [b, heads, n, d]
            return self._prefill_prompts(layer, seq_ids, qg, kg, vg).transpose(0, 1).reshape(1, q.shape[1], b * n, -1)
        out = q.new_empty(*q.shape[:3], v.shape[-1])
        for n, group in by_len.items():
            first = torch.tensor([starts[i] for i in group], device=q.device)
            tokens = first[:, None] + torch.arange(n, device=q.device)  # [b, n] in the packed axis
            qg, kg, vg = (x[0][:, tokens].transpose(0, 1) for x in (q, k, v))  # [b, heads, n, d]
            out[0][:, tokens] = self._prefill_prompts(layer, [seq_ids[i] for i in group], qg, kg, vg).transpose(0, 1)
        return out

    def _prefill_prompts(self, layer: int, seq_ids: list[int], q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor) -> torch.Tensor:
        """Prompts of ``b`` sequences of equal length ``p``, ``q [b, H, p, d]``, ``k [b, H_kv, p, d]``, ``v [b, H_kv,
        p, d_v]`` -> ``[b, H, p, d_v]``: causal attention, then each row's prompt compressed to the budget with the
        scores it produced and the kept entries written in position order (module docstring)."""
        out, scores = prompt_attention(self.scorer, q, k, v, layer, self.scale)
        rows = torch.stack([self.rows[s][layer] for s in seq_ids]).flatten()  # [N], N = b * H_kv
        b, h, p = k.shape[:3]
        n = b * h
        scores = scores.reshape(n, p)
        keep, fixed = prompt_keep(self.scorer, self.budget, p)
        kept = compress_prompt(self.scorer, scores, keep, fixed, h)  # [N, keep] positions
        k, v = k.reshape(n, p, -1), v.reshape(n, p, -1)
        each = torch.arange(n, device=self.device)[:, None].expand(-1, keep)
        if self.wants_evicted and keep < p:  # every row drops p - keep entries
            dropped = torch.ones(n, p, dtype=torch.bool, device=self.device)
            dropped[each, kept] = False
            rr, jj = dropped.nonzero(as_tuple=True)
            self.absorb(layer, self.row_state(), rows, k[rr, jj].view(b, h, p - keep, -1),
                        v[rr, jj].view(b, h, p - keep, -1))
        self.pool.grow(rows, torch.full_like(rows, keep))
        k_kept = k[each, kept]  # [N, keep, d]
        self.pool.write(rows.repeat_interleave(keep), torch.arange(keep, device=self.device).repeat(n),
                        k_kept.reshape(n * keep, -1), v[each, kept].reshape(n * keep, -1))
        self.prompt_len[rows] = p
        if self.evicting:
            state = self.row_state()
            state["positions"][rows, :keep] = kept.int()
            state["scores"][rows, :keep] = scores.gather(1, kept)
            if self.scorer.code_bits:
                state["codes"][rows, :keep] = self.scorer.codes(k_kept)
        return out

    def begin_decode(self, seq_ids):
        """Once for all layers: the rows below their budget (every row, with the prefill schedule) grow by one
        entry, the attention plan is built, and the per-row state is gathered (:class:`EvictionStep`)."""
        self._step = self._prepare(seq_ids)

    def end_decode(self):
        """Write back the per-row state the step updated (also after a failure: what the layers that ran
        changed, as a per-layer write would have)."""
        step, self._step = self._step, None
        if step is not None:
            self._finish(step)

    def _prepare(self, seq_ids: list[int]) -> EvictionStep:
        """The :class:`EvictionStep` of ``seq_ids``: grows their rows (one ``grow``), gathers the state."""
        rows = self.step_rows(seq_ids)  # [layers, B * H_kv]
        lens = self.pool.seq_lens[rows[0]].long()
        if self.evicting:
            full = lens >= self.budget
            n_full = int(full.sum())
        else:  # the prefill schedule appends every decoded token
            full, n_full = torch.zeros_like(lens, dtype=torch.bool), 0
        new_lens = lens + 1 if n_full == 0 else lens if n_full == len(lens) else lens + (~full).long()
        if n_full < len(lens):
            self.pool.grow(rows.flatten(), new_lens.repeat(self.num_layers))
        full_rows = full.nonzero()[:, 0] if self.wants_evicted and 0 < n_full < len(lens) else None
        if self._held is not None and self._held[0] is rows:  # the last step's batch: its state as it left it
            state = self._held[1]
        else:
            flat = rows.flatten()  # index_select: 2-3x faster than indexing by rows [layers, N] on CPU
            state = {name: t.index_select(0, flat).view(*rows.shape, *t.shape[1:])
                     for name, t in self.row_state().items()}
        step = EvictionStep(seq_ids=tuple(seq_ids), rows=rows, lens=lens, new_lens=new_lens, full=full, n_full=n_full,
                            full_rows=full_rows, state=state)
        if n_full == 0:  # every row appends
            step.slots = lens.expand(self.num_layers, -1)
        return step

    def _flat(self, step: EvictionStep) -> torch.Tensor:
        """``step.flat``: the flat page slot of every layer's ``step.slots`` (computed once)."""
        if step.flat is None:
            step.flat = self.pool.slots(step.rows, step.slots)
        return step.flat

    def _plan(self, rows: torch.Tensor, lens: torch.Tensor, n_full: int) -> DecodePlan:
        """The attention plan of ``rows [layers, N]`` holding ``lens [N]`` entries after the step. While every
        row of an unchanged batch is at its budget nothing grows and no page is taken, so the plan of the last
        such step is reused. An evicting row never holds more than the budget: the bound the plan keeps (the scores'
        width; no read of the lengths on the host)."""
        bound = self.budget if self.evicting else None
        if n_full < len(lens):
            return self.pool.plan(rows, lens, bound)
        cached = self._full_plan
        if cached is None or cached[0] is not self._batch_rows:
            cached = self._full_plan = (self._batch_rows, self.pool.plan(rows, lens, bound))
        return cached[1]

    def _finish(self, step: EvictionStep) -> None:
        """The policy's part of the layers that ran as compiled calls, then the step's per-row state held for the next
        step of the same batch (written back when the batch changes, a sequence joins or leaves, or someone reads the
        state, :meth:`row_state`)."""
        if step.compiled and self.evicting:
            self._update_compiled(step)
        self._held = (step.rows, step.state)

    def _policy_step(self, step: EvictionStep, layer: int, positions: torch.Tensor) -> Step:
        """The policy's :class:`Step` of ``layer`` (what does not depend on the layer is computed once per step, at
        its first layer: then also every layer's victims, when the priority does not read the query, and the new
        token recorded in every layer's state)."""
        if step.policy is None:
            heads, prompt_len, horizon = self._row_facts(step.rows[0])
            t = positions.long().repeat_interleave(self.num_kv_heads)
            step.policy = Step(layer, heads, t, t - prompt_len, horizon, self.num_kv_heads)
            if step.slots is None and not self.scorer.query_priority:
                self._choose_all(step)
            if step.slots is not None:  # every layer's slots are known: one write of the positions for all layers
                record_token(self.scorer, Entries(step.state["positions"], step.state["scores"]), step.slots, t)
                step.recorded = True
        return dataclasses.replace(step.policy, layer=layer)

    def _row_facts(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(heads, prompt_len, horizon)``, each ``[N]`` int64, of ``rows [N]`` (one layer's rows of the decode
        step's batch, ordered [sequence, KV head]; every layer's rows of a sequence share them): each row's KV head,
        its sequence's prompt length and generation length. They change only when a sequence joins or leaves, so
        they are computed again only when the batch's rows (:meth:`batch_rows`) were stacked again."""
        batch = self._batch_rows
        if self._facts is None or self._facts[0] is not batch:
            heads = torch.arange(self.num_kv_heads, device=self.device).repeat(len(rows) // self.num_kv_heads)
            self._facts = (batch, heads, self.prompt_len[rows].long(), self.horizon[rows].long())
        return self._facts[1:]

    def _choose_all(self, step: EvictionStep) -> None:
        """``step.slots`` of every layer at once: one victim choice over the entries of every layer ``[layers, N, L]``
        (the priority reads the entries alone, and ``step.layer`` is each one's index, ``[layers, 1, 1]``)."""
        every_layer = dataclasses.replace(step.policy, layer=self._layer_ids)
        step.slots = self._slots(step, self._entries(step, slice(None)), None, every_layer)  # [layers, N]

    def _slots(self, step: EvictionStep, entries: Entries, q: Optional[torch.Tensor], policy: Step) -> torch.Tensor:
        """The entry ``[..., N]`` each row writes: its victim when full (the priority over ``entries``, with the
        queries ``q [N, G, d]`` when it reads them), else ``lens``."""
        victim = victim_slots(self.scorer, entries, q, policy, self.budget)
        return victim if step.n_full == len(step.lens) else torch.where(step.full, victim, step.lens)

    def _choose(self, step: EvictionStep, layer: int, entries: Entries, q: torch.Tensor,
                policy: Step) -> tuple[torch.Tensor, torch.Tensor]:
        """The entry ``[N]`` each row of layer ``layer`` writes (its victim when full, else ``lens``) and its flat
        page slot ``[N]``: chosen for every layer at once, or here with the layer's ``q [B, H, d]``."""
        if step.slots is not None:
            return step.slots[layer], self._flat(step)[layer]
        slot = self._slots(step, entries, q.reshape(len(step.lens), -1, q.shape[-1]), policy)
        return slot, self.pool.slots(step.rows[layer], slot)

    def compiled_attention(self, layer, num_heads, positions):
        """In a begun step whose evicted entries go nowhere (not LESS): the layer's write of each row's entry at its
        slot and the attention over the rows, with the per-entry scores the policy reads, as the compiled function
        the layer kernel calls (:meth:`kernels.paged.DecodeAttention.at_slots`). When the priority reads the entries
        alone, every layer's victims are chosen and the new token recorded at the first layer (:meth:`_policy_step`);
        when it reads the query (LSH-E) and some row is full, each layer's are chosen from its projected heads
        (:class:`~dmc_train.inference.caches.base.HeadsFirst`, :meth:`_choose_from_heads`). The scores of the layers
        so run are updated at the step's end (:meth:`_update_compiled`), which changes nothing else: a layer's state
        is its own."""
        step = self._step
        if step is None or step.call is False:
            return None
        if step.call is None:
            step.call = self._compiled_call(num_heads) or False
            if not step.call:
                return None
            if self.evicting:
                self._policy_step(step, layer, positions)
                if step.slots is None:  # chosen layer by layer, from the queries
                    step.slots, step.choosing = torch.empty(self.num_layers, len(step.lens), dtype=torch.long,
                                                             device=self.device), True
                if self.scorer.attention is not None:  # zeros: a layer whose call failed adds nothing
                    step.scores = torch.zeros(self.num_layers, len(step.lens), self.budget, device=self.device)
        if step.choosing:
            return HeadsFirst(functools.partial(self._choose_from_heads, step, layer, num_heads))
        step.compiled.append(layer)
        return self._write_at_slots(step, layer)

    def _write_at_slots(self, step: EvictionStep, layer: int):
        """The compiled call of layer ``layer``: its rows written at ``step.slots[layer]``, attended, the scores into
        ``step.scores[layer]``."""
        call = step.call.for_rows(step.rows[layer])
        if step.scores is None:
            return call.at_slots(step.slots[layer])
        return call.at_slots(step.slots[layer], step.scores[layer], self.scorer.attention)

    def _choose_from_heads(self, step: EvictionStep, layer: int, num_heads: int, heads: torch.Tensor):
        """Layer ``layer``'s victims from its queries (a view of its projected heads ``[B, H + 2 H_kv,
        d]``), the new token's position recorded at them, then its compiled call (:meth:`_write_at_slots`)."""
        n = len(step.lens)
        q = heads[:, :num_heads].reshape(n, num_heads // self.num_kv_heads, -1)  # [N, G, d]
        entries, policy = self._entries(step, layer), dataclasses.replace(step.policy, layer=layer)
        slot = self._slots(step, entries, q, policy)
        record_token(self.scorer, entries, slot, policy.t)
        step.slots[layer] = slot
        step.compiled.append(layer)
        return self._write_at_slots(step, layer)

    def _compiled_call(self, num_heads: int):
        """The layers' compiled write and attention (:func:`kernels.paged.decode_attention` without pages to lend,
        built once), or None where it does not run or the step needs more between the attention and the next layer
        (evicted entries to absorb: LESS)."""
        if self.wants_evicted:
            return None
        if self._call is None or self._call[0] != num_heads:
            pool = self.pool
            self._call = (num_heads, decode_attention(pool.k_pages, pool.v_pages, pool.block_table, pool.seq_lens,
                                                      (num_heads, self.num_kv_heads), self.scale, None, None))
        return self._call[1]

    def _update_compiled(self, step: EvictionStep) -> None:
        """After the compiled calls of ``step.compiled``'s layers: their new entries' keys recorded where the policy
        reads them (read back from the pages at their slots) and their scores updated by what the calls' attention
        wrote, as :meth:`_decode_layer` does after its attention; every layer at once when all of them ran so."""
        if len(step.compiled) == self.num_layers:
            parts = [(slice(None), self._layer_ids)]
        else:  # a step that failed part way
            parts = [(layer, layer) for layer in step.compiled]
        for index, layer in parts:
            entries = self._entries(step, index)
            if self.scorer.key_scores or entries.codes is not None:
                keys = self.pool.k_pages.view(-1, self.pool.k_pages.shape[-1])[self._flat(step)[index]]
                record_keys(self.scorer, entries, step.slots[index], keys)
            self.scorer.update(entries, None if step.scores is None else step.scores[index],
                               dataclasses.replace(step.policy, layer=layer))

    def _entries(self, step: EvictionStep, index: int | slice) -> Entries:
        """The per-entry state of layer ``index``'s rows (views of the step's gathered state; a slice: those layers'
        ``[layers, N, L]``)."""
        st = step.state
        return Entries(st["positions"][index], st["scores"][index], st["codes"][index] if "codes" in st else None)

    def decode(self, layer, seq_ids, q, k, v, info: TokenInfo):
        """One layer of the step begun (:meth:`begin_decode`: the rows grown, the state gathered): ``q [B, H, d]``,
        ``k [B, H_kv, d]``, ``v [B, H_kv, d_v]`` -> ``[B, H, d_v]``. A full row's victim is chosen and overwritten in
        place, the others append; then attention and the scores. k and v stay views of the model's heads (the
        append reads them strided)."""
        step = self._step_of(seq_ids)
        b, hk = q.shape[0], self.num_kv_heads
        if not self.evicting:  # prefill schedule: decoded tokens are appended
            return self.attend(step, layer, q, None, (k, v, self._flat(step)[layer]))[0].view(b, -1, v.shape[-1])
        policy = self._policy_step(step, layer, info.positions)
        entries = self._entries(step, layer)
        slot, flat = self._choose(step, layer, entries, q, policy)
        if self.wants_evicted and step.n_full:  # whole sequences are full (every KV head alike)
            gone = flat if step.full_rows is None else flat[step.full_rows]
            self.absorb(layer, {name: t[layer] for name, t in step.state.items()}, step.full_rows,
                        self.pool.k_pages.view(-1, k.shape[-1]).index_select(0, gone).view(-1, hk, 1, k.shape[-1]),
                        self.pool.v_pages.view(-1, v.shape[-1]).index_select(0, gone).view(-1, hk, 1, v.shape[-1]))
        if step.recorded:
            record_keys(self.scorer, entries, slot, k)
        else:
            insert(self.scorer, entries, slot, k, policy.t)
        out, attention = self.attend(step, layer, q, self.scorer.attention, (k, v, flat))  # the new entry written first
        if attention is not None and attention.shape[1] < self.budget:
            attention = torch.nn.functional.pad(attention, (0, self.budget - attention.shape[1]))
        self.scorer.update(entries, attention, policy)
        return out.view(b, -1, out.shape[-1])

    def decode_pages_needed(self, seq_ids: list[int]) -> list[int]:
        """A page for every row below its budget whose last page is full; a full row takes none. Every row of a
        sequence holds the same number of entries (:class:`EvictionStep`): one row is read per sequence."""
        lens = self.pool.seq_lens[self.batch_rows(seq_ids)[:, 0, 0]].tolist()
        rows = self.num_layers * self.num_kv_heads
        return [rows if n % self.pool.page_size == 0 and not (self.evicting and n >= self.budget) else 0
                for n in lens]
