"""The LESS cache in the engine: its decoding equals the parallel (training) form, its state is the sum over
every pair the policy evicted, an empty state (D1 = D2 = 0) is the policy alone, and its memory is the
budget plus a constant state."""

import pytest
import torch

from dmc_train.inference.caches import build_cache
from dmc_train.inference.caches.less import LESSWeights
from dmc_train.inference.engine import Engine
from dmc_train.inference.model import LlamaForInference
from dmc_train.inference.sampling import SamplingParams
from dmc_train.policies import build_scorer
from dmc_train.policies.parallel import run_policy
from kernels.less import eviction_masks, less_attention, phi_k, phi_q
from tests.inference.conftest import SHAPE, random_weights
from tests.inference.test_policy_caches import decode_through_cache, new_pool

BUDGET, RANK, HIDDEN = 12, 4, 16


def less_weights(policy="h2o", scale_d=1.0, seed=0, options=None) -> LESSWeights:
    g = torch.Generator().manual_seed(seed)
    h, hk, d = SHAPE.num_heads, SHAPE.num_kv_heads, SHAPE.head_dim

    def rnd(*size):
        return torch.randn(*size, generator=g) * 0.3

    layers = [{"q1": rnd(h, d, HIDDEN), "q1_bias": rnd(h, HIDDEN), "q2": rnd(h, HIDDEN, RANK), "q2_bias": rnd(h, RANK),
               "k1": rnd(hk, d, HIDDEN), "k1_bias": rnd(hk, HIDDEN), "k2": rnd(hk, HIDDEN, RANK),
               "k2_bias": rnd(hk, RANK), "k_int": rnd(hk, RANK, RANK), "d1": torch.full((hk, RANK), scale_d),
               "d2": torch.full((hk, RANK), scale_d)} for _ in range(SHAPE.num_layers)]
    return LESSWeights(policy, BUDGET, options or {}, layers)


def less_model(**kw) -> LlamaForInference:
    return LlamaForInference(SHAPE, random_weights(SHAPE), less_weights(**kw), torch.float32)


def scorer_of(model):
    w = model.method
    return build_scorer(w.policy, {"budget": w.budget, **w.options}, SHAPE.head_dim,
                        SHAPE.num_heads // SHAPE.num_kv_heads, model.scale)


@pytest.mark.parametrize("policy, schedule", [("h2o", "decode"), ("streaming_llm", "decode"), ("tova", "decode"),
                                              ("h2o", "prefill")])
def test_decoding_equals_the_parallel_form(policy, schedule):
    model = less_model(policy=policy, options={"schedule": schedule})
    g = torch.Generator().manual_seed(1)
    sequences = [torch.randperm(SHAPE.vocab_size, generator=g)[:n] for n in (40, 29, 33)]
    prompts = [5, 1, 20]
    cache = build_cache("less", new_pool(device=model.device), model, {})
    assert model.default_cache == "less" and cache.name == "less"
    got, _ = decode_through_cache(model, cache, sequences, prompts)
    for i, (seq, p) in enumerate(zip(sequences, prompts)):
        want = model.forward_with_policy(seq[None], scorer_of(model), BUDGET, p, horizon=len(seq) - p,
                                         with_evicted=model.method.attention_with_evicted)[0]
        torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-4)
        plain = model.forward_with_policy(seq[None], scorer_of(model), BUDGET, p, horizon=len(seq) - p)[0]
        if schedule == "decode" or p > 2:  # something was evicted: the state changes the outputs
            assert not torch.allclose(plain, want, atol=1e-3)


def test_the_state_is_the_sum_over_every_evicted_pair():
    model = less_model(seed=2)
    seq = torch.randperm(SHAPE.vocab_size, generator=torch.Generator().manual_seed(2))[:45]
    cache = build_cache("less", new_pool(device=model.device), model, {})
    decode_through_cache(model, cache, [seq[:-1]], [6])  # the last token is never fed
    captured = {}

    def attend(layer, q, k, v, info):  # the LESS parallel form, as forward_with_policy(with_evicted=...)
        evicted_at = run_policy(scorer_of(model), q, k, v, BUDGET, layer, prompt_len=6).evicted_at
        captured[layer] = (k, v, evicted_at)
        w = model.method.layers[layer]
        return less_attention(q, k, v, *eviction_masks(evicted_at), phi_q(q, w), phi_k(k, w), model.scale)

    model._run(seq[None, :-1], torch.arange(len(seq) - 1)[None], attend)
    for layer, (k, v, evicted_at) in captured.items():
        gone = (evicted_at[0] >= 0).float()  # [H_kv, n]: evicted by the end
        features = phi_k(k, model.method.layers[layer])[0] * gone[..., None]  # [H_kv, n, rank]
        rows = cache.rows[0][layer]
        torch.testing.assert_close(cache.H[rows], features.transpose(1, 2) @ v[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(cache.z[rows], features.sum(1), rtol=1e-4, atol=1e-5)


def test_an_empty_state_decodes_as_the_policy_alone():
    model = less_model(scale_d=0.0, seed=3)
    prompt, params = list(range(3, 30)), SamplingParams(max_new_tokens=25)
    less = Engine(model, cache="less").generate([prompt], params)[0]
    policy = Engine(model, cache="h2o", budget=BUDGET).generate([prompt], params)[0]
    assert less.tokens == policy.tokens


def test_memory_is_the_budget_plus_a_constant_state():
    model = less_model(seed=4)
    engine = Engine(model, cache="less", kv_bytes=1 << 20, max_batch=1)
    engine.add_request(list(range(1, 20)), SamplingParams(max_new_tokens=100))
    held = []
    while engine.has_work():
        engine.step()
        if engine.running:
            held.append(engine.cache.bytes_held(engine.running[0].id))
    rows = SHAPE.num_layers * SHAPE.num_kv_heads
    assert all(h == held[0] for h in held)  # full from the prompt on (19 > budget)
    assert held[0]["entries"] == rows * BUDGET * engine.pool.page_bytes // engine.pool.page_size
    assert held[0]["state"] >= rows * (RANK * SHAPE.head_dim + RANK) * 4  # H and z per row, fp32
    assert engine.pool.used_pages == 0


def test_the_less_cache_needs_a_less_checkpoint(make_model):
    from dmc_train.errors import InferenceError

    with pytest.raises(InferenceError, match="needs a checkpoint trained with method=less"):
        Engine(make_model("full"), cache="less")
