"""Every eviction policy of ``dmc_train/policies`` inside plain transformers: a ``Cache`` that keeps at most
``budget`` entries per (sequence, layer, KV head) while ``model.generate()`` decodes.

    from transformers import AutoModelForCausalLM
    from dmc_train.inference.hf_policy_cache import PolicyCache
    model = AutoModelForCausalLM.from_pretrained("meta-llama/Llama-2-7b-hf")
    cache = PolicyCache(model, "h2o", budget=256, max_new_tokens=100)  # any name of dmc_train.policies.POLICIES
    out = model.generate(input_ids, max_new_tokens=100, past_key_values=cache)  # cache.entries() <= 256

**How it plugs in.** A transformers attention module calls ``past_key_values.update(k, v, layer_idx)`` and
then the attention function named by ``config._attn_implementation``; ``update`` never sees the query,
which H2O, TOVA and Keyformer need (its attention over the kept entries) and LSH-E needs before it
evicts. So the step runs in the attention function:

- :func:`use_policy_attention` (called by :class:`PolicyCache`) registers the attention function
  ``"dmc_policy"`` (``transformers.AttentionInterface``) with SDPA's mask function
  (``transformers.AttentionMaskInterface``) and switches the model to it (``model.set_attn_implementation``).
  Calls that do not come from a :class:`PolicyCache` (another cache, no cache) run PyTorch SDPA as usual.
- :meth:`PolicyLayer.update` stores nothing: it returns the new keys and values unchanged, the keys as a
  view tagged with the layer (``keys.policy_layer``), which is how the attention function finds the cache.
- the attention function calls :meth:`PolicyLayer.attend`, which does the whole step exactly as the
  engine's ``EvictingCache`` (``dmc_train/inference/caches/evicting.py``) with the policies' own functions.

**The step**, per (sequence, layer, KV head) row, ``schedule=decode`` (the papers'): the prompt is prefilled
with full causal attention and compressed once to the budget with the scores it produced
(``scorer.prompt_scores``, :func:`~dmc_train.policies.parallel.compress_prompt`); each decode step then
chooses a victim (:func:`~dmc_train.policies.base.choose_victims`, evict before insert), writes the new
key and value into the victim's slot in place (:func:`~dmc_train.policies.base.insert`), attends over
the kept entries and updates the scores (``scorer.update``, probabilities or logits summed over the G
query heads of each KV head). ``schedule=prefill`` (kvpress's): the prompt is compressed to
``max(1, int(P * (1 - compression_ratio)))`` entries and decoded tokens are appended.

**Memory.** Per layer, fixed buffers allocated at the prompt and written in place: ``keys [b, H_kv, W, d]``,
``values [b, H_kv, W, d_v]`` (the model's dtype) and the policy state, rows ``[sequence, KV head]``:
``positions [b * H_kv, W]`` int64 (-1 = empty slot), ``scores [b * H_kv, W]`` fp32 and, for hashing
policies, ``codes [b * H_kv, W, nbytes]`` uint8. ``W`` = ``budget`` with ``schedule=decode``; with
``schedule=prefill`` the kept prompt plus ``max_new_tokens`` (grown by doubling when unknown).
:meth:`PolicyCache.nbytes` counts it all; :meth:`PolicyCache.entries` counts the kept entries.

**Limits.** Batches of equal-length prompts without padding (a padded ``attention_mask`` is refused),
the prompt in one forward and then one token per forward (greedy or sampling; no beam search,
assisted decoding or cache cropping), ``torch.compile`` not supported. Keyformer's ``tau_schedule=paper``
needs the generation length: pass ``max_new_tokens``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from dmc_train.errors import ConfigError, InferenceError
from dmc_train.policies import Budget, Entries, Scorer, Step, build_scorer
from dmc_train.policies.base import choose_victims, insert
from dmc_train.policies.parallel import compress_prompt, prompt_keep

ATTENTION = "dmc_policy"  # the attention implementation's name in transformers' registries


def policy_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None, dropout: float = 0.0,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query [b, H, q, d]``, ``key [b, H_kv, q, d]``, ``value
    [b, H_kv, q, d_v]`` (RoPE applied) -> ``([b, q, H, d_v], None)``. Keys returned by :meth:`PolicyLayer.update`
    go to their layer's :meth:`PolicyLayer.attend`; anything else runs transformers' SDPA."""
    layer = getattr(key, "policy_layer", None)
    if layer is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return layer.attend(query, key, value, attention_mask, scaling), None


