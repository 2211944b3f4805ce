"""No tensor the inference side creates lands off the model's device: on a GPU every factory call without a device
(``torch.arange(n)``, ``torch.zeros(...)``) makes a CPU tensor, and the next op mixing it with the model's tensors
fails there. Caught here on CPU: the engine generates (every cache, on the PyTorch paths a GPU runs; on a GPU the
Triton kernels' too), the teacher-forced forms run (every policy, LightCache) and transformers' ``generate`` runs
with a ``PolicyCache`` (every policy), and the evaluation harness measures a few caches, with PyTorch's default
device set to ``meta``, so a tensor made without a device is a meta tensor, and :class:`NoMeta` names the call that
made it. Host-side tensors (the pages lent to a step, the compiled CPU kernels' outputs, token ids on their way in)
say ``device="cpu"``."""

import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode

from dmc_train.inference.engine import Engine
from dmc_train.inference.sampling import SamplingParams
from dmc_train.policies import POLICIES, build_scorer
from kernels import backend
from tests.inference.conftest import SHAPE
from tests.inference.test_backends_agree import backends_here
from tests.inference.test_lightcache import SMALL

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7], [2, 7], list(range(10, 33))]
CASES = [("full", "full", {}), *[(v, "dmc", {}) for v in ("dmc_exact", "dmc_window", "dmc_pre", "dmc_hardc",
                                                          "fixed_pooling")],
         *[("full", p, {"budget": 16}) for p in POLICIES], ("full", "h2o", {"budget": 16, "schedule": "prefill"}),
         ("full", "lightcache", SMALL)]


class NoMeta(TorchFunctionMode):
    """Raises at the first op whose result is a meta tensor, naming the project's line that called it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) and t.is_meta for t in (out if isinstance(out, (tuple, list)) else (out,))):
            ours = [f"{f.filename}:{f.lineno}: {f.line}" for f in traceback.extract_stack()[:-1]
                    if "site-packages" not in f.filename and f.filename != __file__]
            raise AssertionError(f"{getattr(func, '__name__', func)} made a tensor without a device at {ours[-1]}")
        return out


def off_device_check(run):
    torch.set_default_device("meta")
    try:
        with NoMeta():
            return run()
    finally:
        torch.set_default_device(None)


@pytest.mark.parametrize("variant, cache, options", CASES, ids=[f"{c}-{v}" if c == "dmc" else c + ("_prefill" if
                         o.get("schedule") else "") for v, c, o in CASES])
def test_the_engine_makes_every_tensor_on_its_device(make_model, device, variant, cache, options):
    model = make_model(variant)
    # the paths a GPU runs: the PyTorch ones everywhere, the Triton kernels' wrappers on CUDA (under the interpreter on
    # CPU every one of its many tensor calls would pass through the check: minutes)
    for name in ["torch", *(["triton"] if device.type == "cuda" and "triton" in backends_here(device) else [])]:
        backend.set_backend(name)
        try:
            engine = Engine(model, cache=cache, max_batch=4, **options)
            off_device_check(lambda: engine.generate(PROMPTS, SamplingParams(max_new_tokens=10)))
        finally:
            backend.set_backend("auto")


@pytest.mark.parametrize("policy", [*POLICIES, "lightcache"])
def test_the_teacher_forced_forms_make_every_tensor_on_their_device(make_model, device, policy):
    from dmc_train.inference.caches.lightcache import lightcache_for

    model = make_model("full")
    tokens = torch.tensor([PROMPTS[2]], device=device)
    if policy == "lightcache":
        scorer = lightcache_for(model, SMALL)
    else:
        scorer = build_scorer(policy, {"budget": 8}, SHAPE.head_dim, SHAPE.num_heads // SHAPE.num_kv_heads,
                              model.scale)
    off_device_check(lambda: model.forward_with_policy(tokens, scorer, 8, prompt_len=10))


@pytest.mark.parametrize("policy", POLICIES)
def test_transformers_generate_with_a_policy_cache_makes_every_tensor_on_its_device(device, policy):
    from dmc_train.inference.hf_policy_cache import PolicyCache
    from tests.inference.conftest import random_weights
    from tests.inference.test_hf_policy_cache import SHAPE as HF_SHAPE
    from tests.inference.test_hf_policy_cache import hf_llama

    model = hf_llama(random_weights(HF_SHAPE)).to(device)
    ids = torch.tensor([PROMPTS[2], PROMPTS[2][::-1]], device=device)
    cache = PolicyCache(model, policy, budget=16, max_new_tokens=6)
    off_device_check(lambda: model.generate(ids, past_key_values=cache, max_new_tokens=6, do_sample=False))


class Samples:
    """Three samples of 32 tokens in the layout of the project's datasets (numpy arrays)."""

    def __init__(self):
        import numpy as np

        rng = np.random.default_rng(0)
        self.tokens = rng.integers(0, SHAPE.vocab_size, (3, 33))

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        import numpy as np

        return {"tokens": self.tokens[i, :-1], "labels": self.tokens[i, 1:], "loss_mask": np.ones(32, np.float32)}


@pytest.mark.parametrize("variant, cache, options", [("full", "full", {}), ("dmc_exact", "dmc", {}),
                                                     ("full", "h2o", {"budget": 8}),
                                                     ("full", "tova", {"budget": 8, "schedule": "prefill"}),
                                                     ("full", "lightcache", SMALL)])
def test_the_evaluation_harness_makes_every_tensor_on_its_device(make_model, variant, cache, options):
    from dmc_train.evaluation.harness import evaluate_cache

    model = make_model(variant)
    off_device_check(lambda: evaluate_cache(model, Samples(), cache, dict(options), prompt_len=8, batch_size=2,
                                            incremental_sequences=1, kv_budget_seqs=0))
