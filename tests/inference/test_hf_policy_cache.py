"""Every policy inside plain transformers (``dmc_train/inference/hf_policy_cache.py``): greedy
``model.generate(past_key_values=PolicyCache(...))`` on a tiny random GQA ``LlamaForCausalLM`` decodes what
the policy's parallel form (``LlamaForInference.forward_with_policy``, same weights) predicts, keeps what
it keeps at every step, holds at most ``budget`` entries in constant bytes, equals the full cache when
the budget covers the sequence, and refuses what it cannot do in one line."""

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, LogitsProcessor, LogitsProcessorList

from dmc_train.errors import ConfigError, InferenceError
from dmc_train.inference.hf_policy_cache import PolicyCache
from dmc_train.inference.model import LlamaForInference, ModelShape, random_weights
from dmc_train.policies import POLICIES, build_scorer
from dmc_train.policies.parallel import prompt_keep

SHAPE = ModelShape(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_heads=4, num_kv_heads=2, vocab_size=64,
                   max_positions=128)
P, NEW, BUDGET = 12, 30, 16
SCHEDULES = ["decode", "prefill"]


def hf_llama(weights) -> LlamaForCausalLM:
    config = LlamaConfig(**SHAPE.hf_config(bos_token_id=None, eos_token_id=None, pad_token_id=None,
                                           attn_implementation="eager"))
    model = LlamaForCausalLM(config).eval()
    model.load_state_dict(weights)
    return model



@pytest.fixture(scope="module")
def models(device):
    """``(hf, plain, ours)``: the HF model PolicyCache switches to its attention, an untouched HF copy (eager,
    DynamicCache) and the project's inference model, all on the same weights, on the test device."""
    weights = random_weights(SHAPE)
    return hf_llama(weights).to(device), hf_llama(weights).to(device), LlamaForInference(SHAPE, weights, device=device)


@pytest.fixture(scope="module")
def prompts(device):
    g = torch.Generator().manual_seed(1)
    return torch.stack([torch.randperm(SHAPE.vocab_size, generator=g)[:P] for _ in range(2)]).to(device)  # [2, P]


class Recorder(LogitsProcessor):
    """Runs once per forward of ``generate()`` (leaves the scores alone): the cache's entries and bytes."""

    def __init__(self, cache):
        self.cache, self.entries, self.bytes = cache, [], []

    def __call__(self, input_ids, scores):
        self.entries.append(self.cache.entries().clone())
        self.bytes.append(self.cache.nbytes())
        return scores


def generate(model, ids, cache):
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, past_key_values=cache, output_logits=True,
                         return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits, 1)  # [b, P + NEW], [b, NEW, V]


