"""The backend registry (kernels/backend.py and each family's ``OPS`` table): which implementation the dispatch picks
for representative inputs of every op family, and the one-line errors of a forced backend that cannot run."""

import pytest
import torch

from kernels import backend, compiled, dmc, eviction, layer, paged, sampling
from kernels.paged import appends_in_attention_call, reads_block_table
from kernels.paged.varlen import plan_decode

CPU = torch.device("cpu")
PAGE = 16


def pages(rows=3, groups=2, d=8, dv=8, dtype=torch.float32, table_dtype=torch.int32):
    """Paged inputs of ``rows`` rows of 5 entries each, a page per row: ``(q, k_pages, v_pages, block_table,
    seq_lens)``."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(rows, groups, d, generator=g).to(dtype)
    kp = torch.randn(rows + 2, PAGE, d, generator=g).to(dtype)
    vp = torch.randn(rows + 2, PAGE, dv, generator=g).to(dtype)
    table = torch.arange(rows * 2, dtype=table_dtype).view(rows, 2)
    return q, kp, vp, table, torch.full((rows,), 5, dtype=table_dtype)


def attention(scores=None, lse=False, **kw):
    q, kp, vp, table, lens = pages(**kw)
    return q, kp, vp, table, lens, 0.5, scores, lse


def planned(table_plan=True, **kw):
    q, kp, vp, table, lens = pages(**kw)
    plan = (paged.DecodePlan(q.shape[0], int(lens.max()), lens, None, table) if table_plan
            else plan_decode(table.long(), lens.long(), PAGE, 2 * PAGE * 8 * 4))
    return q, kp, vp, plan, 0.5, None, False, None, None


def dmc_state(rows, d=8, dv=8):
    return torch.zeros(rows, 1, d + dv + 1), torch.zeros(rows, dtype=torch.int64)


def update(**kw):
    q, kp, vp, table, lens = pages(**kw)
    rows, n = torch.arange(q.shape[0]), q.shape[0]
    state, tokens = dmc_state(n)
    return (kp, vp, table, lens, rows, torch.zeros(n), torch.ones(n), torch.randn(n, 8), torch.randn(n, 8), state,
            tokens, None, None)


def dmc_decode(**kw):
    kp, vp, table, lens, rows, alpha, omega, k, v, state, tokens, spare, left = update(**kw)
    q = pages(**kw)[0]
    return kp, vp, table, lens, rows, alpha, omega, k, v, state, tokens, q, 0.5, spare, left


def append_decode(**kw):
    q, kp, vp, table, lens = pages(**kw)
    n = q.shape[0]
    spare, left = torch.zeros(0, dtype=torch.int32), torch.zeros(1, dtype=torch.int64)
    return kp, vp, table, lens, torch.arange(n), torch.randn(n, 8), torch.randn(n, 8), q, 0.5, spare, left


def write(**kw):
    _, kp, vp, table, lens = pages(**kw)
    n = table.shape[0]
    return kp, vp, table, torch.arange(n), torch.full((n,), 2), torch.randn(n, 8), torch.randn(n, 8)


def compiled_call(heads=(4, 2), dmc_call=False, **kw):
    _, kp, vp, table, lens = pages(**kw)
    state, tokens = dmc_state(table.shape[0]) if dmc_call else (None, None)
    return kp, vp, table, lens, heads, 0.5, None, None, state, tokens


def partial_accumulation():
    k, alpha = torch.randn(1, 2, 6, 8), torch.rand(1, 2, 6)
    return k, k, alpha, alpha + 0.1, "exact", 12, 32


def weights(dtype=torch.float32, transposed=False, grad=False):
    """``rms_norm_matmul``'s inputs: x [3, 8], norm [8], w [8, 16] (``transposed``: a non-contiguous view)."""
    x, norm = torch.randn(3, 8, dtype=dtype), torch.ones(8, dtype=dtype)
    w = torch.randn(16, 8, dtype=dtype).T if transposed else torch.randn(8, 16, dtype=dtype)
    return x, norm, 1e-5, w.requires_grad_(grad), None, 0, 0, None


def layer_output(all_reduce=None):
    x, attn = torch.randn(3, 8), torch.randn(3, 8)
    return (x, attn, torch.randn(8, 8), torch.ones(8), 1e-5, torch.randn(8, 12), torch.randn(6, 8), all_reduce)


def logits(dtype=torch.float32, vocab=10, strided=False):
    t = torch.randn(4, 2 * vocab, dtype=dtype)
    return (t[:, ::2] if strided else t[:, :vocab],)


def victims(dtype=torch.float32, positions=torch.int64):
    return (torch.rand(2, 3, 5, dtype=dtype), torch.arange(15, dtype=positions).view(3, 5).expand(2, 3, 5)
            .contiguous(), torch.full((3,), 20), 1, 2)


def hamming(dtype=torch.uint8):
    return torch.zeros(3, 2, 4, dtype=dtype), torch.zeros(2, 3, 5, 4, dtype=dtype)


