"""Preemption instead of failure: when a decode step cannot get its pages, the newest running requests give
theirs back and are recomputed later. Every request then gets the tokens of an uninterrupted run (greedy and
seeded sampling; the full cache, a DMC cache and an eviction policy's), and only a request that cannot fit
even alone fails, in one line, while the others finish."""

import pytest
import torch

from dmc_train.inference.engine import Engine
from dmc_train.inference.sampling import SamplingParams
from tests.inference.conftest import SHAPE

PROMPTS = [[int(t) for t in torch.randint(0, SHAPE.vocab_size, (n,), generator=torch.Generator().manual_seed(n))]
           for n in (9, 3, 20, 5, 27)]
ROWS = SHAPE.num_layers * SHAPE.num_kv_heads  # rows per sequence
# (model variant, engine options, pages as a fraction of the uninterrupted run's peak): the full cache and DMC
# (one prefill recomputes), H2O (the prompt's prefill, then the generated tokens replayed through decode steps;
# the newest request's 27-token prompt is compressed at prefill, so its replay evicts at every step)
CASES = {"full": ("full", {}, 0.6), "dmc": ("dmc_exact", {}, 0.6),
         "h2o": ("full", {"cache": "h2o", "budget": 24}, 0.75)}
SAMPLING = {"greedy": lambda i: SamplingParams(max_new_tokens=40),
            "seeded": lambda i: SamplingParams(max_new_tokens=40, temperature=0.8, top_p=0.95, seed=100 + i)}


@pytest.mark.parametrize("sampling", SAMPLING)
@pytest.mark.parametrize("case", CASES)
def test_preempted_requests_get_the_tokens_of_an_uninterrupted_run(make_model, case, sampling):
    variant, options, fraction = CASES[case]
    model = make_model(variant)
    params = [SAMPLING[sampling](i) for i in range(len(PROMPTS))]
    roomy = Engine(model, max_batch=8, **options)
    expected = roomy.generate(PROMPTS, params)
    page_bytes = roomy.pool.page_bytes
    alone = max(o.kv_bytes["pages"] for o in expected) // page_bytes + ROWS  # the largest, plus one step's pages
    pages = max(alone, int(roomy.pool.peak_pages * fraction))  # less than they held together at peak
    tight = Engine(model, max_batch=8, kv_bytes=pages * page_bytes, **options)
    outs = tight.generate(PROMPTS, params)
    assert tight.stats["preemptions"] > 0 and any(o.preemptions for o in outs)
    assert tight.stats["recomputed_tokens"] > 0
    assert [o.error for o in outs] == [None] * len(PROMPTS)
    assert [o.tokens for o in outs] == [o.tokens for o in expected]
    assert [o.entries for o in outs] == [o.entries for o in expected]  # the same cache at the end
    assert tight.stats["decode_tokens"] == roomy.stats["decode_tokens"]  # replayed tokens are not counted twice
    assert tight.pool.used_pages == 0 and tight.pool.peak_pages <= pages


def test_a_request_that_cannot_fit_alone_fails_in_one_line_and_the_others_finish(make_model):
    model = make_model("full")
    params = [SamplingParams(max_new_tokens=30), SamplingParams(max_new_tokens=70),
              SamplingParams(max_new_tokens=30, temperature=0.7, seed=5)]
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[3]]
    expected = Engine(model, max_batch=4).generate(prompts, params)
    page_bytes = Engine(model).pool.page_bytes
    engine = Engine(model, kv_bytes=3 * ROWS * page_bytes, max_batch=4)  # 48 entries per row: 9 + 70 cannot fit
    outs = engine.generate(prompts, params)
    error = outs[1].error
    assert outs[1].finish_reason == "error" and "\n" not in error
    assert error.startswith("the request needs 4 more KV pages after 9 prompt + 40 generated tokens") and \
        "nothing else running; raise kv_bytes or lower max_new_tokens" in error
    assert outs[1].tokens == expected[1].tokens[:40]  # what it generated until then is right
    assert [outs[0].tokens, outs[2].tokens] == [expected[0].tokens, expected[2].tokens]
    assert outs[0].error is None and outs[2].error is None
    assert engine.pool.used_pages == 0
