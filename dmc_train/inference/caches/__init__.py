"""KV caches of the inference engine, one interface (:class:`KVCache`, ``base.py``), one file each, and
the one registry that picks them by name (:data:`CACHES`, :func:`build_cache`).

    full       every token (vanilla; also GQA models, whose rows are their fewer KV heads)
    dmc        Dynamic Memory Compression, Algorithm 1 (DMC and Fixed Memory Pooling checkpoints)
    <policy>   a fixed budget kept by an eviction policy (every name of ``dmc_train.policies.POLICIES``):
               one evicting cache (``evicting.py``) for all
    less       LESS checkpoints: their policy plus the low-rank state of the evicted pairs (``less.py``)
    lightcache every token kept, older ones compressed in the feature dimension, a selected window
               attended at its own positions (``lightcache.py``; vanilla and GQA checkpoints)

A model's method hook declares the cache it needs (``LlamaForInference.default_cache``: ``dmc`` for DMC
checkpoints, ``less`` for LESS ones, else ``full``); ``cache="auto"`` takes it. An entry's ``build(pool, model,
options)`` makes the cache from the model (shape, scale, ``model.method``: DMC's settings, LESS's kernels) and the
user's options.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from dmc_train.errors import InferenceError
from dmc_train.inference.caches.base import KVCache, TokenInfo
from dmc_train.inference.caches.dmc import DMCCache, teacher_forced_dmc
from dmc_train.inference.caches.evicting import EvictingCache
from dmc_train.inference.caches.full import FullCache, causal_attention
from dmc_train.inference.caches.less import LESSCache, LESSWeights
from dmc_train.inference.caches.lightcache import PagedLightCache, lightcache_for
from dmc_train.policies import POLICIES, build_scorer


@dataclass(frozen=True)
class CacheEntry:
    """``build(pool, model, options) -> KVCache``; ``parallel(model, options) -> forward(tokens [b, n],
    prompt_len=1, horizon=None) -> logits [b, n, V]``: the cache's teacher-forced (parallel) form, what the
    engine computes when the first ``prompt_len`` tokens are prefilled and the rest decoded one by one with
    this cache (``horizon``: the tokens each sequence generates, default the rest: Keyformer's schedule);
    ``dmc``: True = DMC checkpoints only (a model with decisions), False = not on them; ``needs``: the cache the
    model's method must declare (``less``: a LESS checkpoint, whose hook holds the kernels)."""

    build: Callable[..., KVCache]
    parallel: Callable[..., Callable[[Any, int], Any]]
    dmc: bool
    needs: str = ""


def _no_options(name: str, options: dict) -> None:
    if options:
        raise InferenceError(f"the {name} cache takes no options (got {', '.join(sorted(options))})")


def _full(pool, model, options):
    _no_options("full", options)
    s = model.shape
    return FullCache(pool, s.num_layers, s.num_kv_heads, model.scale)


def _dmc(pool, model, options):
    _no_options("dmc", options)
    s = model.shape
    return DMCCache(pool, s.num_layers, s.num_kv_heads, model.scale, settings=model.method.settings)


def _own_forward(name: str) -> Callable[..., Callable]:
    """The model's plain teacher-forced forward (full attention; DMC: its hard decisions, Algorithm 1's result)."""
    def parallel(model, options):
        _no_options(name, options)
        return lambda tokens, prompt_len=1, horizon=None: model.forward(tokens)
    return parallel


def _scorer(name: str, model, options):
    s = model.shape
    return build_scorer(name, options, s.head_dim, s.num_heads // s.num_kv_heads, model.scale)


def _engine_budget(scorer) -> Optional[int]:
    """The budget in entries of the engine's cache (it serves requests of any length: a fraction is refused); None
    for the prefill schedule, which does not use it."""
    return scorer.budget(None) if scorer.cfg.schedule == "decode" else None


def _policy(name: str) -> Callable[..., KVCache]:
    def build(pool, model, options):
        s = model.shape
        scorer = _scorer(name, model, options)
        return EvictingCache(pool, s.num_layers, s.num_kv_heads, model.scale, scorer, _engine_budget(scorer),
                             s.max_positions)
    return build


def _policy_parallel(name: str) -> Callable[..., Callable]:
    def parallel(model, options):
        scorer = _scorer(name, model, options)
        return lambda tokens, prompt_len=1, horizon=None: model.forward_with_policy(
            tokens, scorer, scorer.budget(tokens.shape[1]), prompt_len, horizon)
    return parallel


def _less_scorer(model, options):
    """A LESS checkpoint's policy at the budget it was trained at (entries); ``options`` may change them (a LESS
    trained at one budget runs at another: the paper's transfer rows)."""
    w = model.method
    return _scorer(w.policy, model, {**w.options, "budget": w.budget, **options})


def _less(pool, model, options):
    s = model.shape
    scorer = _less_scorer(model, options)
    return LESSCache(pool, s.num_layers, s.num_kv_heads, model.scale, scorer, _engine_budget(scorer),
                     s.max_positions, model.method)


def _less_parallel(model, options):
    scorer = _less_scorer(model, options)
    return lambda tokens, prompt_len=1, horizon=None: model.forward_with_policy(
        tokens, scorer, scorer.budget(tokens.shape[1]), prompt_len, horizon,
        with_evicted=model.method.attention_with_evicted)


def _lightcache_parallel(model, options):
    rule = lightcache_for(model, options)
    return lambda tokens, prompt_len=1, horizon=None: model.forward_with_attention(tokens, rule.parallel_attention,
                                                                                   raw_qk=True)


CACHES: dict[str, CacheEntry] = {
    "full": CacheEntry(_full, _own_forward("full"), False),
    "dmc": CacheEntry(_dmc, _own_forward("dmc"), True),
    **{name: CacheEntry(_policy(name), _policy_parallel(name), False) for name in POLICIES},
    "less": CacheEntry(_less, _less_parallel, False, needs="less"),
    "lightcache": CacheEntry(PagedLightCache.build, _lightcache_parallel, False)}


def check_cache(name: str, model: Any) -> None:
    """One-line :class:`InferenceError` when ``name`` is unknown or does not fit ``model``."""
    if name not in CACHES:
        raise InferenceError(f"unknown cache {name!r}; expected auto or one of {', '.join(CACHES)}")
    if CACHES[name].dmc and model.decisions is None:
        raise InferenceError(f"the {name!r} cache needs a DMC model, and this checkpoint has no DMC decisions (its "
                             f"method is not dmc or fixed_pooling); use cache='full' or an eviction policy")
    if CACHES[name].needs and model.method.cache != CACHES[name].needs:
        raise InferenceError(f"the {name!r} cache needs a checkpoint trained with method={name} (its kernels); "
                             f"this one has none: use cache='auto' or an eviction policy")
    if name in POLICIES and model.decisions is not None:
        raise InferenceError(f"the {name!r} policy runs on vanilla and GQA checkpoints; this one is a DMC model, "
                             f"which compresses with its own cache: use cache='dmc' (or auto)")


def build_cache(name: str, pool, model: Any, options: dict[str, Any]) -> KVCache:
    """The cache ``name`` for ``model`` on ``pool`` with ``options`` (one-line errors for bad ones)."""
    return _checked(name, model, lambda: CACHES[name].build(pool, model, dict(options)))


def teacher_forced(name: str, model: Any, options: dict[str, Any]) -> Callable[..., Any]:
    """The parallel form of the cache ``name`` for ``model``: ``forward(tokens [b, n], prompt_len=1, horizon=None)
    -> logits [b, n, V]``, equal to decoding with the cache (``tests/inference``); one-line errors for bad
    options."""
    return _checked(name, model, lambda: CACHES[name].parallel(model, dict(options)))


def cache_budget(name: str, model: Any, options: dict[str, Any], context: int) -> Optional[int]:
    """What bounds the cache ``name`` per (sequence, layer, KV head) on ``context`` tokens: a policy's (or LESS's)
    budget in entries (a fraction resolved against ``context``), LightCache's attention window; None for ``full``
    and ``dmc``."""
    if name == "lightcache":
        return _checked(name, model, lambda: lightcache_for(model, dict(options)).settings.window)
    if name == "less":
        return _checked(name, model, lambda: _less_scorer(model, dict(options)).budget(context))
    if name in POLICIES:
        return _checked(name, model, lambda: _scorer(name, model, dict(options)).budget(context))
    return None


def for_context(name: str, model: Any, options: dict[str, Any], context: int) -> dict[str, Any]:
    """``options`` with a policy's (or LESS's) budget in entries for ``context`` tokens, as the engine's cache needs
    it (the engine serves requests of any length, so a fraction of the context is resolved by whoever knows it)."""
    if name in POLICIES or name == "less":
        return {**options, "budget": cache_budget(name, model, options, context)}
    return dict(options)


def _checked(name: str, model: Any, make: Callable[[], Any]) -> Any:
    from dmc_train.errors import ConfigError

    check_cache(name, model)
    try:
        return make()
    except ConfigError as e:
        raise InferenceError(str(e)) from None


__all__ = ["CACHES", "DMCCache", "EvictingCache", "FullCache", "KVCache", "LESSCache", "LESSWeights",
           "PagedLightCache", "TokenInfo", "build_cache", "cache_budget", "causal_attention", "check_cache",
           "for_context", "teacher_forced", "teacher_forced_dmc"]
