"""A Llama layer's dense ops (kernels/layer): the compiled CPU kernel against the tensor ops, and when each runs."""

import pytest
import torch

from dmc_train.models.rope import rope_inv_freq, rope_tables
from kernels.backend import set_backend
from kernels.layer import compiled_runs, cpu, layer_output, rms_norm_matmul
from kernels.layer.reference import layer_output_torch, rms_norm_matmul_torch, rotate_heads

HIDDEN, FFN, D, HEADS, KV_HEADS = 64, 176, 16, 4, 2  # q, k and v heads: 4 + 2 + 2


def weights(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    width = (HEADS + 2 * KV_HEADS) * D
    shapes = {"qkv": (HIDDEN, width), "o": (HEADS * D, HIDDEN), "gate_up": (HIDDEN, 2 * FFN), "down": (FFN, HIDDEN)}
    return {"norm": 1 + 0.1 * torch.randn(HIDDEN, generator=g),
            **{name: 0.2 * torch.randn(*shape, generator=g) for name, shape in shapes.items()}}


def tables(t: int, per_head: bool = False):
    """RoPE tables of positions 0..t-1 as the model makes them: ``cos [t, d]``, signed ``sin [t, 1 or heads, d]``
    (per head: with DMC-style masks, a zero channel per head)."""
    mask = None
    if per_head:
        mask = torch.ones(HEADS + KV_HEADS, D)
        mask[torch.arange(HEADS + KV_HEADS), torch.arange(HEADS + KV_HEADS) % D] = 0
    cos, sin = rope_tables(torch.arange(t)[:, None], rope_inv_freq(D, 10000.0), torch.float32, None, mask)
    return cos[:, 0], sin


def test_the_kernel_builds_with_torchs_blas():
    assert cpu.torch_sgemm() is not None, "PyTorch's CPU library should export sgemm_"
    assert cpu.library() is not None, "the layer kernel did not build (is a C compiler installed?)"
    assert compiled_runs(torch.zeros(2, 3))
    assert not compiled_runs(torch.zeros(2, 3, dtype=torch.bfloat16)) and not compiled_runs(torch.zeros(3, 2).T)


@pytest.mark.parametrize("t", [1, 5, 64])
def test_rms_norm_matmul_matches_the_tensor_ops(t):
    w, x = weights(t), torch.randn(t, HIDDEN, generator=torch.Generator().manual_seed(t))
    got, none = cpu.rms_norm_matmul_cpu(x, w["norm"], 1e-5, w["qkv"])
    want, _ = rms_norm_matmul_torch(x, w["norm"], 1e-5, w["qkv"])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert none is None
    heads = got.view(t, -1, D)[:, : HEADS + KV_HEADS]
    for per_head in (False, True):  # RoPE is the tensor ops' arithmetic: bit for bit on the same products
        rope = tables(t, per_head)
        rotated, channel = cpu.rms_norm_matmul_cpu(x, w["norm"], 1e-5, w["qkv"], rope, HEADS + KV_HEADS, D, 3)
        assert torch.equal(rotated, rotate_heads(got, rope, HEADS + KV_HEADS, D))
        assert torch.equal(rotated[:, (HEADS + KV_HEADS) * D:], got[:, (HEADS + KV_HEADS) * D:])  # v untouched
        assert torch.equal(channel, heads[:, :, 3])  # the channel before RoPE
        _, ref_channel = rms_norm_matmul_torch(x, w["norm"], 1e-5, w["qkv"], rope, HEADS + KV_HEADS, D, 3)
        torch.testing.assert_close(channel, ref_channel, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k, n", [(64, 176), (600, 50), (37, 7)])
def test_the_products_of_a_few_rows_by_the_kernels_own_loops(k, n):
    """Up to 32 rows take the kernel's own products (more: sgemm): within 1e-5 of float64 for every row count (tiles
    of up to 6 rows, a strip past n, sums over k in chunks of 256), the same on 1 and 2 threads, and a row's result
    the same whatever rows share the call."""
    g = torch.Generator().manual_seed(k + n)
    x, w = torch.randn(33, k, generator=g), torch.randn(k, n, generator=g) / k ** 0.5
    ones = torch.ones(k)
    normed = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)
    counts = (1, 2, 3, 8, 9, 17, 32, 33)
    got = {t: cpu.rms_norm_matmul_cpu(x[:t], ones, 1e-5, w)[0] for t in counts}
    for t in counts:
        torch.testing.assert_close(got[t].double(), normed[:t] @ w.double(), rtol=1e-5, atol=1e-5)
        if t <= 32:
            assert torch.equal(got[t][:1], got[1])
    threads = torch.get_num_threads()
    torch.set_num_threads(2 if threads == 1 else 1)
    try:
        assert all(torch.equal(got[t], cpu.rms_norm_matmul_cpu(x[:t], ones, 1e-5, w)[0]) for t in counts if t <= 32)
    finally:
        torch.set_num_threads(threads)


def test_a_weights_packed_copy_follows_it():
    """A few rows' products read the weight's packed copy (column strips of S, zeros past n): made once per weight,
    made again after the weight changes in place."""
    w, x, ones = torch.randn(37, 70), torch.randn(3, 37), torch.ones(37)
    p, s = cpu.packed(w), cpu.library().strip
    assert p.shape == (-(-70 // s), 37, s) and cpu.packed(w) is p
    columns = p.transpose(0, 1).reshape(37, -1)
    assert torch.equal(columns[:, :70], w) and not columns[:, 70:].any()
    before = cpu.rms_norm_matmul_cpu(x, ones, 1e-5, w)[0]
    w.mul_(2)
    assert cpu.packed(w) is not p
    assert torch.equal(cpu.rms_norm_matmul_cpu(x, ones, 1e-5, w)[0], 2 * before)


@pytest.mark.parametrize("t", [1, 5, 64])
def test_layer_output_matches_the_tensor_ops(t):
    w, g = weights(t), torch.Generator().manual_seed(100 + t)
    x, attn = torch.randn(t, HIDDEN, generator=g), torch.randn(t, HEADS * D, generator=g)
    attn[0, :4] = torch.tensor([300.0, -300.0, 0.0, -0.0])  # SwiGLU far out on both sides: no overflow, no NaN
    args = (x, attn, w["o"], w["norm"], 1e-5, w["gate_up"], w["down"])
    got = cpu.layer_output_cpu(*args)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, layer_output_torch(*args), rtol=1e-5, atol=1e-4)
    assert torch.equal(layer_output(*args), got)  # what auto runs here


def test_autograd_bf16_and_the_torch_backend_run_the_tensor_ops():
    w, x = weights(), torch.randn(3, HIDDEN)
    attn = torch.randn(3, HEADS * D, requires_grad=True)
    out = layer_output(x, attn, w["o"], w["norm"], 1e-5, w["gate_up"], w["down"])
    out.sum().backward()  # the kernel has no backward: the tensor ops ran
    assert attn.grad is not None and attn.grad.abs().sum() > 0
    bf16 = {k: v.bfloat16() for k, v in w.items()}
    assert rms_norm_matmul(x.bfloat16(), bf16["norm"], 1e-5, bf16["qkv"])[0].dtype == torch.bfloat16
    set_backend("torch")
    try:
        args = (x, attn.detach(), w["o"], w["norm"], 1e-5, w["gate_up"], w["down"])
        assert torch.equal(layer_output(*args), layer_output_torch(*args))
    finally:
        set_backend("auto")


def test_without_torchs_blas_the_tensor_ops_run(monkeypatch):
    monkeypatch.setattr(cpu, "torch_sgemm", lambda: None)
    cpu.library.cache_clear()
    try:
        with pytest.warns(UserWarning, match="exports no sgemm_"):
            assert not compiled_runs(torch.zeros(2, 3))
        w, x = weights(), torch.randn(3, HIDDEN)
        assert torch.equal(rms_norm_matmul(x, w["norm"], 1e-5, w["qkv"])[0],
                           rms_norm_matmul_torch(x, w["norm"], 1e-5, w["qkv"])[0])
    finally:
        cpu.library.cache_clear()


def test_no_rows_and_inconsistent_shapes():
    w = weights()
    for t in (0, 1):  # no rows: empty outputs (BLAS is not called with a leading dimension of 0)
        x = torch.randn(t, HIDDEN)
        assert rms_norm_matmul(x, w["norm"], 1e-5, w["qkv"])[0].shape == (t, w["qkv"].shape[1])
        assert layer_output(x, torch.randn(t, HEADS * D), w["o"], w["norm"], 1e-5, w["gate_up"],
                            w["down"]).shape == (t, HIDDEN)
    x = torch.randn(3, HIDDEN)
    with pytest.raises(ValueError, match="rms_norm_matmul: inconsistent shapes"):
        rms_norm_matmul(x, w["norm"], 1e-5, w["down"])  # [ffn, hidden]: the wrong projection
    with pytest.raises(ValueError, match="rms_norm_matmul: inconsistent shapes"):
        rms_norm_matmul(x, w["norm"], 1e-5, w["qkv"], tables(2), HEADS + KV_HEADS, D)  # tables of 2 rows
    with pytest.raises(ValueError, match="layer_output: inconsistent shapes"):
        layer_output(x, torch.randn(3, HEADS * D), w["o"], w["norm"], 1e-5, w["gate_up"], w["gate_up"])


def _append_pool(lens: list[int], page_size: int = 4):
    """Pages and table of rows ``0..len(lens)-1`` (one page each, lengths ``lens``), 4 spare pages."""
    n = len(lens)
    table = torch.full((n, 3), -1, dtype=torch.int32)
    table[:, 0] = torch.arange(n, dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    return {"k_pages": torch.randn(n + 4, page_size, D, generator=g), "v_pages": torch.randn(n + 4, page_size, D,
                                                                                            generator=g),
            "block_table": table, "seq_lens": torch.tensor(lens, dtype=torch.int32),
            "spare": torch.arange(n, n + 4, dtype=torch.int32), "spare_left": torch.tensor([4])}


def test_a_layer_with_a_compiled_attention_is_its_three_calls(threads):
    """layer_decode (the projection, a cache's append and attention called by address, the output) equals
    rms_norm_matmul, paged_append_decode and layer_output bit for bit, pages included, on 1 and 2 threads;
    layer_attend_output the same from the heads on; too few spare pages: the attention's one-line error, nothing
    changed."""
    from kernels.layer import layer_attend_output, layer_decode
    from kernels.paged import decode_attention, paged_append_decode

    t, w = 3, weights(7)
    x, rope = torch.randn(t, HIDDEN, generator=torch.Generator().manual_seed(8)), tables(t)
    rows = torch.arange(t * KV_HEADS)
    lens = [3, 4, 1, 2, 4, 1]  # two rows at a full page: they take spare pages
    a, b, c = _append_pool(lens), _append_pool(lens), _append_pool(lens)
    heads = rms_norm_matmul(x, w["norm"], 1e-5, w["qkv"], rope, HEADS + KV_HEADS, D)[0].view(t, -1, D)
    q, k, v = heads.split((HEADS, KV_HEADS, KV_HEADS), 1)
    attn = paged_append_decode(a["k_pages"], a["v_pages"], a["block_table"], a["seq_lens"], rows, k, v,
                               q.contiguous().view(t * KV_HEADS, -1, D), 0.25, a["spare"], a["spare_left"])
    want = layer_output(x, attn.view(t, -1), w["o"], w["norm"], 1e-5, w["gate_up"], w["down"])
    call = decode_attention(b["k_pages"], b["v_pages"], b["block_table"], b["seq_lens"], (HEADS, KV_HEADS), 0.25,
                            b["spare"], b["spare_left"]).for_rows(rows)
    got = layer_decode(x, w["norm"], 1e-5, w["qkv"], rope, HEADS + KV_HEADS, D, call, w["o"], w["norm"],
                       w["gate_up"], w["down"])
    assert torch.equal(got, want)
    call = decode_attention(c["k_pages"], c["v_pages"], c["block_table"], c["seq_lens"], (HEADS, KV_HEADS), 0.25,
                            c["spare"], c["spare_left"]).for_rows(rows)
    assert torch.equal(layer_attend_output(x, heads, call, w["o"], w["norm"], 1e-5, w["gate_up"], w["down"]), want)
    for name in a:
        assert torch.equal(a[name], b[name]) and torch.equal(a[name], c[name]), name
    assert int(a["spare_left"]) == 2
    c["spare_left"][0], c["seq_lens"][:] = 1, 4  # six rows at a full page, one spare page
    before = {name: t.clone() for name, t in c.items()}
    with pytest.raises(ValueError, match="need more pages than the 1 spare ones left"):
        layer_attend_output(x, heads, call, w["o"], w["norm"], 1e-5, w["gate_up"], w["down"])
    for name in c:
        assert torch.equal(c[name], before[name]), name