# (op table, op, inputs, DMC_KERNELS, the backend whose implementation runs)
CASES = [
    # paged decode attention: fp32 compiled on CPU; bf16, too many query heads per row, autograd: PyTorch
    (paged.OPS, "paged_attention", attention(), "auto", "cpu_compiled"),
    (paged.OPS, "paged_attention", attention(d=13, dv=13), "auto", "cpu_compiled"),
    (paged.OPS, "paged_attention", attention(scores="probs", lse=True), "auto", "cpu_compiled"),
    (paged.OPS, "paged_attention", attention(scores="logits"), "cpu_compiled", "cpu_compiled"),
    (paged.OPS, "paged_attention", attention(dtype=torch.bfloat16), "auto", "torch"),
    (paged.OPS, "paged_attention", attention(groups=257), "auto", "torch"),
    (paged.OPS, "paged_attention", attention(), "torch", "torch"),
    (paged.OPS, "paged_attention", attention(scores="probs"), "triton", "triton"),
    (paged.OPS, "paged_attention_planned", planned(), "auto", "cpu_compiled"),
    (paged.OPS, "paged_attention_planned", planned(table_plan=False), "auto", "torch"),
    (paged.OPS, "paged_attention_planned", planned(dtype=torch.bfloat16), "auto", "torch"),
    (paged.OPS, "paged_attention_planned", planned(), "triton", "triton"),
    (paged.OPS, "paged_attention_planned", planned(table_plan=False), "triton", "torch"),  # row groups: PyTorch's
    (paged.OPS, "paged_write", write(), "auto", "torch"),
    (paged.OPS, "paged_write", write(), "triton", "triton"),
    (paged.OPS, "dmc_cache_update", update(), "auto", "cpu_compiled"),
    (paged.OPS, "dmc_cache_update", update(table_dtype=torch.int64), "auto", "torch"),
    (paged.OPS, "dmc_cache_update", update(dtype=torch.bfloat16), "auto", "torch"),
    (paged.OPS, "dmc_cache_update", update(), "triton", "triton"),
    (paged.OPS, "dmc_decode", dmc_decode(), "auto", "cpu_compiled"),
    (paged.OPS, "dmc_decode", dmc_decode(groups=257), "auto", "torch"),
    (paged.OPS, "dmc_decode", dmc_decode(), "triton", "torch"),
    (paged.OPS, "paged_append_decode", append_decode(), "auto", "cpu_compiled"),
    (paged.OPS, "paged_append_decode", append_decode(d=13, dv=13), "cpu_compiled", "cpu_compiled"),
    (paged.OPS, "paged_append_decode", append_decode(dtype=torch.bfloat16), "auto", "torch"),
    (paged.OPS, "paged_append_decode", append_decode(), "torch", "torch"),
    (paged.OPS, "decode_attention", compiled_call(), "auto", "cpu_compiled"),
    (paged.OPS, "decode_attention", compiled_call(dmc_call=True), "auto", "cpu_compiled"),
    (paged.OPS, "decode_attention", compiled_call(heads=(514, 2)), "auto", "torch"),
    (paged.OPS, "decode_attention", compiled_call(dtype=torch.bfloat16), "auto", "torch"),
    (paged.OPS, "decode_attention", compiled_call(), "triton", "torch"),
    # DMC's accumulation: Triton only where chosen
    (dmc.OPS, "partial_accumulation", partial_accumulation(), "auto", "torch"),
    (dmc.OPS, "partial_accumulation", partial_accumulation(), "cpu_compiled", "torch"),
    (dmc.OPS, "partial_accumulation", partial_accumulation(), "triton", "triton"),
    # a layer's dense ops: fp32, contiguous, no autograd, one rank
    (layer.OPS, "rms_norm_matmul", weights(), "auto", "cpu_compiled"),
    (layer.OPS, "rms_norm_matmul", weights(dtype=torch.bfloat16), "auto", "torch"),
    (layer.OPS, "rms_norm_matmul", weights(transposed=True), "auto", "torch"),
    (layer.OPS, "rms_norm_matmul", weights(grad=True), "auto", "torch"),
    (layer.OPS, "rms_norm_matmul", weights(), "triton", "torch"),
    (layer.OPS, "layer_output", layer_output(), "auto", "cpu_compiled"),
    (layer.OPS, "layer_output", layer_output(all_reduce=lambda t: t), "auto", "torch"),
    # greedy sampling
    (sampling.OPS, "argmax", logits(), "auto", "cpu_compiled"),
    (sampling.OPS, "argmax", logits(dtype=torch.bfloat16), "auto", "torch"),
    (sampling.OPS, "argmax", logits(vocab=0), "auto", "torch"),
    (sampling.OPS, "argmax", logits(strided=True), "auto", "torch"),
    (sampling.OPS, "argmax", logits(), "torch", "torch"),
    # the eviction policies' victims and LSH-E's distances
    (eviction.OPS, "victims", victims(), "auto", "cpu_compiled"),
    (eviction.OPS, "victims", victims(positions=torch.int32), "auto", "cpu_compiled"),
    (eviction.OPS, "victims", victims(dtype=torch.float16), "auto", "torch"),
    (eviction.OPS, "victims", victims(), "triton", "torch"),
    (eviction.OPS, "hamming_sums", hamming(), "auto", "cpu_compiled"),
    (eviction.OPS, "hamming_sums", hamming(dtype=torch.int8), "auto", "torch"),
]


