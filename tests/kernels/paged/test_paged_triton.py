"""The Triton kernels of kernels/paged against the PyTorch paths: compiled on a GPU (``DMC_TEST_DEVICE=cuda``),
under the interpreter on CPU tensors (the default; tests/conftest.py sets ``TRITON_INTERPRET=1``)."""

import pytest
import torch

pytest.importorskip("triton")

from kernels import backend  # noqa: E402
from kernels.paged import dmc_cache_update, paged_attention, paged_write, reference_paged_attention  # noqa: E402
from kernels.paged.triton_kernels import paged_attention_triton  # noqa: E402
from tests.helpers import TRITON_RUNS  # noqa: E402

pytestmark = pytest.mark.skipif(not TRITON_RUNS, reason="needs a GPU or TRITON_INTERPRET=1 on CPU")


def fp32_tol(device: torch.device) -> dict:
    """Tolerances of the fp32 decode kernel against the fp32 reference: the kernel's ``tl.dot`` takes Triton's
    default input precision, IEEE fp32 under the interpreter, TF32 (10-bit mantissas) on an NVIDIA GPU, where
    an H100 gave errors up to 2e-3 (out, lse) and 6e-3 (logits summed over 8 heads) on these inputs."""
    return dict(rtol=1e-5, atol=1e-5) if device.type == "cpu" else dict(rtol=1e-2, atol=1e-2)


@pytest.fixture
def triton_backend():
    backend.set_backend("triton")
    yield
    backend.set_backend("auto")


def paged_rows(lens, page_size, d, dv, device, seed=0):
    """Random pages shared by rows of ``lens`` tokens, pages in shuffled order; unused entries -1. Drawn on
    CPU (the same values on every device), then moved to ``device``."""
    g = torch.Generator().manual_seed(seed)
    per_row = [-(-n // page_size) for n in lens]
    total = sum(per_row) + 3
    order = torch.randperm(total, generator=g).tolist()
    table = torch.full((len(lens), max(per_row) + 1), -1, dtype=torch.int32)
    for r, n in enumerate(per_row):
        table[r, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
    k = torch.randn(total, page_size, d, generator=g)
    v = torch.randn(total, page_size, dv, generator=g)
    return tuple(x.to(device) for x in (k, v, table, torch.tensor(lens, dtype=torch.int32)))


@pytest.mark.parametrize("G, d, dv, page_size", [(1, 64, 64, 16), (2, 64, 32, 16), (4, 128, 128, 32),
                                                 (8, 64, 64, 16), (2, 32, 32, 64), (4, 32, 32, 128)])
def test_paged_decode_kernel_matches_the_reference(G, d, dv, page_size, device):
    lens = [1, page_size, page_size + 1, 3 * page_size, 5 * page_size - 3]  # incl. a last page exactly full
    k, v, table, seq_lens = paged_rows(lens, page_size, d, dv, device)
    q = torch.randn(len(lens), G, d).to(device)
    want = reference_paged_attention(q, k, v, table, seq_lens)
    for splits in (4, None):  # a row's tiles shared by 4 programs (empty shares too), merged by log-sum-exps; default
        got = paged_attention_triton(q, k, v, table, seq_lens, d ** -0.5, splits=splits)
        torch.testing.assert_close(got, want, **fp32_tol(device))


def test_paged_decode_kernel_bf16(device):
    k, v, table, seq_lens = paged_rows([7, 40], 16, 64, 64, device)
    q = torch.randn(2, 4, 64).to(device)
    got = paged_attention_triton(q.bfloat16(), k.bfloat16(), v.bfloat16(), table, seq_lens, 0.125)
    want = reference_paged_attention(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), table,
                                     seq_lens)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)


def test_the_public_ops_dispatch_to_triton(triton_backend, device):
    k, v, table, seq_lens = paged_rows([5, 20], 16, 64, 64, device)
    q = torch.randn(2, 2, 64).to(device)
    torch.testing.assert_close(paged_attention(q, k, v, table, seq_lens), reference_paged_attention(q, k, v, table,
                                                                                                     seq_lens),
                               **fp32_tol(device))
    new_k, new_v = torch.randn(2, 64).to(device), torch.randn(2, 64).to(device)
    rows, pos = torch.tensor([1, 0], device=device), torch.tensor([17, 2], device=device)
    paged_write(k, v, table, rows, pos, new_k, new_v)  # an in-place overwrite (an eviction) and an entry
    assert torch.equal(k[table[1, 1], 1], new_k[0]) and torch.equal(v[table[0, 0], 2], new_v[1])


@pytest.mark.parametrize("ring", [1, 3])
@pytest.mark.parametrize("pattern", ["append", "merge", "alternate", "random"])
def test_dmc_cache_update_kernel_matches_the_pytorch_path(ring, pattern, device):
    """20 DMC steps of 3 rows whose pages come from a loan: the Triton kernels (the pages taken on the device) and
    the PyTorch path give the same pages, lengths, open-slot state, block table and count of pages left."""
    rows_total, d, dv, page_size, steps = 4, 64, 32, 16, 20
    g = torch.Generator().manual_seed(ring)  # CPU draws, moved to the device
    states = []
    for use in ("torch", "triton"):
        backend.set_backend(use)
        try:
            k_pages = torch.zeros(16, page_size, d, device=device)
            v_pages = torch.zeros(16, page_size, dv, device=device)
            table = torch.full((rows_total, 4), -1, dtype=torch.int32, device=device)  # pages from the loan
            spare = torch.arange(16, dtype=torch.int32, device=device)
            spare_left = torch.tensor([16], device=device)
            lens = torch.ones(rows_total, dtype=torch.int32, device=device)
            state = (torch.zeros(rows_total, ring, d + dv + 1, device=device),
                     torch.zeros(rows_total, dtype=torch.long, device=device))
            g.manual_seed(ring)
            rows = torch.tensor([2, 0, 3], device=device)
            for t in range(steps):
                append = {"append": torch.ones(3, dtype=torch.bool), "merge": torch.zeros(3, dtype=torch.bool),
                          "alternate": torch.full((3,), t % 2 == 0),
                          "random": torch.rand(3, generator=g) < 0.4}[pattern]
                if t == 0:
                    append = torch.ones(3, dtype=torch.bool)  # the first token opens a slot
                    lens[rows] = 0
                alpha, omega = (~append).float().to(device), (torch.rand(3, generator=g) + 0.1).to(device)
                new_k, new_v = torch.randn(3, d, generator=g).to(device), torch.randn(3, dv, generator=g).to(device)
                got = dmc_cache_update(k_pages, v_pages, table, lens, rows, alpha, omega, new_k, new_v, *state,
                                       spare, spare_left)
                assert torch.equal(got, lens[rows])  # the lengths after the step, appends counted
            states.append((k_pages, v_pages, lens, *state, table, spare_left))
        finally:
            backend.set_backend("auto")
    for a, b in zip(*states):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["probs", "logits"])
