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

from dataclasses import dataclass, fields
from typing import Any, Callable, Optional

import torch

from dmc_train.errors import ConfigError

Rotate = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # rope(x [..., d], positions [...]) -> [..., d]
BLOCK_ELEMENTS = 1 << 23  # a block of queries gathers at most about this many window elements


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
        """From user options (``global`` for ``global_``); one-line error for an unknown one."""
        names = {("global" if f.name == "global_" else f.name): f.name for f in fields(cls)}
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise ConfigError(f"lightcache has no option {unknown[0]!r}; its options are {', '.join(names)}")
        for key, value in options.items():
            whole = isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer()
            if value is not None and not whole:
                raise ConfigError(f"lightcache option {key}={value} must be a whole number")
        return cls(**{names[k]: (None if v is None else int(v)) for k, v in options.items()})


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
    leading left singular vectors of its ``[d, hidden]`` slice (``W = U S V^T``, ``P = U[:, :r]``)."""
    u, _, _ = torch.linalg.svd(w.double().view(num_kv_heads, -1, w.shape[-1]), full_matrices=False)
    return u[..., :r]


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
    return (c.flatten(1, -2) @ p.transpose(1, 2)).view(*c.shape[:-1], p.shape[1])


# -- selection --------------------------------------------------------------------------------------
def select(scores: torch.Tensor, available: torch.Tensor, top_k: int, segment: int) -> torch.Tensor:
    """The compressed entries each query attends to: ``scores [N, G, T, C]`` (``q P_k . k P_k`` per query
    head), ``available [N, T]`` (entries ``0 .. available-1`` exist for that query) -> ``[N, T, C]`` bool.

    Voting: each of the G query heads names its ``top_k`` best available entries (ties: lower index);
    the group takes the ``top_k`` entries with the most votes (ties: higher summed score over the heads,
    then lower index). With G = 1 this is the plain top-k. Each chosen entry c brings the ``segment``
    entries ``[s, s + segment)`` with ``s = c - segment // 2`` moved inside ``[0, available)``; overlaps
    merge (a boolean union, so the selection is already in sequence order).
    """
    n, g, t, c = scores.shape
    k = min(top_k, c)
    if k == 0:
        return torch.zeros(n, t, c, dtype=torch.bool)
    index = torch.arange(c)
    absent = index >= available[..., None]  # [N, T, C]
    scores = scores.masked_fill(absent[:, None], float("-inf"))
    picks = scores.argsort(dim=-1, descending=True, stable=True)[..., :k]  # [N, G, T, k]
    real = picks < available[:, None, :, None]
    votes = torch.zeros(n, g, t, c, dtype=scores.dtype).scatter_(-1, picks, real.to(scores.dtype)).sum(1)  # [N, T, C]
    total = scores.masked_fill(absent[:, None], 0.0).sum(1).masked_fill(absent, float("-inf"))
    by_total = total.argsort(dim=-1, descending=True, stable=True)
    ranked = by_total.gather(-1, votes.gather(-1, by_total).argsort(dim=-1, descending=True, stable=True))
    centres = ranked[..., :k]  # [N, T, k]
    chosen = torch.arange(k) < available.clamp(max=k)[..., None]
    start = (centres - segment // 2).clamp(min=0)
    start = torch.minimum(start, (available[..., None] - segment).clamp(min=0))
    end = torch.minimum(start + segment, available[..., None])
    edges = torch.zeros(n, t, c + 1)
    edges.scatter_add_(-1, start, chosen.float()).scatter_add_(-1, end, -chosen.float())
    return edges.cumsum(-1)[..., :c] > 0.5


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
    """``x [N, L, c]`` at ``index [N, ...]`` -> ``[N, ..., c]``."""
    rows = torch.arange(x.shape[0]).view(-1, *([1] * (index.dim() - 1)))
    return x[rows, index]


def window_attention(q: torch.Tensor, t0: torch.Tensor, ctx: Context, pk: torch.Tensor, pv: torch.Tensor,
                     s: Settings, rotate: Rotate, scale: float) -> torch.Tensor:
    """LightCache attention of ``q [N, G, T, d]`` (before RoPE; query j of row n is token ``t0[n] + j``) over
    ``ctx`` -> ``[N, G, T, d_v]``. ``pk [N, d, r_k]``, ``pv [N, d_v, r_v]``: each row's projections.
    Queries go in blocks so that a block's gathered windows stay near ``BLOCK_ELEMENTS``."""
    n, g, t, d = q.shape
    per_query = n * (s.window * (d + ctx.v.shape[-1]) * 3 + ctx.kc.shape[1] * (3 * g + 6))
    step = max(1, BLOCK_ELEMENTS // max(per_query, 1))
    return torch.cat([_window_block(q[:, :, i: i + step], t0 + i, ctx, pk, pv, s, rotate, scale)
                      for i in range(0, t, step)], dim=2)


def _window_block(q, t0, ctx: Context, pk, pv, s: Settings, rotate: Rotate, scale: float) -> torch.Tensor:
    n, g, t, d = q.shape
    glob, loc = s.global_, s.local
    pos = t0[:, None] + torch.arange(t)  # [N, T] token position of each query
    # the selected compressed entries, packed in sequence order: [N, T, S]
    c = ctx.kc.shape[1]
    available = (pos + 1 - glob - loc).clamp(min=0)
    width = min(s.top_k * s.segment, c)
    if width:
        acc = torch.promote_types(q.dtype, torch.float32)
        scores = torch.einsum("ngtr,ncr->ngtc", compress(q, pk).to(acc), ctx.kc.to(acc))
        chosen = select(scores, available, s.top_k, s.segment)
        index = torch.where(chosen, torch.arange(c), c).sort(-1).values[..., :width]
        sel_ok = index < c
        index = index.clamp(max=c - 1)
        k_sel = decompress(gather_rows(ctx.kc, index), pk)
        v_sel = decompress(ctx.values(index), pv)
    else:
        sel_ok = torch.zeros(n, t, 0, dtype=torch.bool)
        k_sel, v_sel = (x.new_zeros(n, t, 0, x.shape[-1]) for x in (ctx.k, ctx.v))
    # global: slots 0..g-1 up to the query; local: tokens t-l+1..t from g on
    glob_ok = torch.arange(glob) <= pos[..., None]  # [N, T, g]
    tokens = pos[..., None] - loc + 1 + torch.arange(loc)  # [N, T, l]
    loc_ok = tokens >= glob
    slots = (glob + tokens - ctx.recent_start[:, None, None]).clamp(min=0, max=ctx.k.shape[1] - 1)
    keys = torch.cat([ctx.k[:, None, :glob].expand(-1, t, -1, -1), k_sel, gather_rows(ctx.k, slots)], dim=2)
    values = torch.cat([ctx.v[:, None, :glob].expand(-1, t, -1, -1), v_sel, gather_rows(ctx.v, slots)], dim=2)
    ok = torch.cat([glob_ok, sel_ok, loc_ok], dim=2)  # [N, T, W]
    # window positions: each part continues where the previous one ends; the query is the last entry
    n_glob, n_sel, n_loc = glob_ok.sum(-1), sel_ok.sum(-1), loc_ok.sum(-1)
    where = torch.cat([torch.arange(glob).expand(n, t, -1), n_glob[..., None] + torch.arange(k_sel.shape[2]),
                       (n_glob + n_sel - loc + n_loc)[..., None] + torch.arange(loc)], dim=2)
    keys = rotate(keys, where.clamp(min=0))
    query = rotate(q, (n_glob + n_sel + n_loc - 1)[:, None, :])
    acc = torch.promote_types(q.dtype, torch.float32)  # bf16 / fp16 models attend in fp32
    logits = torch.einsum("ngtd,ntwd->ngtw", query.to(acc), keys.to(acc)) * scale
    probs = torch.softmax(logits.masked_fill(~ok[:, None], float("-inf")), dim=-1)
    return torch.einsum("ngtw,ntwd->ngtd", probs, values.to(acc)).to(q.dtype)


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
        pk, pv = self.projections.rows(layer, torch.arange(hk).repeat(b))
        kr, vr = k.reshape(rows, n, d), v.reshape(rows, n, -1)
        vc = compress(vr[:, glob:], pv)
        ctx = Context(kr, vr, torch.full((rows,), glob), compress(kr[:, glob:], pk),
                      lambda index: gather_rows(vc, index))
        out = window_attention(q.reshape(rows, h // hk, n, d), torch.zeros(rows, dtype=torch.long), ctx, pk, pv,
                               self.settings, info.rotate, self.scale)
        return out.reshape(b, h, n, -1)
