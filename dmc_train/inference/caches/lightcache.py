"""LightCache in the engine (the rule: ``dmc_train/policies/lightcache.py``): per (sequence, layer, KV head)
the global and local tokens at full width, every older token compressed, on the page pool.

**Two widths, one pool.** Each (sequence, layer, KV head) has two page lists, both from the engine's
one :class:`~dmc_train.inference.pool.PagePool` (one free list, one byte budget, one reservation rule):

- its ordinary pool row (block table, ``seq_lens``): full-width entries, pre-RoPE. Slots ``0 .. g-1``
  hold the global tokens; slots ``g .. g+l-1`` are a ring for the local ones (token ``u >= g`` at slot
  ``g + (u - g) % l``), so the row never holds more than ``g + l`` entries;
- a list of **packed pages** (:class:`PackedPages`): compressed entries, a key ``k P_k`` and a value
  ``v P_v``, ``w = r_k + r_v`` channels. A pool page is a K page ``[page_size, d]`` and a V page
  ``[page_size, d_v]``; packed, the K page holds ``page_size * d // w`` entries and the V page
  ``page_size * d_v // w``, so a compressed token costs ``w`` elements (plus at most one part-filled
  page per row), not ``d + d_v``. Two pools would split the byte budget between widths in advance.

A token is written once at full width and, when it leaves the local window, once compressed (read
from its ring slot, projected, appended to the packed pages; the ring slot then takes the new token):
no re-packing. Keys stay before RoPE; the model hands q and k un-rotated (``rope_in_cache``) and the
rule rotates each query's window at its own positions. A prompt arrives in chunks of ``chunk`` tokens
(``prefill_chunk``), each a continuation of the sequence, so neither the attention nor the model's
activations grow with the prompt, and a prompt may be longer than the model's positions.

``entries(seq)``: tokens held per (layer, KV head) (compressed ones included: LightCache drops none);
``bytes_held(seq)``: both kinds of pages, the per-row state, and the projections (counted for every
sequence, as the paper's compression ratio counts them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from dmc_train.errors import InferenceError, OutOfPages
from dmc_train.inference.caches.base import DecodeStep, KVCache, TokenInfo
from dmc_train.inference.pool import PagePool
from dmc_train.policies.lightcache import Context, LightCache, compress, window_attention


def lightcache_for(model: Any, options: dict[str, Any]) -> LightCache:
    """LightCache (settings, projections from the weights) for a :class:`LlamaForInference`."""
    s = model.shape
    if model.decisions is not None:
        raise InferenceError("the 'lightcache' cache runs on vanilla and GQA checkpoints; this one is a DMC model, "
                             "which compresses with its own cache: use cache='dmc' (or auto)")
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    k_weights = [p.qkv[q: q + kv] for p in model.layers]
    v_weights = [p.qkv[q + kv: q + 2 * kv] for p in model.layers]
    return LightCache.from_weights(options, k_weights, v_weights, s.num_kv_heads, s.max_positions, model.scale,
                                   model.dtype)


class PackedPages:
    """Compressed entries (a key of ``r_k`` and a value of ``r_v`` channels) packed into pages of ``pool``, one
    page list per row (``table [rows, pages]`` int32, -1 = none, widened on demand; ``lens [rows]`` entries).

    Each half of a page (its K page, then its V page) holds ``E`` entries as ``[E, r_k]`` keys followed
    by ``[E, r_v]`` values, ``E = page_size * channels // (r_k + r_v)``, so that scoring reads the
    compressed keys of a row page by page, contiguously. Entry i of a row is entry ``i % per_page`` of
    its page ``i // per_page``: the K half's entries first."""

    def __init__(self, pool: PagePool, r_k: int, r_v: int):
        n = pool.num_pages
        self.pool, self.width = pool, r_k + r_v
        halves = []
        for pages in (pool.k_pages, pool.v_pages):
            flat = pages.view(n, -1)
            e = flat.shape[1] // self.width
            halves.append((e, flat[:, : e * r_k].view(n, e, r_k), flat[:, e * r_k: e * self.width].view(n, e, r_v)))
        (self.in_k, self.kk, self.kv), (in_v, self.vk, self.vv) = halves  # entries, keys, values of each half
        self.per_page = self.in_k + in_v
        rows = pool.block_table.shape[0]
        self.table = torch.full((rows, 1), -1, dtype=torch.int32, device=pool.device)
        self.lens = torch.zeros(rows, dtype=torch.long, device=pool.device)

    def pages_for(self, lens: torch.Tensor) -> torch.Tensor:
        return (lens + self.per_page - 1) // self.per_page

    def pages_needed(self, rows: torch.Tensor, new_lens: torch.Tensor) -> int:
        return int((self.pages_for(new_lens) - self.pages_for(self.lens[rows])).sum())

    def extend(self, rows: torch.Tensor, new_lens: torch.Tensor) -> None:
        """Give ``rows [n]`` room for ``new_lens [n]`` (>= current) entries, taking pool pages."""
        have, need = self.pages_for(self.lens[rows]), self.pages_for(new_lens)
        pool = self.pool
        if int((need - have).sum()) > len(pool.free_pages):
            raise OutOfPages(f"out of KV pages: {int((need - have).sum())} needed, {len(pool.free_pages)} free of "
                             f"{pool.num_pages}")
        if need.numel() and int(need.max()) > self.table.shape[1]:
            wider = torch.full((self.table.shape[0], max(2 * self.table.shape[1], int(need.max()))), -1,
                               dtype=torch.int32, device=pool.device)
            wider[:, : self.table.shape[1]] = self.table
            self.table = wider
        for r, a, b in zip(rows.tolist(), have.tolist(), need.tolist()):
            if b > a:
                self.table[r, a:b] = torch.tensor([pool.free_pages.pop() for _ in range(b - a)], dtype=torch.int32,
                                                  device=pool.device)
        pool.peak_pages = max(pool.peak_pages, pool.used_pages)
        self.lens[rows] = new_lens

    def free(self, rows: torch.Tensor) -> None:
        for r, used in zip(rows.tolist(), self.pages_for(self.lens[rows]).tolist()):
            self.pool.free_pages.extend(self.table[r, :used].tolist())
        self.table[rows] = -1
        self.lens[rows] = 0

    def _where(self, rows: torch.Tensor, index: torch.Tensor):
        page = self.table[rows.view(-1, *([1] * (index.dim() - 1))), index // self.per_page].long()
        slot = index % self.per_page
        return page, slot.clamp(max=self.in_k - 1), (slot - self.in_k).clamp(min=0), slot < self.in_k

    def halves(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Which of the entries ``index [n]`` sit in a page's K half, and which in its V half: two index tensors
        into ``[n]`` (:meth:`write` takes them; a plan computes them before the layers)."""
        in_k = index % self.per_page < self.in_k
        return in_k.nonzero().view(-1), (~in_k).nonzero().view(-1)

    def write(self, rows: torch.Tensor, index: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              halves: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Store ``key [n, r_k]``, ``value [n, r_v]`` as entry ``index [n]`` of ``rows [n]`` (already extended;
        ``halves``: :meth:`halves` of ``index``)."""
        page, in_k_slot, in_v_slot, _ = self._where(rows, index)
        for keys, values, slot, part in ((self.kk, self.kv, in_k_slot, halves[0]),
                                         (self.vk, self.vv, in_v_slot, halves[1])):
            keys[page[part], slot[part]] = key[part].to(keys.dtype)
            values[page[part], slot[part]] = value[part].to(values.dtype)

    def keys(self, rows: torch.Tensor, count: int) -> torch.Tensor:
        """The first ``count`` compressed keys of ``rows [N]`` -> ``[N, count, r_k]``, read page by page (entries
        past a row's length are garbage: callers mask them)."""
        pages = self.table[rows, : -(-count // self.per_page)].long()  # [N, P]; -1 (none) reads garbage
        return torch.cat([self.kk[pages], self.vk[pages]], dim=2).flatten(1, 2)[:, :count]

    def values(self, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Compressed values ``index [N, ...]`` of ``rows [N]`` -> ``[N, ..., r_v]`` (garbage past a row's length)."""
        page, in_k_slot, in_v_slot, in_k = self._where(rows, index)
        return torch.where(in_k[..., None], self.kv[page, in_k_slot], self.vv[page, in_v_slot])


@dataclass
class Block:
    """``T`` new tokens per row, planned before the attention (:meth:`PagedLightCache.plan_block`: the host reads
    and the pages taken are there, none in :meth:`~PagedLightCache._block`), for rows ``[N]``:

    - ``t0 [N]`` int64: tokens each row held before the block (the new ones are ``t0 .. t0 + T - 1``);
    - ``fresh``: the most tokens a row compresses in the block (those leaving its local window, at context slots
      ``g .. g + fresh - 1``); ``count``: the compressed entries the block's queries may read (the most any row
      holds after it);
    - ``leaving [M]``, ``token [M]``, ``entry [M]``: each token compressed in the block, as its row (index into
      ``[N]``), its place among its row's leaving tokens (``< fresh``) and its compressed entry; ``halves``: which
      of them sit in a packed page's K half and which in its V half (:meth:`PackedPages.halves`)."""

    t0: torch.Tensor
    fresh: int
    count: int
    leaving: torch.Tensor
    token: torch.Tensor
    entry: torch.Tensor
    halves: tuple[torch.Tensor, torch.Tensor]


@dataclass
class LightCacheStep(DecodeStep):
    """A decode step of LightCache: its rows ``[layers, N]`` and the one token each takes, planned once for every
    layer (every layer's rows of a sequence hold the same tokens)."""

    block: Optional[Block] = None


class PagedLightCache(KVCache):
    """LightCache over the page pool (module docstring)."""

    name = "lightcache"
    rope_in_cache = True  # the model passes q and k before RoPE, and sequences may outgrow its positions

    def __init__(self, pool: PagePool, num_layers: int, num_kv_heads: int, lightcache: LightCache):
        super().__init__(pool, num_layers, num_kv_heads, lightcache.scale)
        s = lightcache.settings
        self.lightcache, self.settings, self.note = lightcache, s, s.note
        self.prefill_chunk = s.chunk
        if s.global_ + s.local > pool.max_pages_per_row * pool.page_size:
            raise InferenceError(f"lightcache global + local = {s.global_ + s.local} exceeds a pool row "
                                 f"({pool.max_pages_per_row * pool.page_size} entries); lower local")
        self.packed = PackedPages(pool, s.r_k, s.r_v)

    @classmethod
    def build(cls, pool: PagePool, model: Any, options: dict[str, Any]) -> "PagedLightCache":
        return cls(pool, model.shape.num_layers, model.shape.num_kv_heads, lightcache_for(model, options))

    # -- sequences --------------------------------------------------------------------------------
    def release(self, seq_id: int) -> None:
        if seq_id in self.rows:
            self.packed.free(self.rows[seq_id].flatten())
        super().release(seq_id)

    # -- the model's calls ------------------------------------------------------------------------
    def prefill(self, layer, seq_id, q, k, v, info: TokenInfo):
        rows, hk = self.rows[seq_id][layer], self.num_kv_heads
        block = self.plan_block(rows[None], k.shape[2])
        out = self._block(layer, rows, torch.arange(hk, device=self.device), q[0].reshape(hk, -1, *q.shape[2:]),
                          k[0], v[0], info, block)
        return out.reshape(1, -1, *out.shape[2:])

    def begin_decode(self, seq_ids):
        """Every layer's rows take one token each, planned once for all layers (:meth:`plan_block`): the layers
        then read nothing on the host."""
        rows = self.step_rows(seq_ids)
        self._step = LightCacheStep(tuple(seq_ids), rows, block=self.plan_block(rows, 1))

    def decode(self, layer, seq_ids, q, k, v, info: TokenInfo):
        b, h, d = q.shape
        hk = self.num_kv_heads
        step = self._step_of(seq_ids)
        out = self._block(layer, step.rows[layer], torch.arange(hk, device=self.device).repeat(b),
                          q.reshape(b * hk, h // hk, 1, d), k.reshape(b * hk, 1, d), v.reshape(b * hk, 1, -1), info,
                          step.block)
        return out.view(b, h, -1)

    def plan_block(self, rows: torch.Tensor, t: int) -> Block:
        """``t`` new tokens for each of ``rows [R, N]`` (the rows of R layers, whose row ``[i, n]`` holds as many
        tokens as ``[0, n]``): the pages they take, taken now (full-width entries up to ``g + l``, compressed ones
        past it), and what :meth:`_block` needs to know of them (:class:`Block`). Raises :class:`OutOfPages`,
        changing nothing, when fewer pages are free."""
        s, pool, packed = self.settings, self.pool, self.packed
        window, layers, every = s.global_ + s.local, rows.shape[0], rows.flatten()
        c0 = packed.lens[rows[0]]
        t0 = pool.seq_lens[rows[0]].long() + c0  # tokens already in each row
        c1 = (t0 + t - window).clamp(min=0)  # compressed once the block is in
        held, compressed = (t0 + t).clamp(max=window).repeat(layers), c1.repeat(layers)
        needed = pool.pages_needed(every, held) + packed.pages_needed(every, compressed)
        if needed > len(pool.free_pages):
            raise OutOfPages(f"out of KV pages: {needed} needed, {len(pool.free_pages)} free of {pool.num_pages}")
        packed.extend(every, compressed)
        pool.grow(every, held)
        fresh = int((c1 - c0).max()) if len(c0) else 0
        leaving, token = (torch.arange(fresh, device=self.device) < (c1 - c0)[:, None]).nonzero(as_tuple=True)
        entry = c0[leaving] + token
        return Block(t0, fresh, int(c1.max()) if len(c1) else 0, leaving, token, entry, packed.halves(entry))

    def _block(self, layer, rows, heads, q, k, v, info: TokenInfo, block: Block) -> torch.Tensor:
        """The ``T`` new tokens of ``rows [N]`` (KV heads ``heads [N]``) planned as ``block`` (their pages taken):
        ``q [N, G, T, d]``, ``k [N, T, d]``, ``v [N, T, d_v]`` before RoPE -> ``[N, G, T, d_v]``. Reads what the rows
        hold, compresses the tokens leaving the local window, attends, then writes the new tokens."""
        s, packed = self.settings, self.packed
        glob = s.global_
        pk, pv = self.lightcache.projections.rows(layer, heads)
        ctx = self._context(rows, block.t0, k, v)
        if block.fresh:  # tokens leaving the local window in this block: compressed once, into the packed pages
            leaving = (block.leaving, block.token)
            packed.write(rows[block.leaving], block.entry, compress(ctx.k[:, glob: glob + block.fresh], pk)[leaving],
                         compress(ctx.v[:, glob: glob + block.fresh], pv)[leaving], block.halves)
        ctx.kc = packed.keys(rows, block.count)
        ctx.values = lambda index: packed.values(rows, index)
        out = window_attention(q, block.t0, ctx, pk, pv, s, info.rotate, self.scale)
        self._store(rows, block.t0, k, v)
        return out

    def _context(self, rows, t0, k, v) -> Context:
        """The full-width tokens the block may see: the row's global and ring entries, then the new ones."""
        glob, loc = self.settings.global_, self.settings.local
        pool = self.pool
        n, t = k.shape[:2]
        recent_start = (t0 - loc).clamp(min=glob)
        slot = torch.arange(glob + loc, device=self.device)  # context slots of old tokens: position, then pool slot
        position = torch.where(slot < glob, slot, recent_start[:, None] + slot - glob)
        old = position < torch.where(slot < glob, t0.clamp(max=glob)[:, None], t0[:, None])
        pool_slot = torch.where(position < glob, position, glob + (position - glob) % loc)
        page, offset = pool.locate(rows[:, None], pool_slot.masked_fill(~old, 0))  # pages of -1: masked below
        ctx_k = k.new_zeros(n, glob + loc + t, k.shape[-1])
        ctx_v = v.new_zeros(n, glob + loc + t, v.shape[-1])
        ctx_k[:, : glob + loc] = torch.where(old[..., None], pool.k_pages[page, offset], 0)
        ctx_v[:, : glob + loc] = torch.where(old[..., None], pool.v_pages[page, offset], 0)
        new = t0[:, None] + torch.arange(t, device=self.device)  # [N, T]
        at = torch.where(new < glob, new, glob + new - recent_start[:, None])
        r = torch.arange(n, device=self.device)[:, None]
        ctx_k[r, at], ctx_v[r, at] = k, v
        return Context(ctx_k, ctx_v, recent_start, None, None)

    def _store(self, rows, t0, k, v) -> None:
        """Write the new tokens that end the block in the global part or the local ring (the rows grown)."""
        glob, loc = self.settings.global_, self.settings.local
        t = k.shape[1]
        u = t0[:, None] + torch.arange(t, device=self.device)  # [N, T]
        slot = torch.where(u < glob, u, glob + (u - glob) % loc)
        r = rows[:, None].expand(-1, t)
        if t > loc:  # only the global tokens and the last ``loc`` stay (a decode step's one token always does)
            keep = (u < glob) | (u >= t0[:, None] + t - loc)
            self.pool.write(r[keep], slot[keep], k[keep], v[keep])
        else:
            self.pool.write(r.flatten(), slot.flatten(), k.flatten(0, 1), v.flatten(0, 1))

    def decode_pages_needed(self, seq_ids: list[int]) -> list[int]:
        """A page for a row whose full-width part grows past a page, or whose packed pages are full."""
        rows = self.batch_rows(seq_ids).flatten(1)  # [B, layers * H_kv]
        held = self.pool.seq_lens[rows].long()
        ring_full = held >= self.settings.global_ + self.settings.local
        grow = ~ring_full & (held % self.pool.page_size == 0)
        packed = ring_full & (self.packed.lens[rows] % self.packed.per_page == 0)
        return (grow | packed).sum(1).tolist()

    # -- what is held -----------------------------------------------------------------------------
    def entries(self, seq_id: int) -> torch.Tensor:
        """Tokens held per (layer, KV head), compressed ones included: ``[layers, H_kv]``."""
        rows = self.rows[seq_id]
        return self.pool.seq_lens[rows].long() + self.packed.lens[rows]

    def state_bytes(self, seq_id: int) -> int:
        return self.packed.lens[0].nbytes * self.rows[seq_id].numel()

    def bytes_held(self, seq_id: int) -> dict[str, int]:
        """``pages`` (full-width and packed), ``entries`` (the part of them in use), ``state``, ``projections``
        (the model's, counted for every sequence) and ``total``."""
        pool, packed = self.pool, self.packed
        rows = self.rows[seq_id].flatten()
        compressed = packed.lens[rows]
        pages = (pool.pages_of(rows) + int(packed.pages_for(compressed).sum())) * pool.page_bytes
        used = (int(pool.seq_lens[rows].long().sum()) * (pool.page_bytes // pool.page_size)
                + int(compressed.sum()) * packed.width * pool.k_pages.element_size())
        state, projections = self.state_bytes(seq_id), self.lightcache.projections.nbytes
        return {"pages": pages, "entries": used, "state": state, "projections": projections,
                "total": pages + state + projections}