@pytest.mark.parametrize("G, d, page_size", [(1, 32, 16), (4, 64, 16), (3, 16, 32)])
def test_paged_decode_kernel_scores_match_the_reference(kind, G, d, page_size, device):
    lens = [1, page_size, page_size + 1, 3 * page_size + 5, 9 * page_size + 3]  # 1, a full page, a page + 1, more
    k, v, table, seq_lens = paged_rows(lens, page_size, d, 32, device, seed=G)  # pages in shuffled order
    q = torch.randn(len(lens), G, d, generator=torch.Generator().manual_seed(G)).to(device)
    want_out, want_s = reference_paged_attention(q, k, v, table, seq_lens, scores=kind)
    tol = fp32_tol(device)
    for splits in (3, None):  # shares of a row's tiles merged by log-sum-exps (the lse behind "probs"); the default
        out, s = paged_attention_triton(q, k, v, table, seq_lens, d ** -0.5, scores=kind, splits=splits)
        assert s.shape == (len(lens), max(lens)) and s.dtype == torch.float32
        torch.testing.assert_close(s, want_s, **tol)
        torch.testing.assert_close(out, want_out, **tol)
        plain = paged_attention_triton(q, k, v, table, seq_lens, d ** -0.5, splits=splits)
        torch.testing.assert_close(out, plain, rtol=0, atol=0)  # out unchanged by the scores
        _, bounded, lse = paged_attention_triton(q, k, v, table, seq_lens, d ** -0.5, scores=kind, return_lse=True,
                                                 max_len=max(lens) + 37, splits=splits)  # a bound on the rows given
        assert bounded.shape == (len(lens), max(lens) + 37)  # the bound is the scores' width, 0 past every row
        torch.testing.assert_close(bounded[:, :max(lens)], want_s, **tol)
        assert (bounded[:, max(lens):] == 0).all()
        want_lse = reference_paged_attention(q, k, v, table, seq_lens, return_lse=True)[1]
        torch.testing.assert_close(lse, want_lse, **tol)
    assert (s[torch.arange(max(lens), device=device) >= seq_lens[:, None].long()] == 0).all()


def test_paged_decode_kernel_scores_bf16_and_dispatch(triton_backend, device):
    k, v, table, seq_lens = paged_rows([7, 40], 16, 32, 32, device, seed=3)
    q = torch.randn(2, 4, 32).to(device)
    for kind in ("probs", "logits"):
        out, s = paged_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), table, seq_lens, scores=kind)
        _, want = reference_paged_attention(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), table,
                                            seq_lens, scores=kind)
        assert out.dtype == torch.bfloat16 and s.dtype == torch.float32
        torch.testing.assert_close(s, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="^scores must be None, 'probs' or 'logits', got 'prob'$"):
        paged_attention(q, k, v, table, seq_lens, scores="prob")
