"""DMC (Dynamic Memory Compression) Llama for Hugging Face transformers, loaded with ``trust_remote_code=True``.

Self-contained: imports only torch and transformers (this file is copied next to the weights). The
weights are exactly ``LlamaForCausalLM``'s; only the attention differs. Per layer, token and KV head:

- decisions from the projected, pre-RoPE decision channel ``c`` (``config.dmc_decision_channel``):
  ``alpha = [k[c] - c0 > 0]`` (accumulate into the open slot, else append a new one) and
  ``omega = sigmoid(mean over the group's query heads of q[c] + c0) + 1e-6`` (importance), with
  ``c0 = config.dmc_init_offset``; the first token of every sequence appends;
- channel ``c`` is then zeroed in q and k, RoPE (rotate-half) is applied, and channel ``c`` takes no
  part in attention;
- keys and values are accumulated (Eq. 9): a slot holds the omega-weighted average of its segment's
  keys / values (``dmc_accumulation="window"``: of the segment's last ``dmc_window`` tokens). With
  ``dmc_rope_order="post"`` the keys are rotated before they are accumulated; with ``"pre"`` the raw
  keys are accumulated and a slot is rotated at the position of its segment's newest token (the open
  slot at the current position);
- query ``t`` attends (scale ``1/sqrt(head_dim)``) over the closed slots and its own open slot.

Layouts: hidden ``[B, q, hidden]``; heads ``[B, H, q, d]`` / ``[B, H_kv, q, d]``; per-head decisions
``[B, H_kv, q]``. GQA: query head ``j`` reads KV head ``j // G`` (``G = H / H_kv``).

:class:`DMCCache` keeps, per (sequence, layer, KV head), the variable-length sequence of slots in a
padded tensor ``[B, H_kv, L_max, d]`` with lengths ``[B, H_kv]``, plus the open slot's running
numerators. ``generate()`` creates one automatically. Without a cache (``use_cache=False``) the forward
is the teacher-forced DMC attention (training's Fig. 3 with hard decisions).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    LlamaPreTrainedModel,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

OMEGA_EPS = 1e-6
ACCUMULATIONS = ("exact", "window")
ROPE_ORDERS = ("post", "pre")


class DMCLlamaConfig(LlamaConfig):
    """``LlamaConfig`` plus the DMC settings (``dmc_decision_channel`` None means ``head_dim - 1``)."""

    model_type = "dmc_llama"

    dmc_decision_channel: int | None = None
    dmc_init_offset: float = 5.0
    dmc_omega_eps: float = 1e-6  # added to omega (keeps the running normaliser positive)
    dmc_decision_threshold: float = 0.0  # alpha = [k[c] - c0 > threshold]
    dmc_accumulation: str = "exact"
    dmc_window: int = 12
    dmc_shared_decisions: bool = False  # DMC-HardC: one decision / importance per layer, shared by its heads
    dmc_rope_order: str = "post"  # post: rotated keys accumulated; pre: raw keys accumulated, then rotated

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.dmc_decision_channel is None:
            self.dmc_decision_channel = self.head_dim - 1
        if not 0 <= self.dmc_decision_channel < self.head_dim:
            raise ValueError(f"dmc_decision_channel={self.dmc_decision_channel} is not a channel of a head "
                             f"(head_dim={self.head_dim})")
        if self.dmc_accumulation not in ACCUMULATIONS:
            raise ValueError(f"dmc_accumulation={self.dmc_accumulation!r}; expected one of {', '.join(ACCUMULATIONS)}")
        if self.dmc_rope_order not in ROPE_ORDERS:
            raise ValueError(f"dmc_rope_order={self.dmc_rope_order!r}; expected one of {', '.join(ROPE_ORDERS)}")
        if self.dmc_window < 1:
            raise ValueError(f"dmc_window={self.dmc_window} must be >= 1")


# ----------------------------------------------------------------------------------------------
# Decisions (the project's kernels/dmc/decisions.py, restated)
# ----------------------------------------------------------------------------------------------
def dmc_decisions(query: torch.Tensor, key: torch.Tensor, channel: int, init_offset: float,
                  shared: bool = False, omega_eps: float = OMEGA_EPS,
                  threshold: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Hard ``alpha``, ``omega [B, H_kv, q]`` (fp32) from pre-RoPE ``query [B, H, q, d]``, ``key [B, H_kv, q, d]``.

    ``alpha = [k[c] - c0 > threshold]`` in {0., 1.}; ``omega = sigmoid(mean_G q[c] + c0) + omega_eps``.
    The first-token rule is applied by the cache (it knows which token is a sequence's first).
    """
    logit = key[..., channel].float() - init_offset
    q_mean = query[..., channel].float().unflatten(1, (key.shape[1], -1)).mean(2)
    if shared:
        logit = logit.mean(1, keepdim=True).expand_as(logit)
        q_mean = q_mean.mean(1, keepdim=True).expand_as(q_mean)
    alpha = (logit > threshold).float()
    return alpha, torch.sigmoid(q_mean + init_offset) + omega_eps


