"""paged_attention(scores=...) (on both CPU paths: the compiled kernel and PyTorch) and attention_column_sums
against the loop references, the references against dense computations."""

import math

import pytest
import torch

from kernels.paged import (
    attention_column_sums,
    paged_attention,
    reference_attention_column_sums,
    reference_paged_attention,
)
from tests.kernels.paged.test_paged_attention import make_case, ragged_lens

pytestmark = pytest.mark.usefixtures("cpu_backend")  # conftest.py: the compiled kernel and PyTorch

KINDS = ["probs", "logits"]


def dense_scores(q, k_pages, block_table, seq_lens, scale, kind):
    """Per row: gather its keys in block-table order, all G heads' logits at once, sum over G; pad with 0."""
    page_size = k_pages.shape[1]
    L = int(seq_lens.max())
    s = torch.zeros(q.shape[0], L, dtype=torch.float64)
    for r, n in enumerate(seq_lens.tolist()):
        pos = torch.arange(n)
        k = k_pages[block_table[r, pos // page_size].long(), pos % page_size].double()
        logits = q[r].double() @ k.T * scale  # [G, n]
        s[r, :n] = (torch.softmax(logits, -1) if kind == "probs" else logits).sum(0)
    return s.float()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("G, page_size", [(1, 16), (4, 16), (2, 32)])
def test_scores_match_the_reference(kind, G, page_size):
    lens = ragged_lens(page_size)  # 1, page - 1, page, page + 1, ..., the full table; pages shuffled
    q, kp, vp, bt, seq_lens, _ = make_case(lens, G=G, page_size=page_size, seed=10 + G)
    out, s = paged_attention(q, kp, vp, bt, seq_lens, scores=kind)
    ref_out, ref_s = reference_paged_attention(q, kp, vp, bt, seq_lens, scores=kind)
    assert s.shape == (len(lens), max(lens)) and s.dtype == torch.float32
    torch.testing.assert_close(s, ref_s, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, paged_attention(q, kp, vp, bt, seq_lens), rtol=0, atol=0)  # out unchanged
    tail = torch.arange(max(lens)) >= seq_lens[:, None]
    assert (s[tail] == 0).all() and (ref_s[tail] == 0).all()
    if kind == "probs":
        torch.testing.assert_close(s.sum(1), torch.full((len(lens),), float(G)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_reference_scores_match_dense(kind):
    q, kp, vp, bt, seq_lens, _ = make_case(ragged_lens(16), G=3, dtype=torch.float64, seed=11)
    _, s = reference_paged_attention(q, kp, vp, bt, seq_lens, scale=0.3, scores=kind)
    assert s.dtype == torch.float32
    torch.testing.assert_close(s, dense_scores(q, kp, bt, seq_lens, 0.3, kind), rtol=1e-6, atol=1e-6)


def test_scores_float64_bfloat16_and_int32_indices():
    q, kp, vp, bt, seq_lens, _ = make_case(ragged_lens(16), G=2, dtype=torch.float64, seed=12)
    out, s = paged_attention(q, kp, vp, bt.int(), seq_lens.int(), scale=0.7, scores="logits")
    assert out.dtype == torch.float64 and s.dtype == torch.float32
    torch.testing.assert_close(s, dense_scores(q, kp, bt, seq_lens, 0.7, "logits"), rtol=1e-6, atol=1e-5)

    q, kp, vp, bt, seq_lens, _ = make_case(ragged_lens(32), G=4, page_size=32, dtype=torch.bfloat16, seed=13)
    for kind in KINDS:
        out, s = paged_attention(q, kp, vp, bt, seq_lens, scores=kind)
        assert out.dtype == torch.bfloat16 and s.dtype == torch.float32
        # computed in fp32 from the bf16 inputs: only the summation order differs
        torch.testing.assert_close(s, dense_scores(q, kp, bt, seq_lens, 8 ** -0.5, kind), rtol=1e-4, atol=1e-4)


def test_scores_of_no_rows():
    q, kp, vp = torch.zeros(0, 2, 8), torch.zeros(3, 16, 8), torch.zeros(3, 16, 4)
    bt, seq_lens = torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    for fn in (paged_attention, reference_paged_attention):
        out, s = fn(q, kp, vp, bt, seq_lens, scores="probs")
        assert out.shape == (0, 2, 4) and s.shape == (0, 0) and s.dtype == torch.float32
        assert fn(q, kp, vp, bt, seq_lens).shape == (0, 2, 4)


@pytest.mark.parametrize("bad", ["prob", "PROBS", "", 1, True, ("probs",)])
def test_bad_scores_raise(bad):
    q, kp, vp, bt, seq_lens, _ = make_case([3, 20], G=2, seed=14)
    for fn in (paged_attention, reference_paged_attention):
        with pytest.raises(ValueError, match=r"^scores must be None, 'probs' or 'logits', got .+$") as err:
            fn(q, kp, vp, bt, seq_lens, scores=bad)
        assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------------------- column sums


def dense_column_sums(q, k, scale, tau=1.0, noise_table=None):
    """The full causal [b, H, n, n] weights in float64, summed over queries and the G heads of each KV head."""
    b, H, n, _ = q.shape
    G = H // k.shape[1]
    logits = q.double() @ k.double().repeat_interleave(G, dim=1).transpose(-1, -2) * scale
    if noise_table is not None:
        logits = logits + noise_table.double()
    logits = logits / tau
    logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    w = torch.softmax(logits, dim=-1)  # [b, H, n, n]
    return w.sum(2).view(b, k.shape[1], G, n).sum(2).float()


def gumbel_table(b, H, n, seed):
    u = torch.rand(b, H, n, n, generator=torch.Generator().manual_seed(seed)).clamp(1e-6, 1 - 1e-6)
    return -torch.log(-torch.log(u))


def table_noise(table, calls=None):
    """A noise callable reading a fixed [b, H, n, n] table (so the blockwise op and the references agree)."""
    def noise(qp, kp):
        assert qp.dtype == kp.dtype == torch.int64 and qp.dim() == kp.dim() == 1
        if calls is not None:
            calls.append((qp.tolist(), kp.tolist()))
        return table[:, :, qp][:, :, :, kp]
    return noise


def qk(b, H, H_kv, n, d, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, H, n, d, generator=g).to(dtype), torch.randn(b, H_kv, n, d, generator=g).to(dtype)


@pytest.mark.parametrize("H, H_kv, n, block", [(2, 2, 37, 16), (4, 2, 37, 16), (6, 2, 40, 128), (4, 1, 9, 1),
                                               (3, 1, 32, 32)])
def test_column_sums_match_dense(H, H_kv, n, block):
    q, k = qk(2, H, H_kv, n, 16, seed=H * n + block)
    got = attention_column_sums(q, k, 0.25, block=block)
    want = dense_column_sums(q, k, 0.25)
    assert got.shape == (2, H_kv, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.sum(-1), torch.full((2, H_kv), float(H // H_kv * n)), rtol=1e-5, atol=1e-4)
    # the last key is seen by the last query only
    torch.testing.assert_close(got[..., -1], want[..., -1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("H, H_kv, n, block", [(4, 2, 37, 16), (3, 1, 32, 128), (2, 2, 9, 1)])
def test_column_sums_with_the_attention_in_one_pass(H, H_kv, n, block):
    """With v the op also returns the causal attention (from the same probabilities): SDPA's to float rounding, the
    column sums bit for bit those without v; tau and noise are refused then."""
    q, k = qk(2, H, H_kv, n, 16, seed=H * n + block + 1)
    v = torch.randn(2, H_kv, n, 12, generator=torch.Generator().manual_seed(n))
    out, sums = attention_column_sums(q, k, 0.25, block=block, v=v)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=True)
    assert out.shape == (2, H, n, 12)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(sums, attention_column_sums(q, k, 0.25, block=block))
    with pytest.raises(ValueError, match="tau must be 1 and no noise"):
        attention_column_sums(q, k, 0.25, tau=0.5, v=v)
    with pytest.raises(ValueError, match=r"v \(2, 1, 3, 12\) must agree with k"):
        attention_column_sums(q, k, 0.25, v=v[:, :1, :3])


def test_column_sums_tau_and_noise_blockwise():
    b, H, H_kv, n, block = 2, 4, 2, 45, 16  # n not a multiple of block
    q, k = qk(b, H, H_kv, n, 8, seed=20)
    table = gumbel_table(b, H, n, seed=21)
    calls = []
    got = attention_column_sums(q, k, 0.35, tau=0.5, noise=table_noise(table, calls), block=block)
    want = dense_column_sums(q, k, 0.35, tau=0.5, noise_table=table)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # one call per block: its queries and the keys it can see (never more than block x n)
    assert calls == [(list(range(i, min(i + block, n))), list(range(min(i + block, n)))) for i in range(0, n, block)]
    assert not torch.allclose(got, attention_column_sums(q, k, 0.35, tau=0.5, block=block))  # the noise is used
    assert not torch.allclose(got, attention_column_sums(q, k, 0.35, noise=table_noise(table), block=block))  # tau
    # a noise of shape [m, m_k] broadcasts over b and H
    shared = table[0, 0]
    got2 = attention_column_sums(q, k, 0.35, noise=lambda qp, kp: shared[qp][:, kp], block=block)
    torch.testing.assert_close(got2, dense_column_sums(q, k, 0.35, noise_table=shared), rtol=1e-5, atol=1e-5)


def test_column_sums_reference_matches_dense():
    b, H, H_kv, n = 2, 4, 2, 21
    q, k = qk(b, H, H_kv, n, 8, seed=22)
    table = gumbel_table(b, H, n, seed=23)
    got = reference_attention_column_sums(q, k, 0.3, tau=0.7, noise=table_noise(table))
    torch.testing.assert_close(got, dense_column_sums(q, k, 0.3, 0.7, table), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(reference_attention_column_sums(q, k, 0.3), dense_column_sums(q, k, 0.3),
                               rtol=1e-5, atol=1e-5)


def test_column_sums_bfloat16():
    q, k = qk(1, 4, 2, 50, 32, seed=24, dtype=torch.bfloat16)
    got = attention_column_sums(q, k, 32 ** -0.5, tau=1.5, block=16)
    assert got.dtype == torch.float32
    # computed in fp32 from the bf16 values
    torch.testing.assert_close(got, dense_column_sums(q.float(), k.float(), 32 ** -0.5, tau=1.5), rtol=1e-5,
                               atol=1e-4)
    torch.testing.assert_close(got, reference_attention_column_sums(q, k, 32 ** -0.5, tau=1.5), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("q_shape, k_shape, tau, block, match", [
    ((1, 4, 5, 8), (1, 3, 5, 8), 1.0, 4, r"q's 4 heads must be a multiple of k's H_kv = 3 heads"),
    ((1, 4, 5, 8), (1, 2, 6, 8), 1.0, 4, r"must agree with q \(1, 4, 5, 8\) in b, n and d"),
    ((1, 4, 5), (1, 2, 5, 8), 1.0, 4, r"q must have layout \[b, H, n, d\] \(4 dims\)"),
    ((1, 4, 5, 8), (1, 2, 5, 8), 0.0, 4, "tau must be > 0, got 0.0"),
    ((1, 4, 5, 8), (1, 2, 5, 8), 1.0, 0, "block must be a positive int, got 0"),
])
def test_column_sums_invalid_inputs(q_shape, k_shape, tau, block, match):
    with pytest.raises(ValueError, match=match):
        attention_column_sums(torch.zeros(q_shape), torch.zeros(k_shape), 1.0, tau=tau, block=block)


def test_column_sums_scale_matters():
    q, k = qk(1, 2, 2, 10, 8, seed=25)
    assert not torch.allclose(attention_column_sums(q, k, 1.0), attention_column_sums(q, k, 1 / math.sqrt(8)))


@pytest.mark.parametrize("kind", [None, "probs"])
def test_lse_matches_the_reference_and_dense(kind):
    q, kp, vp, bt, seq_lens, _ = make_case(ragged_lens(16), G=3, seed=13)
    got = paged_attention(q, kp, vp, bt, seq_lens, scores=kind, return_lse=True)
    ref = reference_paged_attention(q, kp, vp, bt, seq_lens, scores=kind, return_lse=True)
    assert len(got) == len(ref) == (3 if kind else 2)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    lse = got[-1]
    for r, n in enumerate(seq_lens.tolist()):
        pos = torch.arange(n)
        k = kp[bt[r, pos // 16].long(), pos % 16]
        torch.testing.assert_close(lse[r], (q[r] @ k.T / math.sqrt(q.shape[-1])).logsumexp(-1), rtol=1e-5, atol=1e-5)
