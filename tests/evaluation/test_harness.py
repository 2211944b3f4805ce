"""The evaluation harness: for every kind of cache, the teacher-forced (parallel) perplexity and the engine's
real token-by-token decoding agree, and the bytes, compression and decode throughput it reports are those of
the cache (checked against what the cache must hold)."""

import json

import pytest
import torch

from dmc_train.evaluation.harness import evaluate_cache, vanilla_bytes_per_token
from dmc_train.evaluation.report import markdown_table
from dmc_train.inference.model import LlamaForInference
from dmc_train.policies import POLICIES
from tests.inference.conftest import SHAPE, VARIANTS, random_weights
from tests.inference.test_less_cache import less_weights

N, BUDGET = 48, 16  # 16: LSH-E's fixed part (4 sinks + 10 recent) fits
WEIGHTS = random_weights(SHAPE)
LIGHTCACHE = {"r_k": 2, "r_v": 8, "global": 4, "local": 8, "top_k": 2, "segment": 4}


def dataset(count=3, n=N, seed=0):
    """Sequences without a repeated token: Knorm's key-norm ties (docs in policies/knorm.py) cannot occur."""
    g = torch.Generator().manual_seed(seed)
    seqs = torch.stack([torch.randperm(SHAPE.vocab_size, generator=g)[: n + 1] for _ in range(count)])
    return [{"tokens": s[:-1], "labels": s[1:], "loss_mask": torch.ones(n)} for s in seqs]


CASES = [("full", "full", {}), ("dmc_exact", "dmc", {}), ("lightcache", "lightcache", LIGHTCACHE),
         ("less", "less", {}), *((p, p, {"budget": BUDGET}) for p in POLICIES)]


@pytest.mark.parametrize("variant, cache, options", CASES, ids=[c[0] for c in CASES])
def test_teacher_forced_and_incremental_perplexity_agree(variant, cache, options):
    model = LlamaForInference(SHAPE, WEIGHTS, less_weights() if cache == "less" else VARIANTS.get(variant),
                              torch.float32)
    data = dataset()
    r = evaluate_cache(model, data, cache, options, prompt_len=4, batch_size=2, incremental_sequences=3,
                       kv_budget_seqs=2)
    inc = r["incremental"]
    assert abs(inc["ppl_engine"] / inc["ppl_parallel"] - 1) < 0.01  # the bound; in fact ~1e-5
    assert inc["max_logit_diff"] < 1e-3
    # the whole set is the subset here, run in other batches: equal up to the order in which the BLAS sums a
    # product, which may follow the number of rows (MKL's does on AMD CPUs: 1.2e-6 apart for LSH-E there)
    assert r["ppl"] == pytest.approx(inc["ppl_parallel"], rel=1e-5)
    assert 0 <= r["accuracy"] <= 1 and r["tokens"] == 3 * (N - 3)  # the tokens after the 4-token prompt
    vanilla = vanilla_bytes_per_token(model)
    assert vanilla == 2 * SHAPE.num_layers * SHAPE.num_heads * SHAPE.head_dim * 4
    rows = 3 * SHAPE.num_layers * SHAPE.num_kv_heads
    gqa = SHAPE.num_heads // SHAPE.num_kv_heads
    if cache == "full":  # every token of the GQA model's KV heads, no state
        assert r["compression"] == pytest.approx(gqa)
        assert r["entry_compression"] == 1
    if cache in POLICIES or cache == "less":  # the budget per row at the end, and the state beside it
        budget = model.method.budget if cache == "less" else BUDGET
        assert inc["entries"] == budget * rows
        assert r["entry_compression"] == pytest.approx(N / budget)
        assert r["compression"] < gqa * N / budget  # the state costs something
        assert r["compression"] > 0.5 * gqa * N / budget
    if cache == "dmc":
        assert r["entry_compression"] > 1.2  # half the random decisions merge
    d = r["decode"]
    assert d["batch"] == d["kv_budget_bytes"] // inc["max_page_bytes"] >= 1 and d["decode_tokens_per_s"] > 0
    assert d["failed"] == 0 or cache == "dmc"  # generated tokens make their own DMC decisions
    json.dumps(r)  # the result is plain data


def test_markdown_table_rows_and_delta():
    model = LlamaForInference(SHAPE, WEIGHTS)
    data = dataset(2)
    rows = []
    for cache, options in (("full", {}), ("h2o", {"budget": BUDGET})):
        r = evaluate_cache(model, data, cache, options, incremental_sequences=1, kv_budget_seqs=0)
        rows.append({"name": "tiny", "cache": cache, "budget": options.get("budget"), "test": r,
                     "test_ppl": r["ppl"], "test_accuracy": r["accuracy"]})
    table = markdown_table(rows).splitlines()
    assert len(table) == 4 and all(line.count("|") == 12 for line in table)
    assert f"| tiny | h2o | {BUDGET} |" in table[3]
    assert f"{rows[1]['test_ppl'] - rows[0]['test_ppl']:+.2f}" in table[3]


def test_a_fraction_budget_is_of_the_evaluated_sequence_not_of_the_models_positions():
    """SHAPE has 128 positions; the sequences have N = 48 tokens: 0.25 keeps 12 entries per row, not 32 (which
    would evict nothing), in the parallel form and in the engine's cache alike, and the report states both."""
    assert SHAPE.max_positions > N
    model = LlamaForInference(SHAPE, WEIGHTS)
    data = dataset(2)
    fraction = evaluate_cache(model, data, "h2o", {"budget": 0.25}, incremental_sequences=2, kv_budget_seqs=0)
    entries = evaluate_cache(model, data, "h2o", {"budget": N // 4}, incremental_sequences=2, kv_budget_seqs=0)
    full = evaluate_cache(model, data, "full", {}, incremental_sequences=0, kv_budget_seqs=0)
    assert fraction["budget_entries"] == N // 4 and fraction["budget_fraction"] == 0.25
    inc = fraction["incremental"]
    assert inc["entries"] == (N // 4) * inc["rows"] * inc["sequences"]  # the engine kept 1/4 of each row
    assert fraction["entry_compression"] == pytest.approx(4.0)
    assert fraction["ppl"] == entries["ppl"] != full["ppl"]  # the parallel form evicted as much
    assert inc["ppl_engine"] == pytest.approx(inc["ppl_parallel"], rel=1e-4)
    assert "incremental" not in full and "compression" not in full  # incremental_sequences=0: nothing decoded


def test_a_fraction_needs_the_context_where_requests_of_any_length_come():
    from dmc_train.errors import InferenceError
    from dmc_train.inference.engine import Engine

    with pytest.raises(InferenceError, match="budget=0.25 is a fraction of the context"):
        Engine(LlamaForInference(SHAPE, WEIGHTS), None, "h2o", budget=0.25)
