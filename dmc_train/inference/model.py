"""The Llama forward for inference: plain tensors in Hugging Face names, a KV cache per call.

Separate from the training model (megatron-core ``GPTModel``, ``[s, b, h]`` layouts, tensor parallel
layers): one process holds the whole model, or under torchrun one tensor-parallel shard of it
(:mod:`~dmc_train.inference.tensor_parallel`: two all-reduces per layer), and every attention call goes to a
:class:`~dmc_train.inference.caches.KVCache`. ``tests/inference`` proves that its logits equal the
training model's on the same checkpoint (vanilla, and DMC with hard decisions).

    model = LlamaForInference.from_checkpoint("runs/dmc_tiny_cr2.0")
    logits = model.forward(tokens)                           # [b, n] -> [b, n, V], no cache (teacher-forced)
    logits = model.prefill(cache, seq_id, prompt)            # [n] -> [n, V], writes the cache
    logits = model.decode(cache, seq_ids, tokens, positions) # [B], [B] -> [B, V], one token per sequence
    logits = model.forward_with_attention(tokens, attend)    # [b, n] -> [b, n, V], any attention per layer

A cache (or attention) that numbers positions itself (LightCache: RoPE at window positions,
``rope_in_cache``) receives q and k before RoPE with ``info.rotate``, and then has no length limit; a
cache with ``prefill_chunk`` receives a prompt in chunks of that many tokens (continuation prefills).

Per layer (:class:`~dmc_train.models.llama_layer.LlamaLayer`, the importer's reference layer too): RMSNorm ->
fused q/k/v projection -> [here: (DMC: decisions from the pre-RoPE decision channel, which is then zeroed) ->
RoPE (:mod:`dmc_train.models.rope`: rotate-half, as megatron-core and HF, scaled by ``model.rope_scaling``
(``llama3``, ``linear``) with the training model's frequencies, the angles computed once per forward; for DMC
``rope_order=pre`` the keys reach the cache un-rotated and it rotates the accumulated ones) -> the cache's
attention] -> output projection -> residual -> RMSNorm -> SwiGLU -> residual. Layouts: hidden
``[b, n, hidden]``, heads ``[b, H, n, d]``; decisions ``[b, H_kv, n]``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from dmc_train.config import RopeScalingConfig, kv_groups, rope_scaling_of
from dmc_train.distributed import without_cpu_compat_mode
from dmc_train.errors import InferenceError
from dmc_train.inference.caches import KVCache, TokenInfo, causal_attention, teacher_forced_dmc
from dmc_train.inference.caches.less import LESSWeights
from dmc_train.models.dmc_settings import DMCSettings
from dmc_train.models.llama_layer import LlamaLayer
from dmc_train.models.norm import rms_norm
from dmc_train.models.rope import rope, rope_angles, rope_inv_freq, rope_rotation, rotate_half_rope
from dmc_train.policies import Scorer
from dmc_train.policies.parallel import PolicyRun, run_policy
from kernels.dmc import decisions
from kernels.less import eviction_masks, less_attention, phi_k, phi_q

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    max_positions: int = 2048
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)  # model.rope_scaling
    kv_channels: Optional[int] = None  # head dim when not hidden_size // num_heads (a tensor-parallel rank's shape)

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_heads

    @classmethod
    def from_config(cls, m: Any) -> "ModelShape":
        """From the project's ``cfg.model`` node."""
        return cls(m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, kv_groups(m),
                   m.vocab_size, m.norm_epsilon, float(m.rotary_base), m.max_position_embeddings, rope_scaling_of(m))


def random_weights(shape: ModelShape, seed: int = 0, std: float = 0.2) -> dict[str, torch.Tensor]:
    """Random Llama weights in HF names for ``shape`` (norm weights around 1): tests and timing benchmarks."""
    g = torch.Generator().manual_seed(seed)
    d, h, ffn = shape.head_dim, shape.hidden_size, shape.ffn_hidden_size

    def rnd(*size):
        return torch.randn(*size, generator=g) * std

    w = {"model.embed_tokens.weight": rnd(shape.vocab_size, h), "lm_head.weight": rnd(shape.vocab_size, h),
         "model.norm.weight": 1 + rnd(h)}
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        w.update({p + "self_attn.q_proj.weight": rnd(shape.num_heads * d, h),
                  p + "self_attn.k_proj.weight": rnd(shape.num_kv_heads * d, h),
                  p + "self_attn.v_proj.weight": rnd(shape.num_kv_heads * d, h),
                  p + "self_attn.o_proj.weight": rnd(h, shape.num_heads * d),
                  p + "mlp.gate_proj.weight": rnd(ffn, h), p + "mlp.up_proj.weight": rnd(ffn, h),
                  p + "mlp.down_proj.weight": rnd(h, ffn),
                  p + "input_layernorm.weight": 1 + rnd(h), p + "post_attention_layernorm.weight": 1 + rnd(h)})
    return w


