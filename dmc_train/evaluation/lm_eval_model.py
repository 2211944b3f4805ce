"""This project's checkpoints inside lm-eval, with any KV cache of the inference engine.

    lm_eval ... --model dmc_train --model_args checkpoint=runs/base_tiny,cache=h2o,budget=0.25
    python launch/downstream.py --checkpoint runs/base_tiny --cache h2o --option budget=0.25 --tasks shakespeare

(``lm_eval`` knows the name ``dmc_train`` once this module is imported: ``launch/downstream.py`` and
:func:`dmc_train.evaluation.lm_eval_run.run_tasks` import it.)

Log-likelihoods are computed by one of two routes, which agree (tests):

- ``route=parallel`` (default): the cache's teacher-forced parallel form, one forward per batch. Full cache:
  the plain forward; DMC checkpoints: the DMC model's own forward (hard decisions); eviction policies and
  LESS: :meth:`LlamaForInference.forward_with_policy`, with the context as the prompt and the continuation
  decoded token by token (what the policy keeps at each step); LightCache:
  :meth:`LlamaForInference.forward_with_attention` with LightCache's own parallel form (q and k before RoPE).
- ``route=engine``: real incremental decoding in a paged cache of the engine: the context is prefilled,
  then every continuation token is fed one by one (teacher forcing), batched over requests.

``generate_until`` always runs the engine with the cache (greedy unless the task asks for sampling).
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any, Optional

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from dmc_train.errors import CheckpointError, ConfigError, InferenceError
from dmc_train.inference.caches import check_cache, teacher_forced
from dmc_train.policies import POLICIES

ROUTES = ("parallel", "engine")


@register_model("dmc_train")
class DMCTrainLM(TemplateLM):
    """A checkpoint of this project under lm-eval.

    Args:
        checkpoint: a checkpoint or run directory of this project (its ``latest``).
        cache: ``auto`` (the checkpoint's own: ``dmc``, ``less`` or ``full``) or a name of ``CACHES``.
        route: ``parallel`` or ``engine`` (module docstring).
        batch_size: sequences per forward (lm-eval's ``--batch_size``; ``auto`` means 8).
        max_length: most tokens a request is given (left-truncated); default: the model's positions.
        max_gen_toks: default generation length of ``generate_until``.
        tokenizer: a tokenizer path; default: the checkpoint's ``data.tokenizer``.
        dtype: ``fp32``, ``bf16`` or ``fp16``; default: the checkpoint's training precision.
        device: where the model runs (``cpu``, the default, ``cuda``, ``cuda:1``).
        max_batch_size: accepted from lm-eval (``batch_size`` bounds a batch).
        options: the cache's options (``budget``, ``schedule``, a policy's or LightCache's options).
    """

    def __init__(self, checkpoint: str, cache: str = "auto", route: str = "parallel", batch_size: Any = 8,
                 max_length: Optional[int] = None, max_gen_toks: int = 256, tokenizer: Optional[str] = None,
                 dtype: Optional[str] = None, device: Any = None, max_batch_size: Any = None, **options: Any):
        super().__init__()
        from dmc_train.data.tokenizer import load_tokenizer
        from dmc_train.inference.model import LlamaForInference

        if route not in ROUTES:
            raise ConfigError(f"route={route!r} is not known; use one of {', '.join(ROUTES)}")
        if not os.path.exists(str(checkpoint)):
            raise CheckpointError(f"checkpoint {checkpoint} does not exist; pass a checkpoint or run directory")
        self.model, loaded = LlamaForInference.from_checkpoint(str(checkpoint), dtype, device=device or "cpu")
        self.cache_name = self.model.default_cache if cache == "auto" else str(cache)
        check_cache(self.cache_name, self.model)
        if self.model.decisions is not None and self.cache_name != "dmc":
            raise InferenceError(f"{checkpoint} is a DMC model: lm-eval scores it with its DMC cache (cache=auto or "
                                 f"dmc), not {self.cache_name!r}")
        path = tokenizer or loaded.cfg.data.tokenizer
        if not path or not os.path.exists(path):
            raise CheckpointError(f"checkpoint {checkpoint} has no tokenizer file (data.tokenizer={path!r}); pass "
                                  f"tokenizer=<a sentencepiece .model or HF tokenizer directory>")
        self.tokenizer = load_tokenizer(path)
        self.checkpoint, self.route, self.options = str(checkpoint), route, dict(options)
        self.batch_size = 8 if batch_size in (None, "auto") or str(batch_size).startswith("auto") else int(batch_size)
        positions = self.model.shape.max_positions
        self._max_length = int(max_length) if max_length else positions
        if self._max_length > positions and self.cache_name != "lightcache":
            raise ConfigError(f"max_length={self._max_length} is more than the model's {positions} positions; only "
                              f"the lightcache cache numbers positions itself and runs past them")
        self.max_gen_toks = int(max_gen_toks)
        self.forward = teacher_forced(self.cache_name, self.model, self.options)  # checks the options now
        # an eviction policy's parallel form takes one prompt length per batch (and Keyformer one horizon)
        policy = self.model.method.policy if self.cache_name == "less" else self.cache_name
        self._policy = policy if policy in POLICIES else None
        self._engine = None

    # -- lm-eval's interface ----------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return os.path.basename(self.tokenizer.path)

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each string's log-likelihood from disjoint windows of ``max_length`` tokens (lm-eval's rule: each
        token predicted once, the first window after the EOS token)."""
        windows, owner = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                    self.tok_encode(string), self.prefix_token_id, self.max_length, context_len=1)):
                windows.append((None, ctx, cont))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[i] += logprob
        return totals

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """``(log p(continuation | context), greedy)`` of ``(key, context ids, continuation ids)`` requests."""
        items = [self._truncate(ctx, cont) for _, ctx, cont in requests]
        results: list[Optional[tuple[float, bool]]] = [None] * len(items)
        score = self._score_parallel if self.route == "parallel" else self._score_engine
        for batch in tqdm(self._batches(items), desc=f"log-likelihoods ({self.cache_name}, {self.route})",
                          disable=disable_tqdm):
            for i, r in zip(batch, score([items[i] for i in batch])):
                results[i] = r
        return results  # type: ignore[return-value]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, if the task asks) generation through the engine with the cache, cut at the
        first of the task's ``until`` strings."""
        from dmc_train.inference.sampling import SamplingParams

        prompts, params = [], []
        for context, gen_kwargs in (req.args for req in requests):
            kwargs = dict(gen_kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            sample = bool(kwargs.pop("do_sample", False))
            temperature = float(kwargs.pop("temperature", 1.0 if sample else 0.0)) if sample else 0.0
            ids = self.tok_encode(context)
            if not self.engine.unbounded:  # the model's positions hold the prompt and the generation
                ids = ids[-max(1, self.max_length - new):]
            prompts.append(ids or [self.prefix_token_id])
            params.append(SamplingParams(max_new_tokens=new, temperature=temperature, stop=tuple(until),
                                         seed=0 if sample else None))
        texts = []
        for first in tqdm(range(0, len(prompts), self.batch_size), desc=f"generation ({self.cache_name})",
                          disable=disable_tqdm):
            outs = self.engine.generate(prompts[first: first + self.batch_size], params[first: first + self.batch_size])
            for out in outs:
                if out.error:
                    raise InferenceError(f"generation failed: {out.error}")
                texts.append(out.text)
        return texts

    # -- the engine -------------------------------------------------------------------------------
    @property
    def engine(self):
        """The engine with this cache (built on first use): generation, and the ``engine`` route's cache."""
        if self._engine is None:
            from dmc_train.inference.engine import Engine

            self._engine = Engine(self.model, self.tokenizer, cache=self.cache_name, max_batch=self.batch_size,
                                  **self.options)
        return self._engine

    # -- scoring ----------------------------------------------------------------------------------
    def _truncate(self, ctx: list[int], cont: list[int]) -> tuple[list[int], list[int]]:
        """Left-truncate so that the model sees at most ``max_length`` tokens (the last continuation token is
        never fed)."""
        if not cont:
            raise InferenceError("a request has an empty continuation; the task's targets must not be empty")
        if len(cont) > self.max_length:
            raise InferenceError(f"a continuation of {len(cont)} tokens is longer than max_length={self.max_length}; "
                                 f"raise max_length or shorten the task's targets")
        whole = (ctx + cont)[-(self.max_length + 1):]
        return whole[: len(whole) - len(cont)], cont

    def _batches(self, items: list[tuple[list[int], list[int]]]) -> list[list[int]]:
        """Request indices in batches of ``batch_size``, longest first, right-padded (causal: padding is never
        seen). An eviction policy's parallel form takes one prompt length per batch, so its batches share the
        context length; Keyformer's temperature schedule also depends on the generation length (its horizon),
        so its batches share that too."""
        by_key: dict[tuple, list[int]] = defaultdict(list)
        policy = self.route == "parallel" and self._policy is not None
        horizon = policy and self._policy == "keyformer"
        for i, (ctx, cont) in enumerate(items):
            by_key[((len(ctx),) if policy else ()) + ((len(cont),) if horizon else ())].append(i)
        batches = []
        for key in sorted(by_key):
            group = sorted(by_key[key], key=lambda i: -(len(items[i][0]) + len(items[i][1])))
            batches += [group[j: j + self.batch_size] for j in range(0, len(group), self.batch_size)]
        return batches

    def _score_parallel(self, batch: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        inputs = [(ctx + cont)[:-1] for ctx, cont in batch]
        width = max(len(x) for x in inputs)
        tokens = torch.tensor([x + [0] * (width - len(x)) for x in inputs])  # right padding: causal, never seen
        horizon = max(len(cont) for _, cont in batch) - 1  # what each sequence decodes (padding included)
        logits = self.forward(tokens, len(batch[0][0]), horizon)
        return [_continuation_score(logits[i, len(ctx) - 1: len(ctx) - 1 + len(cont)], cont)
                for i, (ctx, cont) in enumerate(batch)]

    @torch.no_grad()
    def _score_engine(self, batch: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        cache = self.engine.new_cache()
        rows: list[list[torch.Tensor]] = []
        try:
            for seq, (ctx, cont) in enumerate(batch):
                cache.add(seq, len(cont) - 1)
                rows.append([self.model.prefill(cache, seq, torch.tensor(ctx))[-1]])
            for step in range(max(len(cont) for _, cont in batch) - 1):
                live = [seq for seq, (_, cont) in enumerate(batch) if step + 1 < len(cont)]
                logits = self.model.decode(cache, live, torch.tensor([batch[s][1][step] for s in live]),
                                           torch.tensor([len(batch[s][0]) + step for s in live]))
                for s, row in zip(live, logits):
                    rows[s].append(row)
        finally:
            for seq in list(cache.rows):
                cache.release(seq)
        return [_continuation_score(torch.stack(r), cont) for r, (_, cont) in zip(rows, batch)]


def _continuation_score(logits: torch.Tensor, cont: list[int]) -> tuple[float, bool]:
    """``(sum of log p(cont[i]), every cont[i] the argmax)`` from the logits ``[len(cont), V]`` predicting them."""
    target = torch.tensor(cont, device=logits.device)
    logprobs = F.log_softmax(logits.float(), dim=-1)
    return float(logprobs.gather(1, target[:, None]).sum()), bool((logprobs.argmax(-1) == target).all())
