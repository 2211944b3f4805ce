"""Every cache generates the same tokens, holds the same entries and keeps the same positions on every backend that
runs on the test device: the PyTorch paths (``torch``), the compiled CPU kernels (``cpu_compiled``, CPU tensors) and
the Triton kernels (``triton``: compiled on a GPU, under the interpreter on CPU), over a ragged GQA batch whose KV
pool is too small for all of it at once (requests preempted and recomputed)."""

import pytest
import torch

from dmc_train.inference.caches.evicting import EvictingCache
from dmc_train.inference.engine import Engine
from dmc_train.inference.sampling import SamplingParams
from dmc_train.policies import POLICIES
from kernels import backend
from tests.inference.conftest import SHAPE
from tests.inference.test_less_cache import less_weights
from tests.inference.test_lightcache import SMALL

# Knorm (at a tight pool) and LightCache (past 24 generated tokens) generate other tokens under the compiled CPU
# kernels than under the PyTorch paths: a discrete choice at a near-tie (Knorm's key-norm ranking, LightCache's top-k
# segments), which rounding decides. Measured: their teacher-forced logits agree to 4e-6 until one position, then
# differ by up to 2; adding 1e-6 noise to the weights on the PyTorch path alone moves the same positions by as much.
# So exact tokens are not expected of them (xfail, not strict: at these 12 tokens they may agree); every other cache
# agrees exactly.
DIVERGES = "a near-tie in its discrete choice, decided by rounding (a 1e-6 change of the weights flips it too)"
XFAIL = pytest.mark.xfail(reason=DIVERGES)
CASES = [  # pytest.param(model variant, cache, options, id=...)
    pytest.param("full", "full", {}, id="full"),
    pytest.param("dmc_exact", "dmc", {}, id="dmc_exact"),
    pytest.param("dmc_window", "dmc", {}, id="dmc_window"),
    pytest.param("fixed_pooling", "dmc", {}, id="fixed_pooling"),
    *[pytest.param("full", p, {"budget": 16}, id=p, marks=[XFAIL] if p == "knorm" else []) for p in POLICIES],
    *[pytest.param("full", p, {"schedule": "prefill", "compression_ratio": 0.5}, id=f"{p}_prefill")
      for p in ("h2o", "tova")],
    pytest.param("less", "less", {}, id="less"),
    pytest.param("full", "lightcache", SMALL, id="lightcache", marks=XFAIL),
]
NEW = 12  # tokens generated per prompt
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7], [2, 7], list(range(10, 33)), [11, 12, 13, 14, 15, 16]]


def backends_here(device: torch.device) -> list[str]:
    return [name for name in ("torch", "cpu_compiled", "triton") if backend.BACKENDS[name].available(device)]


def tight_pool(model, cache: str, options: dict) -> int:
    """KV bytes of half the pages the prompts hold together at peak (as ``test_engine_preemption``), at least the
    largest request's alone and a step's pages."""
    roomy = Engine(model, cache=cache, max_batch=4, **options)
    outputs = roomy.generate(PROMPTS, SamplingParams(max_new_tokens=NEW))
    alone = max(o.kv_bytes["pages"] for o in outputs) // roomy.pool.page_bytes + SHAPE.num_layers * SHAPE.num_kv_heads
    return max(alone, int(roomy.pool.peak_pages * 0.5)) * roomy.pool.page_bytes


def generate(model, cache: str, options: dict, kv_bytes: int, name: str):
    """``(outputs, kept)`` of the prompts under backend ``name``: ``kept`` each finished sequence's entry positions per
    row (an eviction policy's), read as the engine releases it."""
    backend.set_backend(name)
    try:
        engine = Engine(model, cache=cache, kv_bytes=kv_bytes, max_batch=4, **options)
        kept, release = {}, engine.cache.release

        def recorded_release(seq_id):
            if isinstance(engine.cache, EvictingCache) and engine.cache.evicting and seq_id in engine.cache.rows:
                kept[seq_id] = engine.cache.positions[engine.cache.rows[seq_id].flatten()].tolist()
            release(seq_id)

        engine.cache.release = recorded_release
        return engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW)), kept
    finally:
        backend.set_backend("auto")


def assert_backends_agree(model, cache: str, options: dict) -> list:
    """Generates the prompts at a tight pool on every backend of the model's device and asserts the same tokens,
    entries and kept positions; returns the first backend's outputs."""
    names = backends_here(model.device)
    assert len(names) >= 2, names  # torch and at least one of the others everywhere the suite runs
    kv_bytes = tight_pool(model, cache, options)
    runs = {name: generate(model, cache, options, kv_bytes, name) for name in names}
    (first, (want, want_kept)), *others = runs.items()
    for name, (got, got_kept) in others:
        assert [o.tokens for o in got] == [o.tokens for o in want], (first, name)
        assert [o.entries for o in got] == [o.entries for o in want], (first, name)
        assert got_kept == want_kept, (first, name)
    return want


@pytest.mark.parametrize("variant, cache, options", CASES)
def test_every_backend_generates_the_same(make_model, device, variant, cache, options):
    if variant == "less":
        from dmc_train.inference.model import LlamaForInference
        from tests.inference.conftest import random_weights

        model = LlamaForInference(SHAPE, random_weights(SHAPE), less_weights(), torch.float32, device=device)
    else:
        model = make_model(variant)
    want = assert_backends_agree(model, cache, options)
    if cache == "full":
        assert any(o.preemptions for o in want), "the pool should force a preemption"


@pytest.mark.parametrize("variant, cache, options", [("full", "full", {}), ("fixed_pooling", "dmc", {}),
                                                     ("full", "h2o", {"budget": 16})])
def test_one_kv_head_generates_the_same_on_every_backend(device, variant, cache, options):
    """A model with one KV head (MQA, or GQA converted to one group): a step's rows of one layer are then a strided
    view of the batch's rows unless made contiguous, which the compiled kernels would read densely (rows of other
    layers, pages taken that were never lent)."""
    import dataclasses

    from dmc_train.inference.model import LlamaForInference, random_weights
    from tests.inference.conftest import VARIANTS

    shape = dataclasses.replace(SHAPE, num_kv_heads=1)
    model = LlamaForInference(shape, random_weights(shape), VARIANTS[variant], torch.float32, device=device)
    want = assert_backends_agree(model, cache, options)
    assert max(len(o.tokens) for o in want) == NEW
