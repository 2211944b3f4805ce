"""Eviction policies in the engine: the incremental cache keeps what the parallel form keeps at every
step (every policy, both schedules, a ragged GQA batch), teacher-forced log-likelihoods agree, the
prefill schedule keeps kvpress's positions, the bytes held stay at the budget, bad settings fail in
one line."""

import pytest
import torch

from dmc_train.errors import InferenceError
from dmc_train.evaluation.incremental import teacher_forced_decode
from dmc_train.inference.caches import EvictingCache, build_cache
from dmc_train.inference.engine import Engine
from dmc_train.inference.model import LlamaForInference, ModelShape
from dmc_train.inference.pool import PagePool
from dmc_train.inference.sampling import SamplingParams
from dmc_train.policies import POLICIES, PolicyConfig, Scorer, build_scorer
from tests.inference.conftest import SHAPE, random_weights

SCHEDULES = ["decode", "prefill"]
BUDGET = 20


def new_pool(shape=SHAPE, num_pages=256, device="cpu"):
    return PagePool(num_pages, 16, shape.head_dim, 16 * shape.num_layers * shape.num_kv_heads, shape.max_positions,
                    device=device)


def decode_through_cache(model, cache, sequences, prompt_lens, record=True):
    """:func:`teacher_forced_decode`, also returning, per (sequence, position), the kept positions
    ``[layers, H_kv, budget]`` right after that position's decode step (``record``; reading them writes back the
    state the cache holds between the steps of an unchanged batch)."""
    kept = {}

    def on_step(i, t):
        kept[i, t] = cache.positions[cache.rows[i]].clone()

    return teacher_forced_decode(model, cache, sequences, prompt_lens, on_step if record else None), kept