class LlamaForInference:
    """A Llama (optionally DMC) model for generation; weights in HF ``LlamaForCausalLM`` names."""

    def __init__(self, shape: ModelShape, weights: dict[str, torch.Tensor], dmc: Optional[DMCSettings] = None,
                 dtype: torch.dtype = torch.float32, less: Optional[LESSWeights] = None, group: Any = None):
        """``group``: tensor parallelism's process group when ``shape`` and ``weights`` are one rank's shard
        (:mod:`~dmc_train.inference.tensor_parallel`); the attention output and MLP down projections are then
        all-reduced over it. None: the whole model (no collective)."""
        self.shape, self.dmc, self.dtype, self.less, self.group = shape, dmc, dtype, less, group
        s = shape
        self.scale = 1.0 / math.sqrt(s.head_dim)

        def w(name):
            if name not in weights:
                raise InferenceError(f"weight {name} is missing from the model's weights")
            return weights[name].to(dtype)

        biases = sorted(n for n in weights if n.endswith("_proj.bias"))
        if biases:  # never silently ignored (LightCache's key subspace also assumes k = h W_k^T)
            raise InferenceError(f"weight {biases[0]}: the inference model is Llama without biases (attention_bias "
                                 f"and mlp_bias false); this checkpoint cannot run here")
        self.embed = w("model.embed_tokens.weight")
        # the LM head transposed, [hidden, V] contiguous as the layers' projections (faster for a decode step's
        # few rows); tied to the embedding, the embedding's transposed view (no second copy)
        self.lm_head_t = w("lm_head.weight").T.contiguous() if "lm_head.weight" in weights else self.embed.T
        self.lm_head = self.lm_head_t.T  # [V, hidden]
        self.final_norm = w("model.norm.weight")
        self.layers = [LlamaLayer(i, w, s.head_dim, s.norm_eps) for i in range(s.num_layers)]
        self.inv_freq = rope_inv_freq(s.head_dim, s.rope_base, s.rope_scaling)
        self.rope = functools.partial(rope, inv_freq=self.inv_freq)  # rope(x [..., d], positions): the model's RoPE
        self.rotate_in_cache = dmc is not None and dmc.rope_order == "pre"
        self.keep = None
        if dmc is not None and dmc.channel is not None:
            self.keep = torch.ones(s.head_dim, dtype=dtype)
            self.keep[dmc.channel] = 0
            rolled = self.keep.roll(s.head_dim // 2)  # 0 where the signed sine multiplies the channel (k and q)
            self.rope_masks = (self.keep, rolled, rolled * self.keep)  # of cos, of k's and q's sines
            self.decision_scalars = tuple(torch.tensor(x, dtype=torch.float32)
                                          for x in (dmc.init_offset, dmc.decision_threshold, dmc.omega_eps, 0.0))

    @property
    def default_cache(self) -> str:
        """The cache this model needs unless told otherwise: ``dmc`` for DMC decisions, ``less`` for LESS
        kernels, else ``full``."""
        return "dmc" if self.dmc is not None else "less" if self.less is not None else "full"

    # -- loading ----------------------------------------------------------------------------------
    @classmethod
    def from_checkpoint(cls, checkpoint: str, dtype: Optional[str] = None,
                        tensor_parallel: int = 1) -> tuple["LlamaForInference", Any]:
        """A checkpoint of this project (any saved TP/PP layout) -> ``(model, saved)``; ``saved`` is the
        :class:`~dmc_train.training.model_state.SavedRun` (config, checkpoint, meta). DMC and Fixed Memory
        Pooling checkpoints get their :class:`DMCSettings`. The weights are read from the files in this
        process: no megatron model; at ``tensor_parallel=1`` no process group and no environment variable set.
        ``tensor_parallel > 1`` (under torchrun, one process per rank): this rank's shard, over a gloo group."""
        from dmc_train.inference import tensor_parallel as tp
        from dmc_train.methods import METHODS
        from dmc_train.methods.configs import dmc_settings
        from dmc_train.models.llama_weights import megatron_to_hf
        from dmc_train.training.model_state import read_model_state

        state, loaded = read_model_state(checkpoint)
        shape = ModelShape.from_config(loaded.cfg.model)
        dmc, less, cache = None, None, METHODS[loaded.cfg.method.name].cache  # the method declares its cache
        if cache == "less":  # the method's own modules, beside the Llama weights
            less = LESSWeights.pop_from(state, loaded.cfg.method, shape.max_positions)
        weights = megatron_to_hf(state, shape.num_heads, shape.num_kv_heads)
        if cache == "dmc":
            dmc = dmc_settings(loaded.cfg.method, shape.head_dim, loaded.meta.get("step"))
        torch_dtype = DTYPES[dtype or loaded.cfg.train.precision]
        tp.check(shape, tensor_parallel, dmc, less)
        rank, group = tp.start(tensor_parallel)
        if group is not None:
            weights, shape = tp.shard_weights(weights, shape, rank, tensor_parallel)
        return cls(shape, weights, dmc, torch_dtype, less, group), loaded

    # -- decisions --------------------------------------------------------------------------------
    def _decisions(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                   later: Optional[torch.Tensor] = None):
        """Hard ``alpha`` and ``omega [b, H_kv, n]`` from pre-RoPE ``q [b, H, n, d]``, ``k [b, H_kv, n, d]``
        (the same functions as training's evaluation); the first token of a sequence appends. ``later [b, 1, n]``
        (optional, :meth:`_later`): 1. where ``positions [b, n]`` is not 0, computed once for every layer."""
        st, hk = self.dmc, k.shape[1]
        if st.pool is not None:  # fixed pooling: every pool-th token appends, equal weights
            alpha = (positions[:, None, :].expand(-1, hk, -1) % st.pool != 0).float()
            return alpha, torch.ones_like(alpha)
        offset, threshold, eps, zero = self.decision_scalars  # 0-dim tensors: no scalar conversion per call
        logit = decisions.alpha_logit(k[..., st.channel], offset)  # [b, H_kv, n]
        q_dec = q[..., st.channel].float()  # [b, H, n], laid out [b, n, H] (as everything downstream expects)
        if q.shape[1] != hk or st.shared:  # GQA: the group's mean (one head: itself, as the mean of one value);
            # HardC: also one head, contiguous (its mean over the heads then sums in the same order)
            q_dec = decisions.group_mean(q_dec.transpose(1, 2), hk).transpose(1, 2)  # [b, H_kv, n]
        if st.shared:
            logit, q_dec = (t.mean(1, keepdim=True).expand_as(t) for t in (logit, q_dec))
        later = self._later(positions) if later is None else later
        alpha = torch.where(logit > threshold, later, zero)  # decisions.hard_alpha, 0 at a first token
        return alpha, decisions.importance(q_dec, offset, eps)

    @staticmethod
    def _later(positions: torch.Tensor) -> torch.Tensor:
        """``[b, 1, n]`` fp32: 1. where ``positions [b, n]`` is not a sequence's first token, else 0. (alpha times
        it: the first token appends)."""
        return (positions != 0).float()[:, None]

    # -- forward ----------------------------------------------------------------------------------
    def _run(self, tokens: torch.Tensor, positions: torch.Tensor, attend: Callable[..., torch.Tensor],
             raw_qk: bool = False, logits_at: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits ``[b, n, V]`` of ``tokens [b, n]`` at ``positions [b, n]``; ``attend(layer, q, k, v, info)``
        returns ``[b, H, n, d_v]``; ``raw_qk``: q and k reach it before RoPE, with ``info.rotate``.
        ``logits_at [m]``: only the logits ``[b, m, V]`` of these tokens (indices along n; the LM head runs on
        them alone)."""
        with without_cpu_compat_mode():  # no megatron code runs here
            return self._layers(tokens, positions, attend, raw_qk, logits_at)

    def _layers(self, tokens, positions, attend, raw_qk: bool = False, logits_at=None) -> torch.Tensor:
        x = self.embed[tokens]
        if self.dmc is None and not raw_qk:  # the layers rotate q and k together: no per-layer work here
            rotate = rope_rotation(positions[..., None], self.inv_freq, self.dtype)  # of qk [b, n, H + H_kv, d]
            info = TokenInfo(positions)
            for layer in self.layers:
                x = layer(x, lambda i, q, k, v: attend(i, q, k, v, info), self._all_reduce, rotate)
            return self._logits(x, logits_at)
        if self.keep is not None and not raw_qk:
            return self._dmc_layers(x, positions, attend, logits_at)
        if not raw_qk:  # every layer rotates at the same positions: [b, 1, n, d], in the model's dtype
            cos, sin = rope_angles(positions[:, None], self.inv_freq, self.dtype)

        def attention(i, q, k, v):  # between the projections and the cache: DMC's decisions, RoPE
            info = TokenInfo(positions)
            if self.dmc is not None:
                info.alpha, info.omega = self._decisions(q, k, positions)
            if self.keep is not None:  # zeroed before RoPE (as training) and in q after (channel unused)
                q, k = q * self.keep, k * self.keep
            if not raw_qk:
                q = rotate_half_rope(q, cos, sin)
            if self.rotate_in_cache or raw_qk:  # DMC rope_order=pre: the cache rotates the accumulated keys;
                # raw_qk (LightCache): q too, at the positions the cache gives them
                info.rotate = self.rope
            else:
                k = rotate_half_rope(k, cos, sin)
            if self.keep is not None:
                q = q * self.keep
            return attend(i, q, k, v, info)

        for layer in self.layers:
            x = layer(x, attention, self._all_reduce)
        return self._logits(x, logits_at)

    def _dmc_layers(self, x, positions, attend, logits_at=None) -> torch.Tensor:
        """:meth:`_layers` of a DMC model with a decision channel (q and k rotated here, not in the cache's
        attention): the decisions from the pre-RoPE q and k, then q and k rotated by tables that zero the
        channel (:meth:`_masked_rotations`: the same values as zeroing it before RoPE and in q after). ``x [b, n,
        hidden]``, ``positions [b, n]``."""
        rotate_q, rotate_k = self._masked_rotations(positions)
        later = self._later(positions)

        def attention(i, q, k, v):  # between the projections and the cache
            info = TokenInfo(positions, *self._decisions(q, k, positions, later))
            if self.rotate_in_cache:  # DMC rope_order=pre: the cache rotates the accumulated keys
                info.rotate = self.rope
            return attend(i, rotate_q(q), rotate_k(k), v, info)

        for layer in self.layers:
            x = layer(x, attention, self._all_reduce)
        return self._logits(x, logits_at)

    def _masked_rotations(self, positions: torch.Tensor):
        """``(rotate_q, rotate_k)``: ``x [b, h, n, d] -> x * cos + x.roll(d / 2, -1) * sin`` at ``positions [b, n]``
        with the tables ``[b, 1, n, d]`` (model dtype) of :func:`rope_rotation` in which every entry that reads the
        decision channel ``c`` is zeroed (cos at ``c``, the signed sine at ``c + d / 2 mod d``) and, for q, also
        the one that writes it (its sine at ``c``): bit for bit RoPE of the input with channel ``c`` zeroed, and
        for q the result's channel ``c`` zeroed. ``rope_order=pre``: k is not rotated here, only zeroed."""
        cos, sin = rope_angles(positions[:, None], self.inv_freq, self.dtype)
        half = cos.shape[-1] // 2
        sin = torch.cat([-sin[..., :half], sin[..., half:]], -1)  # rotate_half(x) * sin = roll(x) * signed sin
        keep, sin_k_mask, sin_q_mask = self.rope_masks
        cos, sin_k, sin_q = cos * keep, sin * sin_k_mask, sin * sin_q_mask

        def rotate_q(x):
            return x * cos + x.roll(half, -1) * sin_q

        def rotate_k(x):
            if self.rotate_in_cache:
                return x * keep
            return x * cos + x.roll(half, -1) * sin_k

        return rotate_q, rotate_k

    def _logits(self, x: torch.Tensor, at: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits ``[b, n, V]`` of the last layer's hidden states ``x [b, n, hidden]`` (final RMSNorm, LM head);
        ``at [m]``: of those tokens only, ``[b, m, V]``."""
        if at is not None:
            x = x[:, at]
        b, n, hidden = x.shape
        x = rms_norm(x.reshape(b * n, hidden), self.final_norm, self.shape.norm_eps)
        return torch.mm(x, self.lm_head_t).view(b, n, -1)

    def _all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over tensor-parallel ranks of a row-parallel projection's ``partial`` (itself without a group)."""
        if self.group is not None:
            torch.distributed.all_reduce(partial, group=self.group)
        return partial

    def same_on_all_ranks(self, tokens: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``tokens`` on every tensor-parallel rank (unseeded sampling draws from each process's own
        generator); ``tokens`` itself without a group."""
        if self.group is not None:
            torch.distributed.broadcast(tokens, src=0, group=self.group)
        return tokens

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits ``[b, n, V]`` of ``tokens [b, n]`` without a cache (DMC: hard decisions)."""
        self.check_tokens(tokens)
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)

        def attend(layer, q, k, v, info):
            if self.dmc is None:
                return causal_attention(q, k, v, self.scale)
            return teacher_forced_dmc(q, k, v, info, self.dmc, self.scale)[0]

        return self._run(tokens, positions, attend)

    @torch.no_grad()
    def forward_with_policy(self, tokens: torch.Tensor, scorer: Scorer, budget: int, prompt_len: int = 1,
                            horizon: Optional[int] = None, runs: Optional[list[PolicyRun]] = None,
                            less: Optional[LESSWeights] = None) -> torch.Tensor:
        """Teacher-forced logits ``[b, n, V]`` of ``tokens [b, n]`` under an eviction policy: what the engine
        computes when the first ``prompt_len`` tokens are the prompt and the rest are decoded one by one
        with ``budget`` entries per (sequence, layer, KV head) (the policy's parallel form,
        :func:`~dmc_train.policies.parallel.run_policy`). ``runs``: a list that receives each layer's
        :class:`PolicyRun` (what every query saw and when each entry was evicted). ``less``: LESS's kernels;
        the evicted pairs then enter its state (:func:`kernels.less.less_attention`, the LESS cache's
        parallel form). A policy with its own parallel form (``parallel_attention``: LightCache) runs that
        instead; ``budget`` is then unused."""
        if self.dmc is not None:
            raise InferenceError(f"the {scorer.name!r} policy runs on vanilla and GQA models, not on DMC ones")
        if hasattr(scorer, "parallel_attention"):  # a policy with its own parallel form on raw q, k (LightCache)
            return self.forward_with_attention(tokens, scorer.parallel_attention, raw_qk=True)
        self.check_tokens(tokens)
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)

        def attend(layer, q, k, v, info):
            run = run_policy(scorer, q, k, v, budget, layer, prompt_len, horizon)
            if runs is not None:
                runs.append(run)
            if less is None:
                return run.out
            w = less.layers[layer]
            return less_attention(q, k, v, *eviction_masks(run.evicted_at), phi_q(q, w), phi_k(k, w), self.scale)

        return self._run(tokens, positions, attend)

    @torch.no_grad()
    def forward_with_attention(self, tokens: torch.Tensor, attend: Callable[..., torch.Tensor],
                               raw_qk: bool = False) -> torch.Tensor:
        """Teacher-forced logits ``[b, n, V]`` of ``tokens [b, n]`` with each layer's attention given by
        ``attend(layer, q [b, H, n, d], k [b, H_kv, n, d], v, info) -> [b, H, n, d_v]``. ``raw_qk``: q and k
        arrive before RoPE and ``info.rotate(x, positions)`` applies it (an attention that numbers positions
        itself); the sequence may then be longer than the model's positions."""
        self.check_tokens(tokens, bounded=not raw_qk)
        return self._run(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), attend, raw_qk)

    @torch.no_grad()
    def prefill(self, cache: KVCache, seq_id: int, tokens: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Write the prompt ``tokens [n]`` of a new sequence into ``cache`` in one pass (or in chunks of
        ``cache.prefill_chunk``); logits ``[n, V]`` (``last_only``: the last token's, ``[1, V]``: the LM head
        runs on it alone, as generation needs)."""
        raw = cache.rope_in_cache
        self.check_tokens(tokens[None], bounded=not raw)
        self.check_cache_type(cache)
        chunk = cache.prefill_chunk or len(tokens)
        logits = [self._run(tokens[None, i: i + chunk], torch.arange(i, min(i + chunk, len(tokens)))[None],
                            lambda layer, q, k, v, info: cache.prefill(layer, seq_id, q, k, v, info), raw,
                            torch.tensor([-1]) if last_only else None)[0]
                  for i in range(0, len(tokens), chunk)]
        return logits[-1] if last_only else torch.cat(logits)

    @torch.no_grad()
    def prefill_batch(self, cache: KVCache, seq_ids: list[int], prompts: list[torch.Tensor],
                      last_only: bool = False) -> list[torch.Tensor]:
        """Write the prompts ``[n_i]`` of several new sequences into ``cache`` in one forward (varlen): their
        tokens packed into one row ``[1, sum n_i]``, no padding, each at its own positions from 0; the
        projections and the MLP run once over all of them, the cache attends within each sequence
        (:meth:`KVCache.prefill_varlen`). Logits ``[n_i, V]`` per sequence, those of :meth:`prefill` of each
        alone (``last_only``: ``[1, V]``, each prompt's last token's; the LM head runs on those alone). A cache
        that takes prompts in chunks or numbers positions itself gets them one at a time."""
        if cache.prefill_chunk is not None or cache.rope_in_cache or len(prompts) == 1:
            return [self.prefill(cache, s, p, last_only) for s, p in zip(seq_ids, prompts)]
        for p in prompts:
            self.check_tokens(p[None])
        self.check_cache_type(cache)
        lens = [len(p) for p in prompts]
        positions = torch.cat([torch.arange(n) for n in lens])[None]
        last = torch.tensor(lens).cumsum(0) - 1 if last_only else None  # [B]: each prompt's last token
        logits = self._run(torch.cat(prompts)[None], positions,
                           lambda layer, q, k, v, info: cache.prefill_varlen(layer, seq_ids, q, k, v, info, lens),
                           logits_at=last)
        return list(logits[0].split([1] * len(lens) if last_only else lens))

    @torch.no_grad()
    def decode(self, cache: KVCache, seq_ids: list[int], tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One token per sequence: ``tokens [B]`` at ``positions [B]``; logits ``[B, V]``."""
        self.check_cache_type(cache)

        def attend(layer, q, k, v, info):
            alpha, omega = (None if t is None else t[..., 0] for t in (info.alpha, info.omega))
            info = TokenInfo(positions, alpha, omega, rotate=info.rotate)  # info.positions [B, 1]: positions
            return cache.decode(layer, seq_ids, q[:, :, 0], k[:, :, 0], v[:, :, 0], info)[:, :, None]

        cache.begin_decode(seq_ids)
        try:
            return self._run(tokens[:, None], positions[:, None], attend, cache.rope_in_cache)[:, 0]
        finally:
            cache.end_decode()

    # -- checks -----------------------------------------------------------------------------------
    def check_tokens(self, tokens: torch.Tensor, bounded: bool = True) -> None:
        """One-line errors for an empty sequence, ids outside the vocabulary, and (``bounded``) more tokens
        than the model's positions."""
        n = tokens.shape[-1]
        if n == 0:
            raise InferenceError("the prompt is empty: give at least one token")
        if bounded and n > self.shape.max_positions:
            raise InferenceError(f"the prompt has {n} tokens, more than the model's {self.shape.max_positions} "
                                 f"positions (model.max_position_embeddings); shorten it")
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.shape.vocab_size:
            raise InferenceError(f"token ids must be in [0, {self.shape.vocab_size}); got "
                                 f"[{int(tokens.min())}, {int(tokens.max())}]")

    def check_cache_type(self, cache: type[KVCache] | KVCache) -> None:
        if cache.needs_decisions and self.dmc is None:
            raise InferenceError(f"the {cache.name!r} cache needs a DMC model, and this checkpoint has no DMC "
                                 f"decisions (its method is not dmc or fixed_pooling); use cache='full'")