def sequence_rules(alpha: torch.Tensor, omega: torch.Tensor, real: torch.Tensor,
                   fresh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(alpha, omega) [B, H_kv, q]`` of a chunk with the sequence rules applied: the first real token
    of a sequence that has none yet (``fresh [B]``) appends (alpha 0); padding (``real [B, H_kv, q]``
    False) passes the state through (alpha 1, omega 0), so it neither decides nor weighs."""
    first = real & (real.long().cumsum(-1) == 1) & fresh[:, None, None]
    alpha = torch.where(first, 0.0, torch.where(real, alpha, 1.0))
    return alpha, torch.where(real, omega, 0.0)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, rotate-half convention: ``x [B, h, q, d]``, ``cos/sin [B, q, d]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


def _next_real_alpha(alpha: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """For each position j, alpha of the next real position after j (1 if there is none): state j
    closes (stays visible to later queries) iff this is 0. ``alpha, real [B, H_kv, m]``."""
    m = alpha.shape[-1]
    idx = torch.where(real, torch.arange(m, device=alpha.device), m)
    shifted = torch.cat([idx[..., 1:], torch.full_like(idx[..., :1], m)], dim=-1)
    nxt = shifted.flip(-1).cummin(-1).values.flip(-1)
    padded = torch.cat([alpha, torch.ones_like(alpha[..., :1])], dim=-1)
    return padded.gather(-1, nxt)


def _segment_sums(x: torch.Tensor, alpha: torch.Tensor, real: torch.Tensor, window: int | None) -> torch.Tensor:
    """Eq. 9 numerators with hard alpha: for each position, the sum of ``x`` over its segment (since
    the last append, at most the last ``window`` real tokens). ``x [B, H_kv, m, e]`` (0 at padding),
    ``alpha / real [B, H_kv, m]``; cumulative sums in fp64, so a subtraction loses nothing noticeable."""
    m = alpha.shape[-1]
    pos = torch.arange(m, device=x.device)
    start = torch.where(alpha == 0, pos, 0).cummax(-1).values
    if window is not None:
        rank = real.long().cumsum(-1)
        start = torch.maximum(start, torch.searchsorted(rank.contiguous(), (rank - window + 1).contiguous()))
    cs = x.double().cumsum(-2)
    before = torch.cat([torch.zeros_like(cs[..., :1, :]), cs[..., :-1, :]], dim=-2)
    return cs - before.gather(-2, start.unsqueeze(-1).expand_as(cs))


# ----------------------------------------------------------------------------------------------
# The cache
# ----------------------------------------------------------------------------------------------
class DMCCacheLayer(CacheLayerMixin):
    """One layer's DMC cache: per (sequence, KV head) a variable-length sequence of slots.

    - ``keys / values [B, H_kv, L_max, d]``: every slot (closed ones, then the open one), padded to the
      longest head; ``lengths [B, H_kv]`` counts them.
    - the open slot's running state as "pending" weighted tokens ``pend_k / pend_v [B, H_kv, P, d]``,
      ``pend_w / pend_real [B, H_kv, P]`` (fp32): ``exact`` keeps one (numerators ``u = z k~`` and ``z``),
      ``window`` keeps the segment's last ``w`` omega-weighted tokens (right-aligned).
    - ``tokens [B]``: real tokens processed per sequence; ``processed``: positions (columns, padding
      included), what ``get_seq_length()`` returns to ``generate()``.
    """

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, config: DMCLlamaConfig | None = None, **kwargs):
        super().__init__()
        self.window = config.dmc_window if config is not None and config.dmc_accumulation == "window" else None
        self.processed = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        dv, p = value_states.shape[-1], self.window or 1
        kw = {"device": key_states.device}
        self.keys = key_states.new_zeros(b, h, 0, d)
        self.values = value_states.new_zeros(b, h, 0, dv)
        self.lengths = torch.zeros(b, h, dtype=torch.long, **kw)
        self.pend_k = torch.zeros(b, h, p, d, dtype=torch.float32, **kw)
        self.pend_v = torch.zeros(b, h, p, dv, dtype=torch.float32, **kw)
        self.pend_w = torch.zeros(b, h, p, dtype=torch.float32, **kw)
        self.pend_real = torch.zeros(b, h, p, dtype=torch.bool, **kw)
        self.tokens = torch.zeros(b, dtype=torch.long, **kw)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError("DMCCacheLayer is updated by the DMC attention module (attend), not by update()")

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, alpha: torch.Tensor,
               omega: torch.Tensor, real: torch.Tensor, scale: float, store: bool = True,
               rotate: tuple | None = None) -> torch.Tensor:
        """Attention output ``[B, H, q, d_v]`` for a chunk of q tokens; with ``store`` the cache is updated.

        ``query [B, H, q, d]``, ``key [B, H_kv, q, d]`` (RoPE applied, decision channel zeroed),
        ``value [B, H_kv, q, d_v]``, ``alpha / omega [B, H_kv, q]`` (hard decisions, importances),
        ``real [B, q]`` (False at padding: neither decides nor is seen). ``rotate`` (``rope_order="pre"``,
        keys raw): ``(cos, sin)`` of the chunk ``[B, q, d]`` and ``(cos, sin)`` of the sequence's previous
        token ``[B, 1, d]``, at which the states are rotated. One pass over the chunk: the
        pending tokens of the open slot are prepended, Eq. 9 runs as segment sums, and each query sees
        the cache's closed slots plus the chunk states that are closed before it or its own.
        """
        if not self.is_initialized:
            self.lazy_initialization(key, value)
        b, hk, q, _ = key.shape
        p = self.pend_w.shape[-1]
        real_q = real[:, None, :].expand(b, hk, q)
        alpha, omega = sequence_rules(alpha, omega, real_q, self.tokens == 0)
        pend_first = self.pend_real & (self.pend_real.long().cumsum(-1) == 1)
        a = torch.cat([torch.where(pend_first, 0.0, 1.0), alpha], dim=-1)  # [B, H_kv, m], m = P + q
        r = torch.cat([self.pend_real, real_q], dim=-1)
        w = torch.cat([self.pend_w, omega], dim=-1)
        wk = torch.cat([self.pend_k, omega[..., None] * key.float()], dim=-2)
        wv = torch.cat([self.pend_v, omega[..., None] * value.float()], dim=-2)
        # exact: the pending token already holds the open slot's numerators; window: its last w tokens
        uk, uv, z = _segment_sums(torch.cat([wk, wv, w[..., None]], dim=-1), a, r, self.window).split(
            [wk.shape[-1], wv.shape[-1], 1], dim=-1)
        safe = torch.where(z > 0, z, 1.0)
        k_t, v_t = (uk / safe).to(key.dtype), (uv / safe).to(value.dtype)  # states [B, H_kv, m, d]
        if rotate is not None:  # pre: each state at its newest token (pending ones: the previous token)
            (cos, sin), (prev_cos, prev_sin) = rotate
            cos = torch.cat([prev_cos.expand(b, p, -1), cos], dim=1)
            sin = torch.cat([prev_sin.expand(b, p, -1), sin], dim=1)
            k_t = _rotate(k_t, cos, sin)
        closes = (_next_real_alpha(a, r) == 0) & r

        n_closed = (self.lengths - 1).clamp(min=0)
        width = int(n_closed.max()) if n_closed.numel() else 0
        old_visible = torch.arange(width, device=key.device) < n_closed[..., None]  # [B, H_kv, Lc]
        m = p + q
        j = torch.arange(m, device=key.device)
        t = torch.arange(p, m, device=key.device)
        seen = (j[None, :] < t[:, None]) & closes[..., None, :]  # [B, H_kv, q, m]
        seen = seen | (j[None, :] == t[:, None])
        mask = torch.cat([old_visible[..., None, :].expand(b, hk, q, width), seen], dim=-1)
        keys = torch.cat([self.keys[:, :, :width], k_t], dim=2)
        values = torch.cat([self.values[:, :, :width], v_t], dim=2)
        out = _masked_attention(query, keys, values, mask, scale)
        if store:
            self._store(k_t, v_t, uk, uv, z, (wk, wv, w), a, r, closes, n_closed, real)
        return out

    def _store(self, k_t, v_t, uk, uv, z, weighted, a, r, closes, n_closed, real) -> None:
        """Write the chunk's closed states and the open slot into the padded tensors; keep the open
        slot's pending tokens. Layouts as in :meth:`attend` (``m = P + q`` positions)."""
        b, hk, m, d = k_t.shape
        rank = closes.long().cumsum(-1)
        new_closed = n_closed + rank[..., -1]
        has_open = r.any(-1)
        self.lengths = new_closed + has_open.long()
        cap = max(int(self.lengths.max()), self.keys.shape[2])
        dest = torch.where(closes, n_closed[..., None] + rank - 1, cap)  # cap: discarded
        last = torch.where(r, torch.arange(m, device=r.device), -1).max(-1).values.clamp(min=0)  # [B, H_kv]
        open_dest = torch.where(has_open, new_closed, cap)
        for name, states in (("keys", k_t), ("values", v_t)):
            buf = getattr(self, name)
            grown = buf.new_zeros(b, hk, cap + 1, buf.shape[-1])
            grown[:, :, : buf.shape[2]] = buf
            e = states.shape[-1]
            grown.scatter_(2, dest[..., None].expand(b, hk, m, e), states)
            open_state = states.gather(2, last[..., None, None].expand(b, hk, 1, e))
            grown.scatter_(2, open_dest[..., None, None].expand(b, hk, 1, e), open_state)
            setattr(self, name, grown[:, :, :cap])
        if self.window is None:
            self.pend_k = uk.gather(2, last[..., None, None].expand(b, hk, 1, uk.shape[-1])).float()
            self.pend_v = uv.gather(2, last[..., None, None].expand(b, hk, 1, uv.shape[-1])).float()
            self.pend_w = z.squeeze(-1).gather(2, last[..., None]).float()
            self.pend_real = has_open[..., None]
        else:
            self._keep_window(*weighted, a, r, last, has_open)
        self.tokens = self.tokens + real.long().sum(-1)
        self.processed += real.shape[-1]

    def _keep_window(self, pk, pv, pw, a, r, last, has_open) -> None:
        """Window mode: the open segment's last ``w`` real (omega-weighted) tokens become the pending tokens."""
        w = self.window
        rank = r.long().cumsum(-1)
        seg = (1 - a).long().cumsum(-1)
        last_rank, last_seg = rank.gather(-1, last[..., None]), seg.gather(-1, last[..., None])
        keep = r & (seg == last_seg) & (rank > last_rank - w) & has_open[..., None]
        dest = torch.where(keep, w - 1 - (last_rank - rank), w)
        b, hk, m = r.shape
        self.pend_w = torch.zeros(b, hk, w + 1, device=r.device).scatter_(-1, dest, pw)[..., :w]
        self.pend_real = torch.zeros(b, hk, w + 1, dtype=torch.bool, device=r.device).scatter_(-1, dest, keep)[..., :w]
        self.pend_k = torch.zeros(b, hk, w + 1, pk.shape[-1], device=r.device).scatter_(
            2, dest[..., None].expand_as(pk), pk)[:, :, :w]
        self.pend_v = torch.zeros(b, hk, w + 1, pv.shape[-1], device=r.device).scatter_(
            2, dest[..., None].expand_as(pv), pv)[:, :, :w]

    # -- CacheLayerMixin API --------------------------------------------------------------------
    def get_seq_length(self) -> int:
        return self.processed

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.processed + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.is_initialized, self.processed = False, 0
        self.keys = self.values = None

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            for name in ("keys", "values", "lengths", "pend_k", "pend_v", "pend_w", "pend_real", "tokens"):
                setattr(self, name, getattr(self, name)[indices.to(self.lengths.device)])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.batch_select_indices(torch.arange(self.tokens.shape[0]).repeat_interleave(repeats))

    def offload(self):
        raise NotImplementedError("DMCCache does not support offloading")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("DMCCache cannot be cropped: merged tokens cannot be taken out of a slot")


def _masked_attention(query, keys, values, mask, scale) -> torch.Tensor:
    """Softmax attention in fp32: ``query [B, H, q, d]``, ``keys/values [B, H_kv, L, d]``,
    ``mask [B, H_kv, q, L]`` (True = visible; every row has one) -> ``[B, H, q, d_v]``."""
    b, h, q, d = query.shape
    hk = keys.shape[1]
    qg = query.float().view(b, hk, h // hk, q, d)
    scores = torch.einsum("bkgqd,bkld->bkgql", qg, keys.float()) * scale
    scores = scores.masked_fill(~mask[:, :, None], -math.inf)
    out = torch.einsum("bkgql,bkld->bkgqd", scores.softmax(-1), values.float())
    return out.reshape(b, h, q, -1).to(query.dtype)


class DMCCache(Cache):
    """The DMC cache of a whole model: one :class:`DMCCacheLayer` per layer.

    ``get_seq_length()`` is the number of positions processed (what ``generate()`` expects), not the
    number of slots; :meth:`slot_counts` and :meth:`compression` report what DMC achieved.
    """

    is_dmc_cache = True

    def __init__(self, config: DMCLlamaConfig, **kwargs):
        super().__init__(layers=[DMCCacheLayer(config) for _ in range(config.num_hidden_layers)])

    def slot_counts(self) -> torch.Tensor:
        """Slots per (layer, sequence, KV head): ``[layers, B, H_kv]``."""
        return torch.stack([layer.lengths for layer in self.layers])

    def compression(self) -> dict:
        """Achieved compression (tokens / slots): ``overall`` (all layers, sequences and heads),
        ``per_layer [layers]`` and ``per_head [layers][H_kv]`` (over the batch), as plain floats."""
        slots = self.slot_counts().double()  # [L, B, H]
        tokens = self.layers[0].tokens.double()[None, :, None].expand_as(slots)
        return {"overall": (tokens.sum() / slots.sum()).item(),
                "per_layer": (tokens.sum((1, 2)) / slots.sum((1, 2))).tolist(),
                "per_head": (tokens.sum(1) / slots.sum(1)).tolist()}


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------
class DMCLlamaAttention(LlamaAttention):
    """Llama attention (same projections) with DMC decisions and the DMC cache (module docstring)."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        """``attention_mask`` here is the chunk's ``real [B, q]`` (bool) from :class:`DMCLlamaModel`."""
        cfg = self.config
        b, q, _ = hidden_states.shape
        shape = (b, q, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        key = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        value = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        c = cfg.dmc_decision_channel
        alpha, omega = dmc_decisions(query, key, c, cfg.dmc_init_offset, cfg.dmc_shared_decisions,
                                     cfg.dmc_omega_eps, cfg.dmc_decision_threshold)
        keep = torch.ones(self.head_dim, dtype=query.dtype, device=query.device)
        keep[c] = 0
        cos, sin = position_embeddings
        # Zeroed before RoPE (so RoPE rotates with c = 0) and after (what lands in c is ignored).
        query = _rotate(query * keep, cos, sin) * keep
        rotate = None
        if cfg.dmc_rope_order == "pre":  # the cache rotates the accumulated raw keys
            key, rotate = key * keep, (position_embeddings, kwargs["dmc_previous_position_embeddings"])
        else:
            key = _rotate(key * keep, cos, sin) * keep
        if past_key_values is not None:
            layer, store = past_key_values.layers[self.layer_idx], True
        else:
            layer, store = DMCCacheLayer(cfg), False
        out = layer.attend(query, key, value, alpha, omega, attention_mask, self.scaling, store=store, rotate=rotate)
        return self.o_proj(out.transpose(1, 2).reshape(b, q, -1)), None


class DMCLlamaPreTrainedModel(LlamaPreTrainedModel):
    config_class = DMCLlamaConfig
    config: DMCLlamaConfig
    _supports_flash_attn = False
    _supports_flex_attn = False
    _can_compile_fullgraph = False
    _supports_attention_backend = False


class DMCLlamaModel(DMCLlamaPreTrainedModel, LlamaModel):
    """``LlamaModel`` with :class:`DMCLlamaAttention` and its own forward (per-head masks, DMC cache)."""

    def __init__(self, config: DMCLlamaConfig):
        DMCLlamaPreTrainedModel.__init__(self, config)
        self.padding_idx, self.vocab_size = config.pad_token_id, config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        for i, layer in enumerate(self.layers):
            layer.self_attn = DMCLlamaAttention(config, i)
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, **kwargs) -> BaseModelOutputWithPast:
        """``attention_mask [B, past + q]`` or ``[B, q]`` (2D, 0 at padding) or None; ``position_ids``
        default to the number of real tokens before each one (left padding starts at 0)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        b, q = inputs_embeds.shape[:2]
        use_cache = self.config.use_cache if use_cache is None else use_cache
        # By attribute, not isinstance: the package's DMCCache and the remote-code copy are different classes.
        if past_key_values is not None and not getattr(past_key_values, "is_dmc_cache", False):
            if past_key_values.get_seq_length() > 0:
                raise ValueError(f"DMC models need a DMCCache, got a filled {type(past_key_values).__name__}")
            past_key_values = None
        if use_cache and past_key_values is None:
            past_key_values = DMCCache(self.config)
        if not use_cache:
            past_key_values = None
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError("DMC models take a 2D attention_mask [batch, past + new tokens] (0 at padding)")
        if attention_mask is None:
            real = torch.ones(b, q, dtype=torch.bool, device=inputs_embeds.device)
        else:
            real = attention_mask[:, -q:].bool()
        if position_ids is None:  # real tokens before each one (a cache counts its sequences' real tokens)
            first_layer = past_key_values.layers[0] if past_key_values is not None else None
            before = first_layer.tokens[:, None] if first_layer is not None and first_layer.is_initialized else 0
            position_ids = (before + real.long().cumsum(-1) - 1).clamp(min=0)
        hidden = inputs_embeds
        position_embeddings = self.rotary_emb(hidden, position_ids=position_ids)
        extra = {}
        if self.config.dmc_rope_order == "pre":  # where an open slot closed by this chunk is rotated
            first_layer = past_key_values.layers[0] if past_key_values is not None else None
            before = first_layer.tokens[:, None] if first_layer is not None and first_layer.is_initialized else 0
            previous = (torch.zeros_like(position_ids[:, :1]) + before - 1).clamp(min=0)
            extra["dmc_previous_position_embeddings"] = self.rotary_emb(hidden, position_ids=previous)
        for layer in self.layers[: self.config.num_hidden_layers]:
            hidden = layer(hidden, attention_mask=real, position_embeddings=position_embeddings,
                           position_ids=position_ids, past_key_values=past_key_values, use_cache=use_cache, **extra)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden), past_key_values=past_key_values)


class DMCLlamaForCausalLM(DMCLlamaPreTrainedModel, LlamaForCausalLM):
    """``LlamaForCausalLM`` (same weight names) whose decoder runs DMC attention; ``generate()`` uses a
    :class:`DMCCache` (read it back from ``return_dict_in_generate=True`` outputs' ``past_key_values``)."""

    def __init__(self, config: DMCLlamaConfig):
        DMCLlamaPreTrainedModel.__init__(self, config)
        self.model = DMCLlamaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        if model_kwargs.get("past_key_values") is None and generation_config.use_cache is not False:
            model_kwargs["past_key_values"] = DMCCache(self.config)
            return None
        return super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)


DMCLlamaConfig.register_for_auto_class()
DMCLlamaForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = ["DMCLlamaConfig", "DMCLlamaForCausalLM", "DMCLlamaModel", "DMCCache", "DMCCacheLayer", "dmc_decisions",
           "sequence_rules"]
