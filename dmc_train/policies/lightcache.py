"""LightCache (anonymous ACL submission; docs/METHODS.md, "LightCache"): the KV cache compressed in the feature
dimension, full-context segment selection, and attention over a window that RoPE numbers afresh.

Per (sequence, layer, KV head), when token t (the newest, whose query attends) has been written:

    global      tokens 0 .. g-1                   full width                  (``global``, default 4)
    compressed  tokens g .. t-l                   k P_k [r_k], v P_v [r_v]    (entry i = token g + i)
    local       tokens max(g, t-l+1) .. t         full width, t included      (``local`` = l)

The query, compressed by the same ``P_k`` and before RoPE, scores every compressed key; the G query
heads of a KV group vote (:func:`select`); each of the ``top_k`` winners brings the ``segment`` entries
around it, overlaps merged; the union is decompressed (``c P^T``, the paper's Eq. 7) and attended
together with the global and local parts as one window ``[global, selected, local]`` in sequence order,
RoPE applied at window positions ``0 .. W-1`` (the query at ``W-1``). The window never holds more than
``global + top_k * segment + local`` entries, whatever the sequence's length, which is how LightCache
stays inside the model's trained positions. Until the local part is full nothing is compressed and the
window is the whole sequence at its own positions: plain causal attention.

The projections come from the weights alone (:func:`principal_directions`): per layer and KV head, the
leading left singular vectors of that head's ``W_k`` (``W_v``) slice, i.e. the principal directions of
the space its keys (values) live in.

Two forms compute the same thing: the engine's paged cache (``inference/caches/lightcache.py``: a block
of new tokens per row, from the pages) and the parallel form :meth:`LightCache.parallel_attention`
(a whole sequence, teacher-forced perplexity); both call :func:`window_attention`. Layouts: rows are
(sequence, KV head) pairs, ``N = b * H_kv`` ordered [sequence, KV head]; queries ``[N, G, T, d]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from dmc_train.errors import ConfigError
from dmc_train.policies.base import check_names, checked_value, option_types

Rotate = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # rope(x [..., d], positions [...]) -> [..., d]
BLOCK_ELEMENTS = 1 << 25  # a block of queries gathers at most about this many window elements


# -- options ----------------------------------------------------------------------------------------
@dataclass
class LightCacheConfig:
    """Options (``--policy-option top_k=4``, ``Engine(..., cache="lightcache", local=128)``). ``r_k`` / ``r_v``:
    compressed key / value width (default head size / 16 and / 2); ``global``: first tokens kept at full
    width; ``local``: last tokens kept at full width (default max positions / 2); ``top_k``: segments
    selected per query (0: none, StreamingLLM with window positions); ``segment``: entries per segment
    (``m``); ``chunk``: prompt tokens per prefill chunk (default min(1024, max positions))."""

    r_k: Optional[int] = None
    r_v: Optional[int] = None
    global_: int = 4  # the option is called ``global`` (a Python keyword)
    local: Optional[int] = None
    top_k: int = 16
    segment: int = 32
    chunk: Optional[int] = None

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> "LightCacheConfig":
        """From user options (``global`` for ``global_``), checked by the policies' schema
        (:func:`~dmc_train.policies.base.make_config`'s name and type checks): one-line error for an unknown option
        or one that is not a whole number."""
        types = option_types(cls, {"global_": "global"})
        check_names(options, types, "lightcache")
        values = {key: checked_value("lightcache", key, value, types[key]) for key, value in options.items()}
        return cls(**{("global_" if key == "global" else key): value for key, value in values.items()})


@dataclass(frozen=True)
class Settings:
    """Resolved options (every field an int) and the note when the window outgrows the model's positions."""

    r_k: int
    r_v: int
    global_: int
    local: int
    top_k: int
    segment: int
    chunk: int
    note: Optional[str] = None

    @property
    def window(self) -> int:
        """The most entries a query attends over."""
        return self.global_ + self.top_k * self.segment + self.local


def resolve(cfg: LightCacheConfig, head_dim: int, max_positions: int) -> Settings:
    """Defaults filled in for a model; one-line :class:`ConfigError` for values that cannot run."""
    r_k = cfg.r_k if cfg.r_k is not None else max(1, head_dim // 16)
    r_v = cfg.r_v if cfg.r_v is not None else max(1, head_dim // 2)
    local = cfg.local if cfg.local is not None else max(1, max_positions // 2)
    chunk = cfg.chunk if cfg.chunk is not None else min(1024, max_positions)
    for name, value in (("r_k", r_k), ("r_v", r_v)):
        if not 1 <= value <= head_dim:
            raise ConfigError(f"lightcache {name}={value} must be in [1, {head_dim}] (the head size)")
    for name, value, low in (("global", cfg.global_, 0), ("local", local, 1), ("top_k", cfg.top_k, 0),
                             ("segment", cfg.segment, 1), ("chunk", chunk, 1)):
        if value < low:
            raise ConfigError(f"lightcache {name}={value} must be >= {low}")
    if cfg.global_ + local > max_positions:
        raise ConfigError(f"lightcache global + local = {cfg.global_ + local} exceeds the model's {max_positions} "
                          f"positions: a row's full-width part cannot hold it; lower local")
    s = Settings(r_k, r_v, cfg.global_, local, cfg.top_k, cfg.segment, chunk)
    if s.window > max_positions:  # runs, but RoPE then leaves its trained range
        note = (f"the lightcache window (global {s.global_} + top_k x segment {s.top_k * s.segment} + local "
                f"{s.local} = {s.window}) is longer than the model's {max_positions} positions, so RoPE leaves its "
                f"trained range; lower local, top_k or segment")
        s = Settings(r_k, r_v, cfg.global_, local, cfg.top_k, cfg.segment, chunk, note)
    return s


# -- projections ------------------------------------------------------------------------------------
def principal_directions(w: torch.Tensor, num_kv_heads: int, r: int) -> torch.Tensor:
    """``w [H_kv * d, hidden]`` (HF layout, ``k = h @ w.T``) -> ``[H_kv, d, r]`` fp64: per KV head the ``r``
    leading left singular vectors of its ``[d, hidden]`` slice (``W = U S V^T``, ``P = U[:, :r]``), found as
    the leading eigenvectors of ``W W^T = U S^2 U^T`` ([d, d]; 6x faster than the SVD of W for Llama 7B)."""
    w = w.double().view(num_kv_heads, -1, w.shape[-1])
    _, vectors = torch.linalg.eigh(w @ w.transpose(1, 2))  # eigenvalues ascending
    return vectors.flip(-1)[..., :r]


@dataclass
class Projections:
    """``k [L, H_kv, d, r_k]``, ``v [L, H_kv, d_v, r_v]``, orthonormal columns. Compress ``x @ P``,
    decompress ``c @ P^T``: together the orthogonal projection onto the top-r subspace."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def from_weights(cls, k_weights: list[torch.Tensor], v_weights: list[torch.Tensor], num_kv_heads: int,
                     r_k: int, r_v: int, dtype: torch.dtype) -> "Projections":
        """From each layer's ``W_k``, ``W_v`` ``[H_kv * d, hidden]``."""
        return cls(torch.stack([principal_directions(w, num_kv_heads, r_k) for w in k_weights]).to(dtype),
                   torch.stack([principal_directions(w, num_kv_heads, r_v) for w in v_weights]).to(dtype))

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def rows(self, layer: int, heads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(P_k [N, d, r_k], P_v [N, d_v, r_v])`` of rows whose KV heads are ``heads [N]``."""
        return self.k[layer, heads], self.v[layer, heads]


def compress(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``x [N, ..., d]`` with ``p [N, d, r]`` -> ``[N, ..., r]`` (Eq. 4)."""
    return (x.flatten(1, -2) @ p).view(*x.shape[:-1], p.shape[-1])


def decompress(c: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``c [N, ..., r]`` with ``p [N, d, r]`` -> ``[N, ..., d]`` (Eq. 7)."""
    return (c.flatten(1, -2) @ p.transpose(1, 2).contiguous()).view(*c.shape[:-1], p.shape[1])


# -- selection --------------------------------------------------------------------------------------
def top_entries(key: torch.Tensor, count: torch.Tensor, k: int) -> torch.Tensor:
    """Indices ``[..., k]`` whose first ``count [...]`` are the entries of ``key [..., C]`` with the largest keys
    (ties: lower index; the rest is padding). Entries that may not be chosen hold -inf; ``count`` <= k <= C and
    <= the finite entries of its row. Entries above the ``count``-th largest key are all in ``topk``; the ones
    equal to it come from a second ``topk``, of their indices, so that ties never depend on ``topk``'s order."""
    values, index = key.topk(k, dim=-1)  # descending: the entries above the count-th come first
    kth = values.gather(-1, (count - 1).clamp(min=0)[..., None])
    above = (values > kth).sum(-1, keepdim=True)
    c = key.shape[-1]
    tied = torch.where(key == kth, torch.arange(c, device=key.device), c).topk(k, dim=-1, largest=False).values
    p = torch.arange(k, device=key.device)
    return torch.where(p < above, index, tied.gather(-1, (p - above).clamp(min=0)))


def select(scores: torch.Tensor, available: torch.Tensor, top_k: int, segment: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The compressed entries each query attends to: ``scores [N, G, T, C]`` (``q P_k . k P_k`` per query
    head), ``available [N, T]`` (entries ``0 .. available-1`` exist for that query) -> ``(index [N, T, S],
    count [N, T])``: the first ``count`` of ``index`` are the entries in increasing order (the rest 0),
    ``S = min(top_k * segment, C)``.

    Voting: each of the G query heads names its ``top_k`` best available entries (ties: lower index);
    the group takes the ``top_k`` entries with the most votes (ties: higher summed score over the heads,
    then lower index). With G = 1 this is the plain top-k. Each chosen entry c brings the ``segment``
    entries ``[s, s + segment)`` with ``s = c - segment // 2`` moved inside ``[0, available)``; overlaps
    merge. Only the heads' ``G * top_k`` candidates are ranked and only the ``S`` selected entries are
    written: the work over all ``C`` entries is the heads' two ``topk``.
    """
    n, g, t, c = scores.shape
    k, on = min(top_k, c), {"device": scores.device}
    if k == 0:
        return torch.zeros(n, t, 0, dtype=torch.long, **on), torch.zeros(n, t, dtype=torch.long, **on)
    count = available.clamp(max=k)  # [N, T] centres
    exists = torch.arange(c, **on) < available[:, None, :, None]  # [N, 1, T, C]
    named = top_entries(scores.masked_fill(~exists, float("-inf")), count[:, None].expand(n, g, t), k)
    valid = (torch.arange(k, **on) < count[..., None, None]).expand(n, t, g, k).reshape(n, t, g * k)
    candidate = torch.where(valid, named.transpose(1, 2).reshape(n, t, g * k), 0)  # [N, T, G * k]
    centre = _vote(scores, candidate, valid, count)
    return _segments(candidate, centre, available, segment, min(top_k * segment, c))


def _vote(scores, candidate, valid, count) -> torch.Tensor:
    """Which of the heads' ``candidate [N, T, M]`` (``valid``: named) the group takes: ``[N, T, M]`` bool, each
    entry once. Ranked among themselves by (votes, summed score, -index), the first ``count [N, T]`` win."""
    n, g, t, _ = scores.shape
    m = candidate.shape[-1]
    same = (candidate[..., :, None] == candidate[..., None, :]) & valid[..., :, None] & valid[..., None, :]
    votes = same.sum(-1)
    summed = scores.gather(-1, candidate[:, None].expand(n, g, t, m)).sum(1)
    first = valid & ~(same & torch.ones(m, m, dtype=torch.bool, device=scores.device).tril(-1)).any(-1)
    v_i, v_j, s_i, s_j = votes[..., :, None], votes[..., None, :], summed[..., :, None], summed[..., None, :]
    lower = candidate[..., None, :] < candidate[..., :, None]
    beats = (v_j > v_i) | ((v_j == v_i) & ((s_j > s_i) | ((s_j == s_i) & lower)))  # [.., i, j]: j ranks above i
    return first & ((beats & first[..., None, :]).sum(-1) < count[..., None])


def _segments(centre_entry, centre, available, segment: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The union of the ``segment``-entry runs around the chosen ``centre_entry [N, T, M]`` (``centre``), packed in
    increasing order: ``(index [N, T, width], count [N, T])``. The runs, in order of their start, each begin past
    the ends of the ones before; packed slot p lies in the first run whose packed end is past p."""
    n, t, m = centre_entry.shape
    limit = available[..., None].expand(n, t, m)  # past every start; the start and end of what is not a centre
    start = torch.minimum((centre_entry - segment // 2).clamp(min=0), (limit - segment).clamp(min=0))
    end = torch.where(centre, torch.minimum(start + segment, limit), limit)
    start, order = torch.where(centre, start, limit).sort(-1)
    end = end.gather(-1, order)
    begin = torch.maximum(start, torch.cat([torch.zeros_like(end[..., :1]), end.cummax(-1).values[..., :-1]], -1))
    length = (end - begin).clamp(min=0)
    ends = length.cumsum(-1)  # packed place just past each run
    slot = torch.arange(width, device=ends.device).expand(n, t, width).contiguous()
    which = torch.searchsorted(ends, slot, right=True).clamp(max=m - 1)
    index = (begin - ends + length).gather(-1, which) + slot
    return torch.where(slot < ends[..., -1:], index, 0), ends[..., -1]


# -- the window -------------------------------------------------------------------------------------
@dataclass
class Context:
    """What a block of queries may see, for ``N`` rows (padded). Full width, before RoPE: ``k [N, F, d]``,
    ``v [N, F, d_v]``, slot ``i < g`` holds token i, slot ``g + j`` token ``recent_start + j``
    (``recent_start [N]``). Compressed: ``kc [N, C, r_k]`` (entry i = token g + i, at least every entry
    the block's queries may select); ``values(index [N, T, S]) -> [N, T, S, r_v]`` fetches compressed values."""

    k: torch.Tensor
    v: torch.Tensor
    recent_start: torch.Tensor
    kc: torch.Tensor
    values: Callable[[torch.Tensor], torch.Tensor]


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x [N, L, c]`` at ``index [N, ...]`` -> ``[N, ..., c]``: a lookup of whole rows of ``c`` in the table
    ``x [N * L, c]`` (on CPU ``embedding`` does it 2-4x faster than advanced indexing)."""
    rows = torch.arange(x.shape[0], device=x.device).view(-1, *([1] * (index.dim() - 1)))
    return torch.nn.functional.embedding(index + rows * x.shape[1], x.reshape(-1, x.shape[-1]))


def window_attention(q: torch.Tensor, t0: torch.Tensor, ctx: Context, pk: torch.Tensor, pv: torch.Tensor,
                     s: Settings, rotate: Rotate, scale: float) -> torch.Tensor:
    """LightCache attention of ``q [N, G, T, d]`` (before RoPE; query j of row n is token ``t0[n] + j``) over
    ``ctx`` -> ``[N, G, T, d_v]``. ``pk [N, d, r_k]``, ``pv [N, d_v, r_v]``: each row's projections.

    Query t attends over its window ``[global, selected, local]`` at window positions ``0 .. W-1`` (query
    at ``W-1``). RoPE depends only on the distance between the query and a key, so each part is rotated
    once at fixed positions and the query once per part: global entry i sits at i (the query at W-1),
    selected entry j at ``n_global + j`` (relative to the query: j against ``n_sel + n_local - 1``), and
    a local token keeps its distance to the query, so local keys and the query take their own token
    positions. Queries go in blocks of about ``BLOCK_ELEMENTS`` gathered elements.
    """
    n, g, t, d = q.shape
    width = s.top_k * s.segment
    selected = width * (pk.shape[-1] * (g + 1) + pv.shape[-1])  # compressed keys, values, the queries against them
    per_query = n * (selected + g * (s.window + t) * 3 + ctx.kc.shape[1] * (3 * g + 6))
    step = max(1, BLOCK_ELEMENTS // max(per_query, 1))
    return torch.cat([_window_block(q[:, :, i: i + step], t0 + i, ctx, pk, pv, s, rotate, scale)
                      for i in range(0, t, step)], dim=2)


def _selected(q, pos, ctx: Context, pk, pv, s: Settings):
    """The selected entries of each query, still compressed and packed in sequence order:
    ``(k [N, T, S, r_k], v [N, T, S, r_v], count [N, T])``."""
    n, g, t, _ = q.shape
    c = ctx.kc.shape[1]
    width = min(s.top_k * s.segment, c)
    if width == 0:
        return ((ctx.kc.new_zeros(n, t, 0, p.shape[-1]) for p in (pk, pv)),
                torch.zeros(n, t, dtype=torch.long, device=q.device))
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = torch.einsum("ngtr,ncr->ngtc", compress(q, pk).to(acc), ctx.kc.to(acc))
    index, count = select(scores, (pos + 1 - s.global_ - s.local).clamp(min=0), s.top_k, s.segment)
    return (gather_rows(ctx.kc, index), ctx.values(index)), count


def _selected_logits(q: torch.Tensor, kc: torch.Tensor, pk: torch.Tensor, rotate: Rotate) -> torch.Tensor:
    """``q [N, G, T, d]`` (rotated, accumulation dtype) against the selected keys ``kc [N, T, S, r_k]``, slot j
    rotated at j -> ``[N, G, T, S]``. Slot j's key is ``R_j (P_k c_j) = (R_j P_k) c_j``: a block of several queries
    per row meets each slot's rotated projection ``[N, S, r_k, d]`` once and the keys stay compressed, rather than
    decompressing and rotating ``T x S`` keys; one query (a decode step) decompresses its own keys."""
    acc, slots = q.dtype, torch.arange(kc.shape[2], device=q.device)
    if q.shape[2] == 1:
        return torch.einsum("ngtd,ntjd->ngtj", q, rotate(decompress(kc, pk), slots).to(acc))
    pk_at = rotate(pk.transpose(1, 2)[:, None], slots[:, None]).to(acc)
    return (torch.einsum("ngtd,njrd->ngtjr", q, pk_at) * kc[:, None].to(acc)).sum(-1)


def _window_block(q, t0, ctx: Context, pk, pv, s: Settings, rotate: Rotate, scale: float) -> torch.Tensor:
    n, g, t, d = q.shape
    glob, loc = s.global_, s.local
    acc = torch.promote_types(q.dtype, torch.float32)  # bf16 / fp16 models attend in fp32
    on = {"device": q.device}
    pos = t0[:, None] + torch.arange(t, **on)  # [N, T] token position of each query
    (k_sel, v_sel), n_sel = _selected(q, pos, ctx, pk, pv, s)
    n_glob = (pos + 1).clamp(max=glob)
    n_loc = (pos + 1 - glob).clamp(min=0, max=loc)

    def query_at(where):  # q rotated at per-query positions [N, T]
        return rotate(q, where[:, None, :]).to(acc)

    # global: window positions 0 .. g-1
    k_glob = rotate(ctx.k[:, :glob], torch.arange(glob, **on)).to(acc)
    logits = [torch.einsum("ngtd,nid->ngti", query_at(n_glob + n_sel + n_loc - 1), k_glob)]
    masks = [torch.arange(glob, **on) < n_glob[..., None]]
    # selected: entry j against the query at n_sel + n_loc - 1
    width = k_sel.shape[2]
    logits.append(_selected_logits(query_at(n_sel + n_loc - 1), k_sel, pk, rotate))
    masks.append(torch.arange(width, **on) < n_sel[..., None])
    # local: tokens first .. first + span - 1 cover every query's local part; own positions
    first = (t0 - loc + 1).clamp(min=glob)  # [N]
    tokens = first[:, None] + torch.arange(t + loc - 1, **on)  # [N, span]
    slots = (glob + tokens - ctx.recent_start[:, None]).clamp(min=0, max=ctx.k.shape[1] - 1)
    k_loc = rotate(gather_rows(ctx.k, slots), tokens).to(acc)
    logits.append(torch.einsum("ngtd,nud->ngtu", query_at(pos), k_loc))
    masks.append((tokens[:, None] <= pos[..., None]) & (tokens[:, None] > pos[..., None] - loc))
    mask = torch.cat(masks, dim=-1)[:, None]  # [N, 1, T, W]
    probs = torch.softmax((torch.cat(logits, dim=-1) * scale).masked_fill(~mask, float("-inf")), dim=-1)
    p_glob, p_sel, p_loc = probs.split([glob, width, tokens.shape[1]], dim=-1)
    # the selected values' weighted sum is taken compressed and decompressed once (c P^T is linear)
    out = (torch.einsum("ngti,nie->ngte", p_glob, ctx.v[:, :glob].to(acc))
           + decompress(torch.einsum("ngtj,ntjr->ngtr", p_sel, v_sel.to(acc)), pv.to(acc))
           + torch.einsum("ngtu,nue->ngte", p_loc, gather_rows(ctx.v, slots).to(acc)))
    return out.to(q.dtype)


# -- the method -------------------------------------------------------------------------------------
class LightCache:
    """LightCache for one model: its settings and projections, and the parallel form. Build it with
    :meth:`from_weights`; ``name`` lets it stand where an eviction policy's scorer does (evaluation)."""

    name = "lightcache"

    def __init__(self, settings: Settings, projections: Projections, scale: float):
        self.settings, self.projections, self.scale = settings, projections, scale

    @classmethod
    def from_weights(cls, options: dict[str, Any], k_weights: list[torch.Tensor], v_weights: list[torch.Tensor],
                     num_kv_heads: int, max_positions: int, scale: float, dtype: torch.dtype) -> "LightCache":
        """``options`` (:class:`LightCacheConfig`) for a model whose layers have ``W_k``, ``W_v``
        ``[H_kv * d, hidden]``."""
        head_dim = k_weights[0].shape[0] // num_kv_heads
        s = resolve(LightCacheConfig.from_options(options), head_dim, max_positions)
        return cls(s, Projections.from_weights(k_weights, v_weights, num_kv_heads, s.r_k, s.r_v, dtype), scale)

    @torch.no_grad()
    def parallel_attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, info: Any):
        """Every query of whole sequences as the engine decodes them: ``q [b, H, n, d]``, ``k [b, H_kv, n, d]``,
        ``v [b, H_kv, n, d_v]`` before RoPE, ``info.rotate`` the model's RoPE -> ``[b, H, n, d_v]``."""
        b, h, n, d = q.shape
        hk, glob = k.shape[1], self.settings.global_
        rows = b * hk
        on = {"device": q.device}
        pk, pv = self.projections.rows(layer, torch.arange(hk, **on).repeat(b))
        kr, vr = k.reshape(rows, n, d).contiguous(), v.reshape(rows, n, -1).contiguous()  # gathered from per block
        vc = compress(vr[:, glob:], pv)
        ctx = Context(kr, vr, torch.full((rows,), glob, **on), compress(kr[:, glob:], pk),
                      lambda index: gather_rows(vc, index))
        out = window_attention(q.reshape(rows, h // hk, n, d), torch.zeros(rows, dtype=torch.long, **on), ctx, pk, pv,
                               self.settings, info.rotate, self.scale)
        return out.reshape(b, h, n, -1)
