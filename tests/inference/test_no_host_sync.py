"""A decode step's layers never read a tensor's values on the host on the route a GPU runs (the Triton kernels:
compiled on a GPU, under the interpreter on CPU). On a GPU each such read waits for the device, and a CUDA graph
cannot capture a step that makes one; the plan of a step (:meth:`KVCache.begin_decode`) may read the host, once
per step, before the layers. Caught here on any device: :class:`HostReads` records every ``.item()``, ``.tolist()``,
``bool()``/``int()``/``float()`` of a tensor, ``.numpy()``, ``torch.equal``/``allclose``, a data-dependent shape
(``nonzero``, ``masked_select``, ``unique``, indexing by a boolean mask) and a tensor made from host data
(``torch.tensor``) that the project's code makes while the model's layers run in a decode step."""

import collections
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode

from dmc_train.inference.engine import Engine
from dmc_train.inference.model import LlamaForInference, random_weights
from dmc_train.inference.sampling import SamplingParams
from dmc_train.policies import POLICIES
from kernels import backend
from tests.inference.conftest import SHAPE
from tests.inference.test_backends_agree import backends_here
from tests.inference.test_less_cache import less_weights
from tests.inference.test_lightcache import SMALL

T = torch.Tensor
READS = {T.item, T.tolist, T.__bool__, T.__int__, T.__index__, T.__float__, T.numpy, T.nonzero, torch.nonzero,
         torch.argwhere, T.masked_select, torch.masked_select, T.unique, torch.unique, torch.equal, T.equal,
         torch.allclose, T.allclose, torch.tensor, torch.as_tensor}
CASES = [
    pytest.param("full", "full", {}, id="full"),
    *[pytest.param(v, "dmc", {}, id=v) for v in ("dmc_exact", "dmc_window", "dmc_pre", "dmc_hardc", "fixed_pooling")],
    *[pytest.param("full", p, {"budget": 16}, id=p) for p in POLICIES],
    pytest.param("full", "h2o", {"schedule": "prefill", "compression_ratio": 0.5}, id="h2o_prefill"),
    pytest.param("less", "less", {}, id="less"),
    pytest.param("full", "lightcache", SMALL, id="lightcache"),
]


class HostReads(TorchFunctionMode):
    """Counts the host reads (module docstring) the project's code makes, by the line that makes them (a read
    inside a library, e.g. Triton's interpreter copying a tensor to run a kernel on CPU, is not the project's)."""

    def __init__(self):
        super().__init__()
        self.lines = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        index = args[1] if func in (T.__getitem__, T.__setitem__) else ()
        masked = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                     for i in (index if isinstance(index, tuple) else (index,)))
        if func in READS or masked:
            caller = traceback.extract_stack()[-2]
            if "site-packages" not in caller.filename:
                self.lines[f"{caller.filename}:{caller.lineno}: {caller.line}"] += 1
        return func(*args, **kwargs)


def test_the_probe_sees_a_host_read(device):
    """The check itself: a read in the project's code is seen, named by its line."""
    reads = HostReads()
    with reads:
        x = torch.ones(3, device=device)
        if bool(x.sum() > 0):
            x[x > 0] = 2
    assert [line.split(": ", 1)[1] for line in reads.lines] == ["if bool(x.sum() > 0):", "x[x > 0] = 2"]


@pytest.mark.parametrize("variant, cache, options", CASES)
def test_a_decode_steps_layers_read_nothing_on_the_host(make_model, device, variant, cache, options):
    assert "triton" in backends_here(device)
    if variant == "less":
        model = LlamaForInference(SHAPE, random_weights(SHAPE), less_weights(), torch.float32, device=device)
    else:
        model = make_model(variant)
    reads, steps, layers = HostReads(), [0], model._layers

    def decode_steps_watched(tokens, positions, *rest):  # a decode step of both sequences: positions [2, 1]
        if positions.shape[-1] != 1 or positions.shape[0] < 2:
            return layers(tokens, positions, *rest)
        steps[0] += 1
        with reads:
            return layers(tokens, positions, *rest)

    model._layers = decode_steps_watched
    backend.set_backend("triton")
    try:
        engine = Engine(model, cache=cache, max_batch=4, **options)
        engine.generate([list(range(3, 23)), [2, 7, 1]], SamplingParams(max_new_tokens=5))
    finally:
        backend.set_backend("auto")
    assert steps[0] >= 4  # a policy's rows at its budget (the long prompt) beside rows below it
    assert not reads.lines, f"host reads in a decode step's layers: {dict(reads.lines)}"