def use_policy_attention(model: torch.nn.Module) -> None:
    """Register ``"dmc_policy"`` with transformers and switch ``model`` (a ``PreTrainedModel``) to it. Idempotent;
    the model keeps working with every other cache (they run SDPA)."""
    AttentionInterface.register(ATTENTION, policy_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    if model.config._attn_implementation != ATTENTION:
        model.set_attn_implementation(ATTENTION)
    if model.config._attn_implementation != ATTENTION:
        raise InferenceError(f"{type(model).__name__} cannot switch its attention implementation (it does not use "
                             f"transformers' AttentionInterface), so PolicyCache cannot run on it")


class PolicyLayer(CacheLayerMixin):
    """One layer's fixed-budget cache (layouts in the module docstring): ``keys``, ``values``, ``entries``
    (:class:`~dmc_train.policies.Entries` over rows ``[sequence, KV head]``), ``seen`` (tokens processed,
    what ``get_seq_length()`` returns) and ``prompt_len``."""

    is_compileable = False
    is_sliding = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, scorer: Scorer, layer: int, max_new_tokens: int = 0):
        super().__init__()
        self.scorer, self.layer, self.horizon = scorer, layer, max_new_tokens
        self.budget = 0  # entries, set by the prompt: a fraction is of the prompt + max_new_tokens
        self.evicting = scorer.cfg.schedule == "decode"
        self.entries: Optional[Entries] = None
        self.seen = self.prompt_len = 0
        self.pending = False  # update() returned tagged keys that attend() has not consumed yet

    # -- transformers' Cache layer interface ------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True  # the buffers are sized at the prompt, in attend()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store nothing; return ``key_states`` (a view tagged with this layer) and ``value_states`` for the
        attention function, which calls :meth:`attend`."""
        if self.pending:
            raise InferenceError("the model's attention did not run through 'dmc_policy'; create the PolicyCache "
                                 "with the model it is used with (PolicyCache(model, ...)) and do not change its "
                                 "attention implementation afterwards")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.pending = True
        tagged = key_states.view_as(key_states)
        tagged.policy_layer = self
        return tagged, value_states

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """The mask of the uncompressed sequence (only used to detect padding: this cache masks itself)."""
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return self.budget if self.evicting and self.budget else -1

    def reset(self) -> None:
        self.keys = self.values = self.entries = None
        self.seen = self.prompt_len = self.budget = 0
        self.pending = self.is_initialized = False

    def _unsupported(self, *args, **kwargs):
        raise InferenceError("PolicyCache supports greedy and sampled generation only (no beam search, assisted "
                             "decoding, cache cropping or batch reordering)")

    reorder_cache = crop = batch_repeat_interleave = batch_select_indices = _unsupported

    # -- the step ---------------------------------------------------------------------------------------
    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Optional[torch.Tensor], scaling: Optional[float]) -> torch.Tensor:
        """The whole step of ``q`` new tokens: ``query [b, H, q, d]``, ``key [b, H_kv, q, d]``, ``value
        [b, H_kv, q, d_v]`` -> attention output ``[b, q, H, d_v]``. The first call is the prompt (prefill and
        compression); every later call is one decoded token (evict, insert, attend, update the scores)."""
        self.pending = False
        q_len = query.shape[2]
        if attention_mask is not None and not bool(attention_mask[..., -1, :].all()):
            raise InferenceError("PolicyCache needs equal-length prompts without padding; generate prompts of "
                                 "different lengths separately, without an attention_mask that pads")
        if scaling is not None and abs(scaling - self.scorer.scale) > 1e-6 * self.scorer.scale:
            raise InferenceError(f"the model scales attention logits by {scaling}, not head_dim ** -0.5; "
                                 f"PolicyCache supports the standard scale only")
        if self.seen == 0:
            out = self._prefill(query, key, value)
        elif q_len == 1:
            out = self._decode(query, key, value)
        else:
            raise InferenceError(f"PolicyCache takes the prompt in one forward and then one token per forward; got "
                                 f"{q_len} tokens after {self.seen} (start a new PolicyCache for a new prompt)")
        self.seen += q_len
        return out

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """``[b, H_kv, W, e]`` -> the same memory as ``[b * H_kv, W, e]`` (writes go to the buffer)."""
        return x.view(-1, *x.shape[2:])

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention over the prompt; keep ``prompt_keep`` entries per row, in position order."""
        b, hk, p, d = k.shape
        n, s = b * hk, self.scorer
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=s.scale, enable_gqa=q.shape[1] != hk)
        scores = s.prompt_scores(q, k, self.layer).reshape(n, p)
        self.budget = s.budget(p + self.horizon)
        keep, fixed = prompt_keep(s, self.budget, p)
        kept = compress_prompt(s, scores, keep, fixed, hk).to(k.device)  # [N, keep] positions (= prompt slots)
        width = self.budget if self.evicting else keep + self.horizon
        self.keys = k.new_zeros(b, hk, width, d)
        self.values = v.new_zeros(b, hk, width, v.shape[-1])
        kept_k = k.reshape(n, p, d).gather(1, kept[..., None].expand(-1, -1, d))
        self._rows(self.keys)[:, :keep] = kept_k
        self._rows(self.values)[:, :keep] = v.reshape(n, p, -1).gather(1, kept[..., None].expand(-1, -1, v.shape[-1]))
        e = self.entries = Entries(torch.full((n, width), -1, dtype=torch.long, device=k.device),
                                   torch.zeros(n, width, device=k.device),
                                   None if not s.code_bits else torch.zeros(n, width, -(-s.code_bits // 8),
                                                                            dtype=torch.uint8, device=k.device))
        e.positions[:, :keep] = kept
        e.scores[:, :keep] = scores.gather(1, kept)
        if e.codes is not None:
            e.codes[:, :keep] = s.codes(kept_k)
        self.prompt_len = p
        return out.transpose(1, 2)

    def _decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One token per row: evict (``decode`` schedule) or append, write in place, attend, update the scores."""
        b, h, _, d = q.shape
        hk = k.shape[1]
        n, s, e = b * hk, self.scorer, self.entries
        t = torch.full((n,), self.seen, device=k.device)
        step = Step(self.layer, torch.arange(hk, device=k.device).repeat(b), t, t - self.prompt_len,
                    torch.full_like(t, self.horizon), hk)
        q_t = q.reshape(n, h // hk, d).float()  # [N, G, d]
        count = e.valid.sum(-1)  # kept entries fill slots 0..count-1
        if self.evicting:
            full, victim = choose_victims(s, e, q_t, step, self.budget)
            slot = torch.where(full, victim, count)
        else:
            self._grow(int(count.max()) + 1)
            e, slot = self.entries, count
        k_new, v_new = k.reshape(n, d), v.reshape(n, -1)
        rows = torch.arange(n, device=k.device)
        self._rows(self.keys)[rows, slot] = k_new
        self._rows(self.values)[rows, slot] = v_new
        insert(s, e, slot, k_new, t)
        valid = e.valid  # [N, W]
        logits = (q_t @ self._rows(self.keys).float().transpose(1, 2)) * s.scale  # [N, G, W]
        probs = torch.softmax(logits.masked_fill(~valid[:, None], float("-inf")), dim=-1)
        out = probs @ self._rows(self.values).float()  # [N, G, d_v]
        if self.evicting:
            attention = None
            if s.attention is not None:
                summed = probs.sum(1) if s.attention == "probs" else logits.sum(1)
                attention = summed.masked_fill(~valid, 0.0)
            s.update(e, attention, step)
        return out.reshape(b, 1, h, -1).to(q.dtype)

    def _grow(self, needed: int) -> None:
        """``schedule=prefill`` without ``max_new_tokens``: double the buffers' width when ``needed`` exceeds it."""
        width = self.keys.shape[2]
        if needed <= width:
            return
        new = max(needed, 2 * width)

        def grown(x: torch.Tensor, dim: int, fill: float = 0) -> torch.Tensor:
            shape = list(x.shape)
            shape[dim] = new - width
            return torch.cat([x, x.new_full(shape, fill)], dim=dim)

        self.keys, self.values = grown(self.keys, 2), grown(self.values, 2)
        e = self.entries
        self.entries = Entries(grown(e.positions, 1, -1), grown(e.scores, 1),
                               None if e.codes is None else grown(e.codes, 1))

    def nbytes(self) -> int:
        """Bytes held: the K/V buffers and the policy state."""
        if self.entries is None:
            return 0
        e = self.entries
        return sum(x.nbytes for x in (self.keys, self.values, e.positions, e.scores, e.codes) if x is not None)


class PolicyCache(Cache):
    """A transformers ``Cache`` that evicts with the policy ``policy`` (a name of
    :data:`dmc_train.policies.POLICIES`) at ``options["budget"]`` entries per (sequence, layer, KV head).

    ``options``: the policy's options (``budget``: entries, or a fraction of the context: the prompt +
    ``max_new_tokens``; ``schedule``: ``decode`` | ``prefill``; ``compression_ratio``; the policy's
    own, e.g. H2O's ``recent_fraction``). ``max_new_tokens``: the generation length (Keyformer's
    temperature schedule; the ``prefill`` schedule's buffer size). Switches ``model`` to the ``"dmc_policy"``
    attention (:func:`use_policy_attention`). One cache serves one ``generate()`` call.
    """

    def __init__(self, model: torch.nn.Module, policy: str, max_new_tokens: int = 0, **options: Any):
        config = model.config.get_text_config(decoder=True)
        h = config.num_attention_heads
        hk = getattr(config, "num_key_value_heads", None) or h
        d = getattr(config, "head_dim", None) or config.hidden_size // h
        self.scorer = build_scorer(policy, options, d, h // hk, d ** -0.5)
        if not Budget.of(self.scorer.cfg.budget).is_fraction:
            self.scorer.budget(None)  # entries: checked against the fixed part now
        if getattr(self.scorer.cfg, "tau_schedule", None) == "paper" and max_new_tokens <= 0:
            raise ConfigError(f"{policy}'s tau_schedule='paper' needs the generation length: pass max_new_tokens= "
                              f"(as given to generate), or use tau_schedule='code'")
        super().__init__(layers=[PolicyLayer(self.scorer, i, max_new_tokens)
                                 for i in range(config.num_hidden_layers)])
        use_policy_attention(model)

    def entries(self) -> torch.Tensor:
        """Kept entries ``[layers, b, H_kv]`` (int64) after the last forward."""
        first = self.layers[0]
        if first.entries is None:
            return torch.zeros(len(self.layers), 0, 0, dtype=torch.long)
        b, hk = first.keys.shape[:2]
        return torch.stack([layer.entries.valid.sum(-1).view(b, hk) for layer in self.layers])

    def nbytes(self) -> int:
        """Bytes held by all layers: K/V buffers and policy state."""
        return sum(layer.nbytes() for layer in self.layers)
