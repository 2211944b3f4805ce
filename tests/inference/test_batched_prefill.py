"""Batched ragged prefill: prompts of different lengths prefilled together in one forward (packed, no padding)
give the logits and the cache contents of prefilling each alone, for the full cache (MHA and GQA), DMC and an
eviction policy; the engine prefills the prompts it admits in one step together, with the same tokens."""

import pytest
import torch

from dmc_train.errors import InferenceError
from dmc_train.inference.caches.evicting import EvictingCache
from dmc_train.inference.engine import Engine
from dmc_train.inference.model import LlamaForInference, random_weights
from dmc_train.inference.sampling import SamplingParams
from dmc_train.policies import POLICIES
from tests.inference.conftest import SHAPE, VARIANTS

LENGTHS = (7, 1, 33, 16, 20)
PROMPTS = [torch.randint(0, SHAPE.vocab_size, (n,), generator=torch.Generator().manual_seed(n)) for n in LENGTHS]
MHA = SHAPE.__class__(**{**SHAPE.__dict__, "num_kv_heads": SHAPE.num_heads})


def model_for(case: str) -> tuple[LlamaForInference, dict]:
    """(model, engine options) of a case: ``mha`` / ``gqa`` full cache, a DMC variant, or ``h2o``."""
    if case == "mha":
        return LlamaForInference(MHA, random_weights(MHA)), {}
    variant = {"gqa": "full", "h2o": "full"}.get(case, case)
    options = {"cache": "h2o", "budget": 12} if case == "h2o" else {}
    return LlamaForInference(SHAPE, random_weights(SHAPE), VARIANTS[variant]), options


def cache_contents(engine: Engine, seq_id: int) -> list[torch.Tensor]:
    """Every row's K and V entries, and the per-row state of a DMC cache."""
    cache, out = engine.cache, []
    rows = cache.rows[seq_id].flatten()
    for row in rows.tolist():
        out += list(engine.pool.read(row))
    for name in ("open_k", "open_v", "open_w", "open_tokens"):
        if hasattr(cache, name):
            out.append(getattr(cache, name)[rows])
    return out


def assert_batched_equals_alone(model, options, prompts):
    """Prefilling ``prompts`` together and each alone: the same logits, entries, cache contents and per-row state."""
    together, alone = Engine(model, max_batch=8, **options), Engine(model, max_batch=8, **options)
    ids = list(range(len(prompts)))
    for i in ids:
        together.cache.add(i)
        alone.cache.add(i)
    batched = model.prefill_batch(together.cache, ids, prompts)
    single = [model.prefill(alone.cache, i, p) for i, p in zip(ids, prompts)]
    for i in ids:
        torch.testing.assert_close(batched[i], single[i], rtol=0, atol=1e-5)
        assert torch.equal(together.cache.entries(i), alone.cache.entries(i))
        for a, b in zip(cache_contents(together, i), cache_contents(alone, i)):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        if isinstance(alone.cache, EvictingCache):  # its per-entry state
            rows = together.cache.rows[i].flatten()
            for name, t in alone.cache.row_state().items():
                torch.testing.assert_close(together.cache.row_state()[name][rows], t[rows], rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", ["mha", "gqa", "dmc_exact", "dmc_pre_window", "fixed_pooling", "h2o"])
def test_batched_prefill_equals_one_at_a_time(case):
    assert_batched_equals_alone(*model_for(case), PROMPTS)


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("schedule", ["decode", "prefill"])
@pytest.mark.parametrize("lens", [(16, 7, 16, 33, 16, 7), (16, 16, 16)])
def test_an_eviction_policy_prefills_prompts_of_one_length_together_as_each_alone(policy, schedule, lens):
    """An eviction policy's cache batches the prompts of equal length (attention, prompt scores, compression; when all
    have one, over views of the packed tokens): the logits, kept entries and per-entry state of prefilling each
    alone."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, SHAPE.vocab_size, (n,), generator=g) for n in lens]
    assert_batched_equals_alone(LlamaForInference(SHAPE, random_weights(SHAPE)),
                                {"cache": policy, "budget": 15, "schedule": schedule}, prompts)


@pytest.mark.parametrize("case", ["gqa", "dmc_exact"])
def test_the_engine_prefills_what_it_admits_together_with_the_same_tokens(case):
    model, options = model_for(case)
    params = [SamplingParams(max_new_tokens=12, temperature=0.8 * (i % 2), seed=i) for i in range(len(PROMPTS))]
    prompts = [p.tolist() for p in PROMPTS]
    batched = Engine(model, max_batch=8, **options)
    serial = Engine(model, max_batch=8, max_prefill_tokens=1, **options)  # one prompt per forward
    assert [o.tokens for o in batched.generate(prompts, params)] == [o.tokens for o in serial.generate(prompts, params)]
    assert batched.stats["prefill_batches"] == 1 and serial.stats["prefill_batches"] == len(prompts)


def test_max_prefill_tokens_bounds_a_batched_prefill(make_model):
    model = make_model("full")
    prompts = [p.tolist() for p in PROMPTS]  # 7, 1, 33, 16, 20 tokens
    engine = Engine(model, max_batch=8, max_prefill_tokens=40)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=3))
    assert engine.stats["prefill_batches"] == 3  # [7, 1], [33] (a longer one would go alone), [16, 20]
    assert [o.tokens for o in outs] == [o.tokens for o in Engine(model, max_batch=8).generate(prompts, SamplingParams(
        max_new_tokens=3))]
    with pytest.raises(InferenceError, match="max_prefill_tokens=0 must be >= 1 \\(or None: no limit\\)"):
        Engine(model, max_prefill_tokens=0)