def assert_engine_matches_parallel(model, policy, schedule, sequences, prompt_lens, budget=BUDGET, record=True):
    """The engine's cache and the parallel form: the same log-likelihoods (1e-4 relative) and, for the
    decode schedule with ``record``, the same kept positions after every decode step of every sequence."""
    options = {"budget": budget, "schedule": schedule}
    s = model.shape
    cache = build_cache(policy, new_pool(s, device=model.device), model, options)
    got, kept = decode_through_cache(model, cache, sequences, prompt_lens, record)
    scorer = build_scorer(policy, options, s.head_dim, s.num_heads // s.num_kv_heads, model.scale)
    for i, (seq, p) in enumerate(zip(sequences, prompt_lens)):
        runs = []
        want = model.forward_with_policy(seq[None], scorer, budget, p, horizon=len(seq) - p, runs=runs)[0]
        # the log-likelihood of the text, token by token, within 1e-4 relative
        ll_got, ll_want = (x.log_softmax(-1)[:-1].gather(1, seq[1:, None]).sum() for x in (got[i], want))
        assert torch.allclose(ll_got, ll_want, rtol=1e-4), (float(ll_got), float(ll_want))
        assert torch.allclose(got[i], want, atol=1e-4)
        if schedule == "prefill" or not record:
            continue
        for layer, run in enumerate(runs):
            visible = run.visible()[0]  # [H_kv, n, n]
            for t in range(p, len(seq)):
                engine = [sorted(x for x in row.tolist() if x >= 0) for row in kept[i, t][layer]]
                assert engine == [v.nonzero()[:, 0].tolist() for v in visible[:, t]], (layer, t)
                assert all(len(e) == min(budget, t + 1) for e in engine)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("policy", list(POLICIES))
def test_engine_and_parallel_form_keep_the_same_entries(make_model, policy, schedule):
    g = torch.Generator().manual_seed(3)
    # no token twice in a sequence: Knorm's first-layer ties between copies of a token are float noise
    sequences = [torch.randperm(SHAPE.vocab_size, generator=g)[:n] for n in (48, 41, 45)]
    assert_engine_matches_parallel(make_model("full"), policy, schedule, sequences, prompt_lens=[7, 1, 30])


class LayerDependent(Scorer):
    """A toy priority that reads the layer: even layers evict their oldest entry, odd layers their newest."""

    name = "layer_dependent"

    def priority(self, entries, q, step):
        sign = 1 - 2 * (step.layer % 2)  # an int, or [layers, 1, 1] when every layer's victims are chosen at once
        return entries.positions.float() * sign


def test_a_priority_that_reads_the_layer_gets_each_layers_index(make_model):
    """The engine chooses every layer's victims at once when the priority reads the entries alone: a priority that
    reads ``step.layer`` keeps, in every layer, what the parallel form (one layer at a time) keeps."""
    model = make_model("full")
    s = model.shape
    scorer = LayerDependent(PolicyConfig(budget=BUDGET), s.head_dim, s.num_heads // s.num_kv_heads, model.scale)
    cache = EvictingCache(new_pool(device=model.device), s.num_layers, s.num_kv_heads, model.scale, scorer, BUDGET,
                          s.max_positions)
    g = torch.Generator().manual_seed(5)
    sequences = [torch.randperm(SHAPE.vocab_size, generator=g)[:n] for n in (44, 38)]
    _, kept = decode_through_cache(model, cache, sequences, [6, 1])
    for i, (seq, p) in enumerate(zip(sequences, [6, 1])):
        runs = []
        model.forward_with_policy(seq[None], scorer, BUDGET, p, horizon=len(seq) - p, runs=runs)
        for layer, run in enumerate(runs):
            visible = run.visible()[0]  # [H_kv, n, n]
            want = [v.nonzero()[:, 0].tolist() for v in visible[:, -1]]
            assert [sorted(x for x in row.tolist() if x >= 0) for row in kept[i, len(seq) - 1][layer]] == want
        last = [run.visible()[0][0, -1].nonzero()[:, 0].tolist() for run in runs]
        assert last[0] != last[1]  # the layers kept different entries


@pytest.mark.parametrize("policy", list(POLICIES))
def test_the_state_held_between_steps_decodes_as_written_back_each_step(make_model, policy):
    """Unread between the steps of an unchanged batch, the per-entry state stays in the steps' gathered layout
    (written back when the batch changes: here as sequences finish): the parallel form's logits all the same."""
    g = torch.Generator().manual_seed(4)
    sequences = [torch.randperm(SHAPE.vocab_size, generator=g)[:n] for n in (40, 47, 44)]
    assert_engine_matches_parallel(make_model("full"), policy, "decode", sequences, prompt_lens=[9, 2, 25],
                                   record=False)


def kvpress_kept(policy, q, k, ratio):
    """kvpress's positions for one prompt, recomputed from its definitions: ``q [H, P, d]``, ``k [H_kv, P, d]``
    after RoPE -> ``[H_kv, n_kept]`` sorted."""
    hk, p = k.shape[:2]
    n_kept = max(1, int(p * (1 - ratio)))
    if policy == "streaming_llm":
        n_pruned = p - n_kept
        scores = torch.ones(hk, p)
        scores[:, 4: 4 + n_pruned] = 0
    elif policy == "knorm":
        scores = -k.norm(dim=-1)
    else:  # tova: the last query's attention averaged over every query head, the last token padded with the max
        g = q.shape[0] // hk
        logits = torch.einsum("hd,hnd->hn", q[:, -1], k.repeat_interleave(g, 0)) / q.shape[-1] ** 0.5
        attn = torch.softmax(logits, dim=-1)[:, :-1].mean(0)
        scores = torch.cat([attn, attn.max()[None]]).expand(hk, p)
    return scores.topk(n_kept, dim=-1).indices.sort(-1).values


@pytest.mark.parametrize("policy", ["streaming_llm", "knorm", "tova"])
def test_prefill_schedule_keeps_kvpress_positions(make_model, policy):
    model = make_model("full")
    prompt = torch.randperm(SHAPE.vocab_size, generator=torch.Generator().manual_seed(5))[:37]
    captured = {}

    def attend(layer, q, k, v, info):
        captured[layer] = (q[0], k[0])
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    model._run(prompt[None], torch.arange(len(prompt))[None], attend)
    for ratio in (0.3, 0.5, 0.8):
        pool = new_pool()
        cache = build_cache(policy, pool, model, {"schedule": "prefill", "compression_ratio": ratio})
        cache.add(0)
        model.prefill(cache, 0, prompt)
        for layer, (q, k) in captured.items():
            want = kvpress_kept(policy, q, k, ratio)
            for h in range(SHAPE.num_kv_heads):
                stored, _ = pool.read(int(cache.rows[0][layer, h]))
                assert torch.equal(stored, k[h, want[h]]), (policy, ratio, layer, h)


def test_memory_stays_at_the_budget_and_returns_to_the_pool():
    shape = ModelShape(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_heads=4, num_kv_heads=2, vocab_size=50,
                       max_positions=512)
    model = LlamaForInference(shape, random_weights(shape), None, torch.float32)
    budget = 40  # 2.5 pages of 16
    for policy in POLICIES:
        engine = Engine(model, cache=policy, budget=budget, kv_bytes=2 << 20, max_batch=2)
        engine.add_request(list(range(1, 30)), SamplingParams(max_new_tokens=200))
        engine.step()
        held = []
        while engine.has_work():
            engine.step()
            if engine.running:
                held.append(engine.cache.bytes_held(engine.running[0].id))
        rows = shape.num_layers * shape.num_kv_heads
        entry_bytes = engine.pool.page_bytes // engine.pool.page_size
        for h in held[10:]:  # full after 11 steps
            assert h["entries"] == rows * budget * entry_bytes
            assert h["pages"] - h["entries"] < rows * engine.pool.page_bytes
            assert h == held[10]
        assert held[-1]["state"] > 0 and len(held) >= 190
        assert engine.pool.used_pages == 0  # every page back to the pool


def test_decode_reserves_no_page_for_a_full_row(make_model):
    engine = Engine(make_model("full"), cache="h2o", budget=32, max_batch=1)
    engine.add_request(list(range(1, 40)), SamplingParams(max_new_tokens=5))
    engine.step()
    assert engine.cache.decode_pages_needed([engine.running[0].id]) == [0]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pages_needed_read_from_one_row_per_sequence_count_every_row(schedule):
    """A decode step's pages needed, read from one row per sequence, are the count over every row of it (a row
    whose last page is full and, with the decode schedule, below its budget), before every step of a ragged batch
    whose rows cross page boundaries and reach the budget."""
    model = LlamaForInference(SHAPE, random_weights(SHAPE))
    cache = build_cache("h2o", new_pool(), model, {"budget": 40, "schedule": schedule})
    g = torch.Generator().manual_seed(4)
    sequences = [torch.randint(0, SHAPE.vocab_size, (n,), generator=g) for n in (60, 35, 50)]
    checked = []

    def count(seq_ids):
        lens = cache.pool.seq_lens[cache.batch_rows(seq_ids).flatten(1)].long()  # every row: [B, layers * H_kv]
        grows = lens < 40 if schedule == "decode" else torch.ones_like(lens, dtype=torch.bool)
        want = ((lens % cache.pool.page_size == 0) & grows).sum(1).tolist()
        checked.append(want)
        assert cache.decode_pages_needed(seq_ids) == want

    original = cache.begin_decode
    cache.begin_decode = lambda seq_ids: (count(seq_ids), original(seq_ids))
    teacher_forced_decode(model, cache, sequences, [5, 15, 2])
    assert any(sum(w) for w in checked) and any(not sum(w) for w in checked)


@pytest.mark.parametrize("cache, options, message", [
    ("lsh_e", {"budget": 12}, "leaves lsh_e no room beside its fixed part (4 sink + 10 recent"),
    ("streaming_llm", {"budget": 4}, "leaves streaming_llm no room beside its fixed part (4 sink"),
    ("h2o2", {}, "unknown cache 'h2o2'; expected auto or one of full, dmc, h2o, tova"),
    ("h2o", {"budget": 1.5}, "budget=1.5 must be a whole number of entries >= 1 or a fraction"),
    ("tova", {"budget": 0}, "budget=0 must be"),
    ("knorm", {"schedule": "prefill", "compression_ratio": 1.0}, "compression_ratio=1.0 must be in [0, 1)"),
    ("keyformer", {"recent_fraction": 2}, "recent_fraction=2 must be in [0, 1]"),
    ("h2o", {"windw": 3}, "h2o has no option 'windw'; its options are budget, schedule"),
    ("h2o", {"seed": 1}, "h2o has no option 'seed'"),
    ("keyformer", {"recent_fraction": "0,3"}, "keyformer option recent_fraction='0,3' must be a number"),
    ("h2o", {"compression_ratio": 0.3}, "compression_ratio is read by the prefill schedule only"),
    ("full", {"budget": 3}, "the full cache takes no options"),
])
def test_bad_policy_settings_are_one_line(make_model, cache, options, message):
    with pytest.raises(InferenceError) as e:
        Engine(make_model("full"), cache=cache, **options)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_policies_refuse_dmc_models_and_a_large_budget_keeps_everything(make_model):
    with pytest.raises(InferenceError, match="runs on vanilla and GQA checkpoints; this one is a DMC model"):
        Engine(make_model("dmc_exact"), cache="h2o")
    engine = Engine(make_model("full"), cache="h2o", budget=4096)
    assert "keeps every entry" in engine.cache.note
    full = Engine(make_model("full"))
    prompt, params = list(range(3, 20)), SamplingParams(max_new_tokens=30)
    assert engine.generate([prompt], params)[0].tokens == full.generate([prompt], params)[0].tokens
