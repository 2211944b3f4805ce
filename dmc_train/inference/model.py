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

What the checkpoint's training method adds (DMC's decisions, LESS's kernels, the cache it needs) the model asks
of its method hook (:class:`~dmc_train.inference.method.InferenceMethod`, ``model.method``): it names no method.

A cache (or attention) that numbers positions itself (LightCache: RoPE at window positions,
``rope_in_cache``) receives q and k before RoPE with ``info.rotate``, and then has no length limit; a
cache with ``prefill_chunk`` receives a prompt in chunks of that many tokens (continuation prefills).

Per layer (:class:`~dmc_train.models.llama_layer.LlamaLayer`, the importer's reference layer too): RMSNorm ->
fused q/k/v projection -> [here: (the method's decisions: DMC's from the pre-RoPE decision channel, then zeroed) ->
RoPE (:mod:`dmc_train.models.rope`: rotate-half, as megatron-core and HF, scaled by ``model.rope_scaling``
(``llama3``, ``linear``) with the training model's frequencies, the angles computed once per forward; for DMC
``rope_order=pre`` the keys reach the cache un-rotated and it rotates the accumulated ones) -> the cache's
attention] -> output projection -> residual -> RMSNorm -> SwiGLU -> residual. Layouts: inside, tokens are rows
(hidden ``[t, hidden]``, a layer's heads ``[t, H + 2 H_kv, d]``, decisions ``[t, H_kv]``; a decode step's rows
are its sequences, handed to the cache as ``[B, heads, d]``); an attention given to the forwards gets heads
``[b, H, n, d]`` and decisions ``[b, H_kv, n]``.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from dmc_train.config import RopeScalingConfig, kv_groups, rope_scaling_of
from dmc_train.distributed import inference_device, without_cpu_compat_mode
from dmc_train.errors import InferenceError
from dmc_train.inference.caches import KVCache, TokenInfo
from dmc_train.inference.caches.base import HeadsFirst
from dmc_train.inference.method import InferenceMethod
from dmc_train.models.hf_config import rope_parameters
from dmc_train.models.llama_layer import LlamaLayer
from dmc_train.models.rope import rope, rope_inv_freq, rope_rotation, rope_tables
from dmc_train.policies import Scorer
from dmc_train.policies.parallel import PolicyRun, run_policy
from kernels.layer import rms_norm_matmul

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

    def hf_config(self, **extra: Any) -> dict[str, Any]:
        """Keyword arguments of transformers' ``LlamaConfig`` for this shape (untied embeddings, RoPE as
        ``config.json`` spells it), ``extra`` added (the attention implementation, token ids)."""
        return dict(vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.ffn_hidden_size,
                    num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
                    num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
                    max_position_embeddings=self.max_positions, rms_norm_eps=self.norm_eps,
                    rope_parameters=rope_parameters(self, self.rope_base), tie_word_embeddings=False, **extra)

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
    """A Llama model for generation, with its training method's hook; weights in HF ``LlamaForCausalLM`` names."""

    def __init__(self, shape: ModelShape, weights: dict[str, torch.Tensor], method: Optional[InferenceMethod] = None,
                 dtype: torch.dtype = torch.float32, group: Any = None, device: str | torch.device | None = None):
        """``method``: what the checkpoint's training method adds (:mod:`~dmc_train.inference.method`: DMC's
        :class:`~dmc_train.inference.dmc_decisions.DMCInference`, LESS's
        :class:`~dmc_train.inference.caches.less.LESSWeights`); None: the plain model's. ``group``: tensor
        parallelism's process group when ``shape`` and ``weights`` are one rank's shard
        (:mod:`~dmc_train.inference.tensor_parallel`); the attention output and MLP down projections are then
        all-reduced over it. None: the whole model (no collective). ``device``: where the weights, every table and
        every tensor a forward creates live (default: the weights' device); checked by
        :func:`~dmc_train.distributed.inference_device` (one-line errors for a GPU that is not there, fp16 on CPU)."""
        device = inference_device(device if device is not None else next(iter(weights.values())).device, dtype)
        self.shape, self.dtype, self.group, self.device = shape, dtype, group, device
        self.method = InferenceMethod() if method is None else method.to(device)
        s = shape
        self.scale = 1.0 / math.sqrt(s.head_dim)

        def w(name):
            if name not in weights:
                raise InferenceError(f"weight {name} is missing from the model's weights")
            return weights[name].to(device=device, dtype=dtype)

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
        self.inv_freq = rope_inv_freq(s.head_dim, s.rope_base, s.rope_scaling).to(device)
        self.rope = functools.partial(rope, inv_freq=self.inv_freq)  # rope(x [..., d], positions): the model's RoPE
        self.head_counts = self.layers[0].heads  # (H, H_kv, H_kv) of every layer (a tensor-parallel rank's)
        # the method's per-layer decisions (DMC's) and the masks of their decision channel, asked per forward and layer
        self.decisions = self.method.decisions(self.head_counts, s.head_dim, dtype, device)
        self.keep, self.rope_masks = (None, (None, None)) if self.decisions is None else (self.decisions.keep,
                                                                                          self.decisions.rope_masks)

    @property
    def default_cache(self) -> str:
        """The cache this model needs unless told otherwise: its method's (``dmc`` for DMC decisions, ``less`` for
        LESS kernels, else ``full``)."""
        return self.method.cache

    # -- loading ----------------------------------------------------------------------------------
    @classmethod
    def from_checkpoint(cls, checkpoint: str, dtype: Optional[str] = None, tensor_parallel: int = 1,
                        device: str | torch.device | None = None) -> tuple["LlamaForInference", Any]:
        """A checkpoint of this project (any saved TP/PP layout) -> ``(model, saved)``; ``saved`` is the
        :class:`~dmc_train.training.model_state.SavedRun` (config, checkpoint, meta). The model's method hook is the
        one the training method registry gives for the checkpoint's method (:func:`dmc_train.methods.inference_hook`:
        DMC's settings, LESS's kernels taken out of the state). The weights are read from the files in this
        process: no megatron model; at ``tensor_parallel=1`` no process group and no environment variable set.
        ``tensor_parallel > 1`` (under torchrun, one process per rank): this rank's shard, over a gloo group.
        ``device``: where the model runs (``"cpu"``, ``"cuda"``, ``"cuda:1"``; default CPU: the files are read
        there)."""
        from dmc_train.inference import tensor_parallel as tp
        from dmc_train.methods import inference_hook
        from dmc_train.models.llama_weights import megatron_to_hf
        from dmc_train.training.model_state import read_model_state

        device = inference_device(device if device is not None else "cpu")  # a GPU that is not there: before reading
        state, loaded = read_model_state(checkpoint)
        shape = ModelShape.from_config(loaded.cfg.model)
        method = inference_hook(loaded.cfg).from_saved(loaded, state, shape)  # its own modules out of the state
        weights = megatron_to_hf(state, shape.num_heads, shape.num_kv_heads)
        torch_dtype = DTYPES[dtype or loaded.cfg.train.precision]
        tp.check(shape, tensor_parallel, method)
        if tensor_parallel > 1 and device.type != "cpu":
            raise InferenceError(f"tensor_parallel={tensor_parallel} runs on CPU processes (gloo); on a GPU use "
                                 f"tensor_parallel=1")
        rank, group = tp.start(tensor_parallel)
        if group is not None:
            weights, shape = tp.shard_weights(weights, shape, rank, tensor_parallel)
        return cls(shape, weights, method, torch_dtype, group, device), loaded

    # -- forward ----------------------------------------------------------------------------------
    def _run(self, tokens: torch.Tensor, positions: torch.Tensor, attend: Callable[..., torch.Tensor],
             raw_qk: bool = False, logits_at: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits ``[b, n, V]`` of ``tokens [b, n]`` at ``positions [b, n]``; ``attend(layer, q, k, v, info)``
        takes ``q [b, H, n, d]``, ``k, v [b, H_kv, n, d]`` and ``info`` (positions ``[b, n]``, the method's decisions
        ``[b, H_kv, n]``) and returns ``[b, H, n, d_v]``; ``raw_qk``: q and k reach it before RoPE, with
        ``info.rotate``. ``logits_at [m]``: only the logits ``[b, m, V]`` of these tokens (indices along n; the LM
        head runs on them alone)."""
        b, n = tokens.shape
        rotate = self.rope if self.method.rotate_in_cache or raw_qk else None

        def attention(i, q, k, v, alpha, omega):  # rows [b n, heads, d] -> [b, heads, n, d] and back
            alpha, omega = (None if t is None else t.view(b, n, -1).transpose(1, 2) for t in (alpha, omega))
            q, k, v = (t.view(b, n, -1, t.shape[-1]).transpose(1, 2) for t in (q, k, v))
            out = attend(i, q, k, v, TokenInfo(positions, alpha, omega, rotate))
            return out.transpose(1, 2).reshape(b * n, -1)

        with without_cpu_compat_mode():  # no megatron code runs here
            x = self._layers(tokens.reshape(-1), positions, attention, raw_qk).view(b, n, -1)
            if logits_at is not None:
                x = x[:, logits_at]
            return self._logits(x.reshape(-1, x.shape[-1])).view(b, x.shape[1], -1)

    def _layers(self, tokens: torch.Tensor, positions: torch.Tensor, attention: Callable[..., torch.Tensor],
                raw_qk: bool = False, compiled: Optional[Callable[[int], Any]] = None) -> torch.Tensor:
        """The hidden states ``[t, hidden]`` after the last layer of ``tokens [t]`` at ``positions [b, n]`` (rows =
        tokens, ``t = b n``), every layer run by the one route :meth:`_route` chooses for the forward.
        ``compiled(layer)``: the layer's attention as a compiled function (a decode step's,
        ``KVCache.compiled_attention``, asked just before the layer runs) or None."""
        calls = (None if compiled is None else compiled(layer.index) for layer in self.layers)
        first = next(calls)
        route = self._route(first, positions, attention, raw_qk)
        x = self.embed[tokens]
        for layer, call in zip(self.layers, itertools.chain((first,), calls)):
            x = route(layer, x, call)
        return x

    def _route(self, call: Any, positions: torch.Tensor, attention: Callable[..., torch.Tensor],
               raw_qk: bool) -> Callable[[LlamaLayer, torch.Tensor, Any], torch.Tensor]:
        """How every layer of a forward runs, chosen once from the first layer's compiled attention ``call`` (the
        same kind for every layer of a step): ``run(layer, x [t, hidden], call) -> [t, hidden]``. What every layer
        shares (RoPE tables, the method's decision rule) is computed here, once.

        - no call: the heads (:meth:`LlamaLayer.attention_input`), the method's decisions from them before RoPE
          (its hook ``self.decisions``: DMC's :meth:`DMCDecisions.decide`), q and k rotated (:meth:`_split_heads`),
          ``attention(layer, q [t, H, d], k [t, H_kv, d], v [t, H_kv, d_v], alpha, omega) -> [t, H d_v]``
          (``alpha``, ``omega [t, H_kv]``; None without decisions), then :meth:`LlamaLayer.attention_output`;
        - a call that needs the projected heads (a ``HeadsFirst``: an eviction policy whose victims read the query)
          or decisions it cannot take itself (HardC's, whose heads decide together): those first, then the rest of
          the layer in one call (:meth:`LlamaLayer.attend_output_with`);
        - else the whole layer in one call (:meth:`LlamaLayer.decode_with`), the decisions (if any) taken in it."""
        split, rope_in_input = self._split_heads(positions, raw_qk)
        hook = self.decisions
        rule = None if hook is None else hook.rule(positions)
        channel = None if hook is None else hook.channel

        def heads_and_decisions(layer, x):
            heads, channel_values = layer.attention_input(x, rope_in_input, channel)
            return heads, (None, None) if hook is None else hook.decide(channel_values, rule, positions)

        if call is None:
            all_reduce = None if self.group is None else self._all_reduce

            def plain(layer, x, _):
                heads, decisions = heads_and_decisions(layer, x)
                return layer.attention_output(x, attention(layer.index, *split(heads), *decisions), all_reduce)
            return plain
        if isinstance(call, HeadsFirst):
            def heads_first(layer, x, call):
                heads = layer.attention_input(x, rope_in_input)[0]
                return layer.attend_output_with(x, heads, call.build(heads))
            return heads_first
        if hook is not None and not hook.decides_in_call:
            def decisions_first(layer, x, call):
                heads, decisions = heads_and_decisions(layer, x)
                return layer.attend_output_with(x, heads, call.with_decisions(*decisions))
            return decisions_first

        def one_call(layer, x, call):
            if hook is not None:
                hook.hand_to(call, rule)
            return layer.decode_with(x, rope_in_input, call, channel)
        return one_call

    def _split_heads(self, positions: torch.Tensor, raw_qk: bool):
        """``(split, rope)``: ``split(heads [t, H + 2 H_kv, d]) -> (q, k, v)`` ``[t, heads, d]`` (views of one layer's
        heads, q and k rotated) at ``positions [b, n]``; ``rope``: the tables (:func:`rope_tables`, computed here
        once for every layer) that :meth:`LlamaLayer.attention_input` rotates q and k with in the projections'
        call, or None. A DMC model's tables zero its decision channel (the masks ``rope_masks``; the decisions read
        the channel before RoPE). ``rope_order=pre``: only q is rotated, by ``split`` (:func:`rope_rotation`), and
        k's channel zeroed (the cache rotates the keys it accumulates); ``raw_qk``: neither (the attention rotates
        them), the channel zeroed."""
        hq, hk, hv = self.head_counts
        keep = self.keep
        if raw_qk:
            if keep is None:
                return (lambda heads: heads.split((hq, hk, hv), 1)), None
            return (lambda heads: (*(heads[:, : hq + hk] * keep).split((hq, hk), 1), heads[:, hq + hk:])), None
        if self.method.rotate_in_cache:  # DMC rope_order=pre: the query heads alone, with the query heads' masks
            rotate = rope_rotation(positions.reshape(-1, 1), self.inv_freq, self.dtype, keep,
                                   None if keep is None else self.rope_masks[1][0])
            if keep is None:
                return (lambda heads: (rotate(heads[:, :hq]), *heads[:, hq:].split((hk, hv), 1))), None
            return (lambda heads: (rotate(heads[:, :hq]), heads[:, hq: hq + hk] * keep, heads[:, hq + hk:])), None
        cos, sin = rope_tables(positions.reshape(-1, 1), self.inv_freq, self.dtype, *self.rope_masks)  # [t, 1, d]
        return (lambda heads: heads.split((hq, hk, hv), 1)), (cos[:, 0], sin)  # sin [t, 1 or H + H_kv, d]

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``[t, V]`` of the last layer's hidden states ``x [t, hidden]`` (final RMSNorm, LM head)."""
        return rms_norm_matmul(x, self.final_norm, self.shape.norm_eps, self.lm_head_t)[0]

    def _all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over the tensor-parallel ranks of a row-parallel projection's ``partial``."""
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
        """Teacher-forced logits ``[b, n, V]`` of ``tokens [b, n]`` without a cache: each layer's attention is the
        method's (:meth:`InferenceMethod.attention`: causal; DMC: with hard decisions)."""
        tokens = self.check_tokens(tokens)
        attention, scale = self.method.attention, self.scale
        return self._run(tokens, self._positions(tokens),
                         lambda layer, q, k, v, info: attention(q, k, v, info, scale))

    @torch.no_grad()
    def forward_with_policy(self, tokens: torch.Tensor, scorer: Scorer, budget: int, prompt_len: int = 1,
                            horizon: Optional[int] = None, runs: Optional[list[PolicyRun]] = None,
                            with_evicted: Optional[Callable[..., torch.Tensor]] = None) -> torch.Tensor:
        """Teacher-forced logits ``[b, n, V]`` of ``tokens [b, n]`` under an eviction policy: what the engine
        computes when the first ``prompt_len`` tokens are the prompt and the rest are decoded one by one
        with ``budget`` entries per (sequence, layer, KV head) (the policy's parallel form,
        :func:`~dmc_train.policies.parallel.run_policy`). ``runs``: a list that receives each layer's
        :class:`PolicyRun` (what every query saw and when each entry was evicted). ``with_evicted``: a layer's
        attention that also reads the pairs the policy evicted, ``with_evicted(layer, q, k, v, evicted_at, scale) ->
        [b, H, n, d_v]`` (``evicted_at [b, H_kv, n]``, :class:`PolicyRun`'s; a LESS model's
        ``model.method.attention_with_evicted``: they enter its state). A policy with its own parallel form
        (``parallel_attention``: LightCache) runs that instead; ``budget`` is then unused."""
        if self.decisions is not None:
            raise InferenceError(f"the {scorer.name!r} policy runs on vanilla and GQA models, not on DMC ones")
        if hasattr(scorer, "parallel_attention"):  # a policy with its own parallel form on raw q, k (LightCache)
            return self.forward_with_attention(tokens, scorer.parallel_attention, raw_qk=True)
        tokens = self.check_tokens(tokens)
        positions = self._positions(tokens)

        def attend(layer, q, k, v, info):
            run = run_policy(scorer, q, k, v, budget, layer, prompt_len, horizon)
            if runs is not None:
                runs.append(run)
            return run.out if with_evicted is None else with_evicted(layer, q, k, v, run.evicted_at, self.scale)

        return self._run(tokens, positions, attend)

    @torch.no_grad()
    def forward_with_attention(self, tokens: torch.Tensor, attend: Callable[..., torch.Tensor],
                               raw_qk: bool = False) -> torch.Tensor:
        """Teacher-forced logits ``[b, n, V]`` of ``tokens [b, n]`` with each layer's attention given by
        ``attend(layer, q [b, H, n, d], k [b, H_kv, n, d], v, info) -> [b, H, n, d_v]``. ``raw_qk``: q and k
        arrive before RoPE and ``info.rotate(x, positions)`` applies it (an attention that numbers positions
        itself); the sequence may then be longer than the model's positions."""
        tokens = self.check_tokens(tokens, bounded=not raw_qk)
        return self._run(tokens, self._positions(tokens), attend, raw_qk)

    @torch.no_grad()
    def prefill(self, cache: KVCache, seq_id: int, tokens: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Write the prompt ``tokens [n]`` of a new sequence into ``cache`` in one pass (or in chunks of
        ``cache.prefill_chunk``); logits ``[n, V]`` (``last_only``: the last token's, ``[1, V]``: the LM head
        runs on it alone, as generation needs)."""
        raw = cache.rope_in_cache
        tokens = self.check_tokens(tokens[None], bounded=not raw)[0]
        self.check_cache_type(cache)
        chunk = cache.prefill_chunk or len(tokens)
        logits = [self._run(tokens[None, i: i + chunk], self._positions(tokens[None, i: i + chunk], i),
                            lambda layer, q, k, v, info: cache.prefill(layer, seq_id, q, k, v, info), raw,
                            torch.tensor([-1], device=self.device) if last_only else None)[0]
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
        prompts = [self.check_tokens(p[None])[0] for p in prompts]
        self.check_cache_type(cache)
        lens = [len(p) for p in prompts]
        positions = torch.cat([torch.arange(n, device=self.device) for n in lens])[None]
        # [B]: each prompt's last token
        last = torch.tensor(lens, device=self.device).cumsum(0) - 1 if last_only else None
        logits = self._run(torch.cat(prompts)[None], positions,
                           lambda layer, q, k, v, info: cache.prefill_varlen(layer, seq_ids, q, k, v, info, lens),
                           logits_at=last)
        return list(logits[0].split([1] * len(lens) if last_only else lens))

    @torch.no_grad()
    def decode(self, cache: KVCache, seq_ids: list[int], tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One token per sequence: ``tokens [B]`` at ``positions [B]``; logits ``[B, V]``. The layers' rows are the
        sequences, so q, k, v reach ``cache.decode`` in its layout ``[B, heads, d]`` as they are computed."""
        self.check_cache_type(cache)
        tokens, positions = tokens.to(self.device), positions.to(self.device)
        rotate = self.rope if self.method.rotate_in_cache or cache.rope_in_cache else None

        def attention(layer, q, k, v, alpha, omega):  # q contiguous: a cache views it as [B H_kv, G, d]
            info = TokenInfo(positions, alpha, omega, rotate)
            return cache.decode(layer, seq_ids, q.contiguous(), k, v, info).reshape(len(seq_ids), -1)

        # a layer in one compiled call when the cache's step is a compiled function (no RoPE left to the cache, no
        # tensor parallelism: the layer kernel then runs every part; DMC's decisions between two calls)
        fused = rotate is None and self.group is None and self.layers[0].runs_compiled()
        compiled = (lambda layer: cache.compiled_attention(layer, self.head_counts[0], positions)) if fused else None
        cache.begin_decode(seq_ids)
        try:
            with without_cpu_compat_mode():
                return self._logits(self._layers(tokens, positions[:, None], attention, cache.rope_in_cache,
                                                 compiled))
        finally:
            cache.end_decode()

    # -- checks -----------------------------------------------------------------------------------
    def _positions(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Positions ``[b, n]`` of ``tokens [b, n]`` that start at ``start``, on the model's device."""
        return torch.arange(start, start + tokens.shape[1], device=self.device).expand_as(tokens)

    def check_tokens(self, tokens: torch.Tensor, bounded: bool = True) -> torch.Tensor:
        """``tokens`` on the model's device; one-line errors for an empty sequence, ids outside the vocabulary, and
        (``bounded``) more tokens than the model's positions."""
        n = tokens.shape[-1]
        if n == 0:
            raise InferenceError("the prompt is empty: give at least one token")
        if bounded and n > self.shape.max_positions:
            raise InferenceError(f"the prompt has {n} tokens, more than the model's {self.shape.max_positions} "
                                 f"positions (model.max_position_embeddings); shorten it")
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.shape.vocab_size:
            raise InferenceError(f"token ids must be in [0, {self.shape.vocab_size}); got "
                                 f"[{int(tokens.min())}, {int(tokens.max())}]")
        return tokens.to(self.device)

    def check_cache_type(self, cache: type[KVCache] | KVCache) -> None:
        if cache.needs_decisions and self.decisions is None:
            raise InferenceError(f"the {cache.name!r} cache needs a DMC model, and this checkpoint has no DMC "
                                 f"decisions (its method is not dmc or fixed_pooling); use cache='full'")
