"""The engine with the Triton kernels (under the interpreter on CPU) generates what the PyTorch paths do."""

import os

import pytest

from kernels import backend

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 on CPU")


@pytest.mark.parametrize("variant", ["full", "dmc_exact", "dmc_window"])
def test_engine_generates_the_same_tokens_with_the_triton_kernels(make_model, variant):
    from dmc_train.inference.engine import Engine
    from dmc_train.inference.sampling import SamplingParams

    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7]]
    want = Engine(make_model(variant)).generate(prompts, SamplingParams(max_new_tokens=6))
    backend.set_backend("triton")
    try:
        got = Engine(make_model(variant)).generate(prompts, SamplingParams(max_new_tokens=6))
    finally:
        backend.set_backend("auto")
    assert [o.tokens for o in got] == [o.tokens for o in want]
    assert [o.entries for o in got] == [o.entries for o in want]


@pytest.mark.parametrize("cache", ["h2o", "keyformer"])
def test_eviction_policies_generate_the_same_tokens_with_the_triton_kernels(make_model, cache):
    """The paged decode kernel's per-entry probabilities / logits drive the same evictions as the PyTorch path."""
    from dmc_train.inference.engine import Engine
    from dmc_train.inference.sampling import SamplingParams

    prompts = [list(range(3, 27)), [2, 7]]
    params = SamplingParams(max_new_tokens=8)
    want = Engine(make_model("full"), cache=cache, budget=16).generate(prompts, params)
    backend.set_backend("triton")
    try:
        got = Engine(make_model("full"), cache=cache, budget=16).generate(prompts, params)
    finally:
        backend.set_backend("auto")
    assert [o.tokens for o in got] == [o.tokens for o in want]
    assert [o.entries for o in got] == [o.entries for o in want]
