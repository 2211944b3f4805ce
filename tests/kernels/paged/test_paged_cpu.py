"""The compiled CPU kernel (kernels/paged/cpu.py): built here, chosen on CPU for fp32, rows read in place, and a
build that fails falls back to PyTorch with one warning."""

import pytest
import torch

from kernels.backend import set_backend
from kernels.paged import (
    cpu,
    dmc_cache_update,
    dmc_decode,
    paged_append_decode,
    paged_attention,
    paged_attention_planned,
    paged_decode_plan,
    reads_block_table,
    reference_paged_attention,
)
from tests.kernels.paged.test_paged_attention import make_case, ragged_lens


def test_the_kernel_builds_and_runs_for_fp32_on_cpu():
    assert cpu.library() is not None, "the CPU kernel did not build (is a C compiler installed?)"
    assert reads_block_table(torch.device("cpu"), torch.float32)
    assert not reads_block_table(torch.device("cpu"), torch.bfloat16)
    q, kp, vp, bt, lens, _ = make_case(ragged_lens(16), G=4, seed=3)
    out = paged_attention(q, kp, vp, bt, lens)
    assert torch.equal(out, cpu.paged_attention_cpu(q, kp, vp, bt, lens, q.shape[-1] ** -0.5))  # what auto ran
    torch.testing.assert_close(out, reference_paged_attention(q, kp, vp, bt, lens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("d, G", [(32, 4), (64, 4), (128, 4), (32, 1), (32, 2), (64, 8), (32, 3), (40, 4)])
def test_the_sizes_compiled_as_constants_match_the_reference(d, G, threads):
    """d = dv = 32, 64, 128 with G = 1, 2, 4, 8 query heads per row run copies of the kernel compiled for those
    sizes (others, G = 3 or d = 40, the copy with variable sizes): out, scores and lse within 1e-5 of the
    reference, for rows of every length (whole and partial blocks of 16 entries), on 1 and 2 threads."""
    q, kp, vp, bt, lens, _ = make_case(ragged_lens(16), G=G, d=d, dv=d, seed=d + G)
    for scores in (None, "probs", "logits"):
        got = cpu.paged_attention_cpu(q, kp, vp, bt, lens, d ** -0.5, scores, return_lse=True)
        ref = reference_paged_attention(q, kp, vp, bt, lens, scores=scores, return_lse=True)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("page_size", [8, 24])
def test_pages_that_are_not_whole_blocks_of_16_entries(page_size):
    """The kernel attends up to 16 entries of one page at a time: pages of 8 and 24 entries split differently."""
    q, kp, vp, bt, lens, _ = make_case(ragged_lens(page_size), G=2, d=32, dv=32, page_size=page_size, seed=page_size)
    got = cpu.paged_attention_cpu(q, kp, vp, bt, lens, 0.2, "probs", return_lse=True)
    ref = reference_paged_attention(q, kp, vp, bt, lens, 0.2, scores="probs", return_lse=True)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_peaked_softmax_weights_underflow_as_in_float64():
    """Scale 20: logits up to ~100 apart, many weights below exp(-87.3), which the kernel's exponential makes 0.
    Compared with the reference in float64 on the same inputs (float32 logits of ~100 are themselves only good to
    ~1e-5, so the float32 reference is no yardstick here): out and probs within 1e-5, lse within 1e-6 relative."""
    q, kp, vp, bt, lens, _ = make_case(ragged_lens(16), G=4, d=32, dv=32, seed=8)
    out, s, lse = cpu.paged_attention_cpu(q, kp, vp, bt, lens, 20.0, "probs", return_lse=True)
    ref = reference_paged_attention(q.double(), kp.double(), vp.double(), bt, lens, 20.0, scores="probs",
                                    return_lse=True)
    torch.testing.assert_close(out.double(), ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, ref[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref[2].double(), rtol=1e-6, atol=1e-5)
    held = torch.arange(s.shape[1]) < lens[:, None]
    assert (s[held] == 0).any(), "no entry's weights all underflowed: the case does not test the cut-off"


def test_a_plan_keeps_only_the_table_and_rows_read_their_own_pages():
    """Several layers' tables in one plan, rows of every length (no padding to the longest, no groups): each
    layer picked by ``index`` equals the reference over its own table."""
    cases = [make_case(ragged_lens(16), G=2, seed=s) for s in (1, 2)]
    q, kp, vp, _, lens, _ = cases[0]
    tables = torch.stack([bt for *_, bt, _, _ in cases]).to(torch.int32)  # [layers, R, max_pages]
    plan = paged_decode_plan(tables, lens, 16, 16 * (8 + 12) * 4, torch.float32)
    assert plan.groups is None and plan.max_len is None  # no bound given, none read: the scores read the longest row
    for layer in range(2):
        kp_l, vp_l = cases[layer][1], cases[layer][2]
        got = paged_attention_planned(q, kp_l, vp_l, plan, 0.5, scores="probs", return_lse=True, index=layer)
        ref = reference_paged_attention(q, kp_l, vp_l, tables[layer], lens, 0.5, scores="probs", return_lse=True)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert paged_decode_plan(tables[0], lens, 16, 16 * 20 * 4).groups, "no dtype: the PyTorch path's plan"


def test_bf16_pages_and_autograd_take_the_pytorch_path():
    q, kp, vp, bt, lens, _ = make_case(ragged_lens(16), seed=4)
    plan = paged_decode_plan(bt, lens, 16, 16 * 20 * 2, torch.bfloat16)
    assert plan.groups and plan.max_len == max(ragged_lens(16))
    q = q.requires_grad_()
    paged_attention(q, kp, vp, bt, lens).sum().backward()  # the kernel has no backward: PyTorch's path ran
    assert q.grad is not None and q.grad.abs().sum() > 0


def test_a_failed_build_warns_once_and_falls_back(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    monkeypatch.setenv("DMC_KERNELS_CACHE", str(tmp_path))
    cpu.library.cache_clear()
    try:
        with pytest.warns(UserWarning, match="building the CPU paged-attention kernel failed"):
            assert cpu.library() is None
        assert not reads_block_table(torch.device("cpu"), torch.float32)
        q, kp, vp, bt, lens, _ = make_case(ragged_lens(16), seed=6)
        torch.testing.assert_close(paged_attention(q, kp, vp, bt, lens), reference_paged_attention(q, kp, vp, bt, lens),
                                   rtol=1e-5, atol=1e-5)
        assert list(tmp_path.iterdir()) == []  # no partial library left behind
    finally:
        cpu.library.cache_clear()


def test_the_torch_backend_skips_the_kernel():
    set_backend("torch")
    try:
        assert not reads_block_table(torch.device("cpu"), torch.float32)
    finally:
        set_backend("auto")


@pytest.mark.parametrize("ring", [1, 3])
@pytest.mark.parametrize("pattern", ["append", "merge", "alternate", "random"])
def test_the_dmc_update_equals_the_pytorch_path_bit_for_bit(ring, pattern):
    """20 decode steps of 4 rows of a pool (the first opens a slot), the decisions as the model gives them (alpha
    ``[B, H_kv]``, 0. appends) and the new tokens as ``[B, H_kv, d]`` views of a wider tensor (as the model's heads
    are): pages, lengths, state and token counts equal, bit for bit; the op counts the appends in the rows' lengths
    and returns them."""
    d, dv, page_size = 8, 6, 4
    results = []
    for use in ("torch", "auto"):
        set_backend(use)
        try:
            g = torch.Generator().manual_seed(ring)
            k_pages, v_pages = torch.zeros(36, page_size, d), torch.zeros(36, page_size, dv)
            table = torch.arange(36, dtype=torch.int32).view(6, 6)
            lens = torch.zeros(6, dtype=torch.int32)
            state = (torch.zeros(6, ring, d + dv + 1), torch.zeros(6, dtype=torch.long))
            rows = torch.tensor([2, 0, 5, 3])  # 2 sequences x 2 KV heads
            appends = torch.zeros(4, dtype=torch.int32)
            for t in range(20):
                append = {"append": torch.ones(4, dtype=torch.bool), "merge": torch.zeros(4, dtype=torch.bool),
                          "alternate": torch.full((4,), t % 2 == 0),
                          "random": torch.rand(4, generator=g) < 0.4}[pattern] | (t == 0)
                appends += append.int()
                heads = torch.randn(2, 2, 2 * d + dv, generator=g)  # [B, H_kv, ...]: k and v are strided views
                got = dmc_cache_update(k_pages, v_pages, table, lens, rows, (~append).float().view(2, 2),
                                       torch.rand(2, 2, generator=g) + 0.1, heads[..., d:2 * d], heads[..., 2 * d:],
                                       *state)
                assert torch.equal(got, appends) and got.dtype == torch.int32 and torch.equal(lens[rows], appends)
            results.append((k_pages, v_pages, lens, *state))
        finally:
            set_backend("auto")
    for a, b in zip(*results):
        assert torch.equal(a, b)


def _same_runs(results):
    """The PyTorch path's and the kernel's runs ``(outputs, tensors)``: the outputs within 1e-6, every tensor (pages,
    table, lengths, state, spare count) bit for bit. Returns the PyTorch run's tensors."""
    (out_torch, a), (out_cpu, b) = results
    torch.testing.assert_close(out_cpu, out_torch, rtol=1e-6, atol=1e-6)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    return a


def _dmc_pool(ring: int, d: int, dv: int, page_size: int):
    """A pool of 12 pages and 4 empty rows of up to 3 pages (the table -1); the open-slot state; every page spare
    (int32) and their count."""
    table = torch.full((4, 3), -1, dtype=torch.int32)
    return {"k_pages": torch.zeros(12, page_size, d), "v_pages": torch.zeros(12, page_size, dv),
            "block_table": table, "seq_lens": torch.zeros(4, dtype=torch.int32),
            "open_state": torch.zeros(4, ring, d + dv + 1), "open_tokens": torch.zeros(4, dtype=torch.long),
            "spare": torch.arange(12, dtype=torch.int32), "spare_left": torch.tensor([12])}


@pytest.mark.parametrize("ring", [1, 3])
def test_a_dmc_decode_step_takes_spare_pages_and_attends_as_the_pytorch_path(ring, threads):
    """12 decode steps of 4 rows (2 sequences x 2 KV heads, 3 query heads each) through dmc_decode: the compiled
    CPU kernel (update and attention in one call) and the PyTorch path (pages taken in tensor ops, the update op,
    paged attention) give the same outputs (within 1e-6), and bit for bit the same pages, block table (an append
    that starts a page takes ``spare[left - 1]``), lengths, state and spare count; the outputs equal the loop
    reference over the rows' entries. On 1 and 2 threads."""
    d, dv, page_size = 8, 6, 4
    results = []
    for use in ("torch", "auto"):
        set_backend(use)
        try:
            g = torch.Generator().manual_seed(ring)
            c = _dmc_pool(ring, d, dv, page_size)
            rows, outs = torch.tensor([2, 0, 3, 1]), []
            for t in range(12):
                append = (torch.rand(4, generator=g) < 0.5) | (t == 0)
                heads = torch.randn(2, 2, 2 * d + dv, generator=g)
                q = torch.randn(4, 3, d, generator=g)
                out = dmc_decode(c["k_pages"], c["v_pages"], c["block_table"], c["seq_lens"], rows,
                                 (~append).float().view(2, 2), torch.rand(2, 2, generator=g) + 0.1,
                                 heads[..., d:2 * d], heads[..., 2 * d:], c["open_state"], c["open_tokens"], q,
                                 0.3, c["spare"], c["spare_left"])
                want = reference_paged_attention(q, c["k_pages"], c["v_pages"], c["block_table"][rows],
                                                 c["seq_lens"][rows], 0.3)
                torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
                outs.append(out)
            assert int(c["spare_left"]) < 8  # rows took second pages
            results.append((torch.stack(outs), c))
        finally:
            set_backend("auto")
    a = _same_runs(results)
    taken = 12 - int(a["spare_left"])
    assert sorted(a["block_table"][a["block_table"] >= 0].tolist()) == list(range(12 - taken, 12))
    assert a["block_table"][2, 0] == 11  # the first append (row 2) takes spare[left - 1]


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_a_dmc_step_without_the_pages_it_needs_changes_nothing(backend):
    """Too few spare pages for the appends that start a page, or a row past its block-table row: a one-line
    ValueError, and the pages, table, lengths, state and spare count are as before."""
    d, dv, page_size = 8, 6, 4
    set_backend(backend)
    try:
        c = _dmc_pool(1, d, dv, page_size)
        c["block_table"][:, 0] = torch.arange(4, dtype=torch.int32)
        c["seq_lens"][:] = page_size  # every row's first page full: an append takes a page
        c["spare"], c["spare_left"][0] = c["spare"][4:], 1
        rows, k, v = torch.arange(4), torch.randn(4, d), torch.randn(4, dv)
        before = {name: t.clone() for name, t in c.items()}
        args = (c["k_pages"], c["v_pages"], c["block_table"], c["seq_lens"], rows)
        state = (k, v, c["open_state"], c["open_tokens"])
        with pytest.raises(ValueError, match="need more pages than the 1 spare ones left"):
            dmc_decode(*args, torch.zeros(4), torch.ones(4), *state, torch.randn(4, 1, d), 0.5, c["spare"],
                       c["spare_left"])
        with pytest.raises(ValueError, match="need more pages than the 0 spare ones left"):  # an empty loan
            paged_append_decode(*args, k, v, torch.randn(4, 1, d), 0.5, c["spare"][:0], torch.tensor([0]))
        c["seq_lens"][:] = 3 * page_size  # every column of the table used
        before["seq_lens"] = c["seq_lens"].clone()
        with pytest.raises(ValueError, match="more entries than its block-table row's 3 pages"):
            dmc_cache_update(*args, torch.tensor([1., 1., 0., 1.]), torch.ones(4), *state, c["spare"],
                             c["spare_left"])
        for name, t in c.items():
            assert torch.equal(t, before[name]), name
    finally:
        set_backend("auto")


def test_an_appending_decode_step_takes_spare_pages_and_attends_as_the_pytorch_path():
    """paged_append_decode over 4 rows of different lengths for 10 steps (rows cross page boundaries): the compiled
    kernel (append and attention in one call) and the PyTorch path give the same outputs, equal to the loop
    reference, and bit for bit the same pages, block table, lengths and spare count."""
    d, page_size = 8, 4
    results = []
    for use in ("torch", "auto"):
        set_backend(use)
        try:
            g = torch.Generator().manual_seed(5)
            c = _dmc_pool(1, d, d, page_size)
            c["block_table"][:, 0] = torch.arange(4, dtype=torch.int32)
            c["seq_lens"][:] = torch.tensor([1, 4, 3, 2], dtype=torch.int32)
            c["spare"], c["spare_left"][0] = c["spare"][4:], 8
            rows, outs = torch.tensor([1, 3, 0, 2]), []
            for _ in range(6):
                heads = torch.randn(2, 2, 3 * d, generator=g)
                q = torch.randn(4, 2, d, generator=g)
                out = paged_append_decode(c["k_pages"], c["v_pages"], c["block_table"], c["seq_lens"], rows,
                                          heads[..., d:2 * d], heads[..., 2 * d:], q, 0.4, c["spare"], c["spare_left"])
                want = reference_paged_attention(q, c["k_pages"], c["v_pages"], c["block_table"][rows],
                                                 c["seq_lens"][rows], 0.4)
                torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
                outs.append(out)
            assert c["seq_lens"].tolist() == [7, 10, 9, 8] and int(c["spare_left"]) == 8 - 6
            results.append((torch.stack(outs), c))
        finally:
            set_backend("auto")
    _same_runs(results)