@pytest.fixture
def kernels_setting():
    """Set ``DMC_KERNELS`` for the test by :func:`kernels.backend.set_backend`; ``auto`` again after it."""
    yield backend.set_backend
    backend.set_backend("auto")


@pytest.mark.parametrize("table, op, inputs, setting, expected", CASES,
                         ids=[f"{op}-{setting}-{i}" for i, (_, op, _, setting, _) in enumerate(CASES)])
def test_the_dispatch_picks_the_implementation_of_the_chosen_backend_that_fits(kernels_setting, table, op, inputs,
                                                                                setting, expected):
    if setting == "triton":
        pytest.importorskip("triton")  # the tests run Triton on CPU under its interpreter (tests/conftest.py)
    kernels_setting(setting)
    assert table[op].pick(*inputs).backend == expected


@pytest.mark.parametrize("setting, dtype, reads, appends", [
    ("auto", torch.float32, True, True),
    ("auto", torch.bfloat16, False, False),
    ("auto", None, False, False),
    ("cpu_compiled", torch.float32, True, True),
    ("torch", torch.float32, False, False),
    ("triton", torch.float32, True, False),
    ("triton", None, True, False),
])
def test_the_questions_before_a_step_are_asked_of_the_registry(kernels_setting, setting, dtype, reads, appends):
    """Which plan a cache builds (a kernel reads the block table) and whether a step's append and attention are one
    call, for pages of ``dtype`` on CPU; and whether a layer's weights take the compiled kernel."""
    if setting == "triton":
        pytest.importorskip("triton")
    kernels_setting(setting)
    assert reads_block_table(CPU, dtype) == reads
    assert appends_in_attention_call(CPU, dtype) == appends
    assert layer.compiled_runs(torch.zeros(2, 3)) == (setting in ("auto", "cpu_compiled"))


@pytest.mark.parametrize("setting, device, environment, error", [
    ("cpu_compiled", "cpu", "no_compiler", "the compiled CPU kernels (DMC_KERNELS=cpu_compiled) need a C compiler"),
    ("cpu_compiled", "meta", None, "the compiled CPU kernels (DMC_KERNELS=cpu_compiled) take CPU tensors, not meta"),
    ("triton", "cpu", "no_interpreter", "Triton kernels on CPU tensors need the interpreter: set TRITON_INTERPRET=1"),
    ("flash", "cpu", None, "flash-attn (DMC_KERNELS=flash) runs on CUDA tensors, not cpu"),
])
def test_a_forced_backend_that_cannot_run_says_why_in_one_line(kernels_setting, monkeypatch, tmp_path, setting,
                                                               device, environment, error):
    if environment == "no_compiler":
        monkeypatch.setenv("CC", "")
        monkeypatch.setenv("PATH", str(tmp_path))
    if environment == "no_interpreter":
        pytest.importorskip("triton")
        monkeypatch.delenv("TRITON_INTERPRET")
    kernels_setting(setting)
    logits_on = torch.zeros(2, 3, device=device)
    with pytest.raises(RuntimeError) as raised:
        sampling.argmax(logits_on)  # every public op asks the same choice
    message = str(raised.value)
    assert message.startswith(error) and "\n" not in message
    with pytest.raises(RuntimeError, match="DMC_KERNELS|TRITON_INTERPRET"):
        backend.choose(torch.device(device))  # and still raises: a failed choice is not kept
    kernels_setting("auto")  # auto never fails: without a compiler the PyTorch paths, with one warning
    if environment == "no_compiler":
        monkeypatch.setattr(compiled, "_warned", set())
        with pytest.warns(UserWarning, match="no C compiler"):
            assert backend.choose(CPU) is backend.TORCH
    else:
        assert backend.choose(torch.device(device)).name == ("torch" if device == "meta" else "cpu_compiled")


def test_auto_chooses_by_device_and_an_unknown_setting_is_refused(kernels_setting):
    assert backend.choose(CPU) is backend.CPU_COMPILED
    assert backend.choose(torch.device("meta")) is backend.TORCH
    assert backend.CPU_COMPILED.order == ("cpu_compiled", "torch")
    assert backend.FLASH.order == ("flash", "triton", "torch")
    with pytest.raises(ValueError, match="backend must be one of auto, torch, triton, flash, cpu_compiled"):
        kernels_setting("cuda")