def scorer_for(policy, options):
    s = SHAPE
    return build_scorer(policy, options, s.head_dim, s.num_heads // s.num_kv_heads, s.head_dim ** -0.5)


def first_tie(seq: torch.Tensor, evicted_at: torch.Tensor) -> int:
    """The first decode step at which the parallel form evicts one of two kept copies of a token, from
    ``seq [n]`` and the first layer's ``evicted_at [H_kv, n]`` (n if none). Knorm: copies of a token have the
    same first-layer key norm up to float noise (policies/knorm.py), so which one goes is noise."""
    n = len(seq)
    for t in range(P, n):
        for ev in evicted_at:
            kept = (torch.arange(n) < t) & ((ev < 0) | (ev >= t))  # before step t's eviction
            for j in (ev == t).nonzero()[:, 0].tolist():
                if int((kept & (seq == seq[j])).sum()) > 1:
                    return t
    return n


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("policy", list(POLICIES))
def test_generate_decodes_what_the_parallel_form_predicts(models, prompts, policy, schedule):
    hf, _, ours = models
    options = {"budget": BUDGET, "schedule": schedule}
    cache = PolicyCache(hf, policy, max_new_tokens=NEW, **options)
    recorder = Recorder(cache)
    out = hf.generate(prompts, max_new_tokens=NEW, do_sample=False, past_key_values=cache, output_logits=True,
                      return_dict_in_generate=True, logits_processor=LogitsProcessorList([recorder]))
    seq, got = out.sequences, torch.stack(out.logits, 1)
    runs = []
    want = ours.forward_with_policy(seq, scorer_for(policy, options), BUDGET, prompt_len=P, horizon=NEW,
                                    runs=runs)[:, P - 1: -1]
    for i in range(len(seq)):
        # Knorm: exact up to the first eviction that picks between two copies of a token (a float-noise tie);
        # test_every_step_keeps_what_the_parallel_form_keeps covers it over whole sequences of distinct tokens
        end = min(NEW, first_tie(seq[i].cpu(), runs[0].evicted_at[i].cpu()) - P + 1) if policy == "knorm" else NEW
        assert torch.equal(want[i, :end].argmax(-1), seq[i, P: P + end])
        torch.testing.assert_close(got[i, :end], want[i, :end], rtol=1e-4, atol=1e-4)
    # memory: [b, H_kv, budget, d] buffers written in place (decode); kvpress's prompt + appended tokens (prefill)
    keep = prompt_keep(cache.scorer, BUDGET, P)[0]
    sizes = [min(P + j, BUDGET) if schedule == "decode" else keep + j for j in range(NEW)]
    assert [e.unique().tolist() for e in recorder.entries] == [[n] for n in sizes]
    if schedule == "decode":
        assert all(layer.keys.shape == (2, SHAPE.num_kv_heads, BUDGET, SHAPE.head_dim) for layer in cache.layers)
        assert len(set(recorder.bytes)) == 1
    assert cache.get_seq_length() == P + NEW - 1  # the last token is never fed back


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_step_keeps_what_the_parallel_form_keeps(models, policy, schedule):
    """Teacher-forced through the cache (the prompt, then one token per forward) on sequences without a repeated
    token: the logits of every position and, for the decode schedule, the kept positions after every step."""
    hf, _, ours = models
    g = torch.Generator().manual_seed(2)
    seq = torch.stack([torch.randperm(SHAPE.vocab_size, generator=g)[:P + NEW] for _ in range(2)]).to(hf.device)
    options = {"budget": BUDGET, "schedule": schedule}
    # without max_new_tokens (Keyformer's paper schedule needs it) the prefill schedule grows its buffers
    cache = PolicyCache(hf, policy, max_new_tokens=NEW if policy == "keyformer" else 0, **options)
    kept = {}
    with torch.no_grad():
        logits = [hf(seq[:, :P], past_key_values=cache).logits]
        for t in range(P, P + NEW):
            logits.append(hf(seq[:, t: t + 1], past_key_values=cache).logits)
            kept[t] = [layer.entries.positions.view(2, SHAPE.num_kv_heads, -1).clone() for layer in cache.layers]
    runs = []
    want = ours.forward_with_policy(seq, scorer_for(policy, options), BUDGET, prompt_len=P, horizon=NEW, runs=runs)
    torch.testing.assert_close(torch.cat(logits, 1), want, rtol=1e-4, atol=1e-4)
    if schedule == "decode":
        for layer, run in enumerate(runs):
            visible = run.visible()  # [b, H_kv, n, n]
            for t in range(P, P + NEW):
                for b in range(2):
                    for h in range(SHAPE.num_kv_heads):
                        mine = sorted(x for x in kept[t][layer][b, h].tolist() if x >= 0)
                        assert mine == visible[b, h, t].nonzero()[:, 0].tolist(), (layer, t, b, h)
                        assert len(mine) == min(BUDGET, t + 1)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_a_budget_that_covers_the_sequence_is_the_full_cache(models, prompts, policy):
    hf, plain, _ = models
    tokens, logits = generate(plain, prompts, DynamicCache(config=plain.config))
    for options in ({"budget": 64, "schedule": "decode"}, {"budget": 64, "schedule": "prefill",
                                                          "compression_ratio": 0.0}):
        got_tokens, got_logits = generate(hf, prompts, PolicyCache(hf, policy, max_new_tokens=NEW, **options))
        assert torch.equal(got_tokens, tokens), options
        torch.testing.assert_close(got_logits, logits, rtol=1e-4, atol=1e-4)
    # the switched model still runs every other cache as before (SDPA)
    assert torch.equal(generate(hf, prompts, DynamicCache(config=hf.config))[0], tokens)


def test_what_it_cannot_do_fails_in_one_line(models, prompts):
    hf = models[0]
    mask = torch.ones_like(prompts)
    mask[0, :3] = 0  # left padding
    with pytest.raises(InferenceError, match="without padding"):
        hf.generate(prompts, attention_mask=mask, max_new_tokens=3, past_key_values=PolicyCache(hf, "h2o", budget=8))
    cache = PolicyCache(hf, "tova", budget=8)
    with torch.no_grad():
        hf(prompts, past_key_values=cache)
        with pytest.raises(InferenceError, match="one token per forward"):
            hf(prompts[:, :4], past_key_values=cache)
    with pytest.raises(InferenceError, match="beam search"):
        hf.generate(prompts, max_new_tokens=3, num_beams=2, past_key_values=PolicyCache(hf, "h2o", budget=8))
    with pytest.raises(ConfigError, match="max_new_tokens"):
        PolicyCache(hf, "keyformer", budget=8)
    with pytest.raises(ConfigError, match="unknown policy"):
        PolicyCache(hf, "lru", budget=8)
    with pytest.raises(ConfigError, match="budget 4"):
        PolicyCache(hf, "lsh_e", budget=4)
