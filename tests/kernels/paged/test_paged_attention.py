"""paged_attention against the row loop of reference_paged_attention; the reference against a dense softmax."""

import math

import pytest
import torch

from kernels.paged import paged_attention, paged_attention_planned, paged_decode_plan, reference_paged_attention

pytestmark = pytest.mark.usefixtures("cpu_backend")  # conftest.py: the compiled kernel and PyTorch

MAX_PAGES = 4


def ragged_lens(page_size):
    """Row lengths covering 1, a page - 1, a page, a page + 1, some middle values and the full block table."""
    return [1, page_size - 1, page_size, page_size + 1, 3, 2 * page_size + 7, MAX_PAGES * page_size]


def make_case(lens, G=2, d=8, dv=12, page_size=16, dtype=torch.float32, spare_pages=3, seed=0):
    """Random paged inputs for rows of lengths ``lens``: each row's pages are drawn in shuffled order from a
    shared pool (plus ``spare_pages`` nobody uses); unused block_table entries are -1.

    Returns ``(q, k_pages, v_pages, block_table, seq_lens, live)`` where ``live [num_pages, page_size]``
    marks the slots holding some row's cached token.
    """
    gen = torch.Generator().manual_seed(seed)
    R = len(lens)
    used = [math.ceil(n / page_size) for n in lens]
    num_pages = sum(used) + spare_pages
    perm = torch.randperm(num_pages, generator=gen)
    block_table = torch.full((R, MAX_PAGES), -1, dtype=torch.int64)
    live = torch.zeros(num_pages, page_size, dtype=torch.bool)
    nxt = 0
    for r, (n, u) in enumerate(zip(lens, used)):
        block_table[r, :u] = perm[nxt : nxt + u]
        nxt += u
        for i in range(n):
            live[block_table[r, i // page_size], i % page_size] = True
    q = torch.randn(R, G, d, generator=gen).to(dtype)
    k_pages = torch.randn(num_pages, page_size, d, generator=gen).to(dtype)
    v_pages = torch.randn(num_pages, page_size, dv, generator=gen).to(dtype)
    return q, k_pages, v_pages, block_table, torch.tensor(lens), live


@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("G", [1, 2, 4])
def test_matches_reference_float32(page_size, G):
    q, kp, vp, bt, lens, _ = make_case(ragged_lens(page_size), G=G, page_size=page_size, seed=G + page_size)
    out = paged_attention(q, kp, vp, bt, lens)
    assert out.shape == (len(lens), G, 12) and out.dtype == torch.float32
    torch.testing.assert_close(out, reference_paged_attention(q, kp, vp, bt, lens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group_cost", [0, 1 << 20])
def test_row_groups_pay_for_themselves(monkeypatch, group_cost):
    """Free groups: rows of different page counts attend in several groups; at the real cost, small rows
    attend in one. Both equal the reference."""
    from kernels.paged import varlen

    monkeypatch.setattr(varlen, "GROUP_COST_BYTES", group_cost)
    lens = ragged_lens(16)
    used = torch.tensor([math.ceil(n / 16) for n in lens])
    groups = varlen.row_groups(used, page_bytes=16 * (8 + 12) * 4)
    assert len(groups) == (varlen.GROUPS if group_cost == 0 else 1)
    assert sorted(torch.cat(groups).tolist()) == list(range(len(lens)))
    q, kp, vp, bt, lens_t, _ = make_case(lens, seed=5)
    torch.testing.assert_close(paged_attention(q, kp, vp, bt, lens_t), reference_paged_attention(q, kp, vp, bt, lens_t),
                               rtol=1e-5, atol=1e-5)


def test_row_groups_split_where_padding_costs_more():
    """One long row among short ones: a second group saves more padding than it costs."""
    from kernels.paged import varlen

    used = torch.tensor([1] * 63 + [64])
    page_bytes = 16 * 128 * 2 * 4  # head size 128, fp32: 63 short rows padded to 64 pages would gather 63 MB
    assert len(varlen.row_groups(used, page_bytes)) > 1
    assert len(varlen.row_groups(torch.full((64,), 3), page_bytes)) == 1


def test_float64_scale_and_int32_indices():
    q, kp, vp, bt, lens, _ = make_case(ragged_lens(16), G=2, dtype=torch.float64, seed=1)
    ref = reference_paged_attention(q, kp, vp, bt, lens, scale=0.7)
    out = paged_attention(q, kp, vp, bt.int(), lens.int(), scale=0.7)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(out, paged_attention(q, kp, vp, bt, lens))  # scale is used


def test_bfloat16_against_float32_reference():
    q, kp, vp, bt, lens, _ = make_case(ragged_lens(32), G=4, page_size=32, dtype=torch.bfloat16, seed=2)
    out = paged_attention(q, kp, vp, bt, lens)
    assert out.dtype == torch.bfloat16
    ref = reference_paged_attention(q.float(), kp.float(), vp.float(), bt, lens)
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)  # only the bf16 rounding of out


@pytest.mark.parametrize("page_size", [16, 32])
def test_unreferenced_tokens_are_ignored(page_size):
    q, kp, vp, bt, lens, live = make_case(ragged_lens(page_size), G=2, page_size=page_size, seed=3)
    out = paged_attention(q, kp, vp, bt, lens)
    # Spare pages and the slots past seq_len in last pages hold huge keys / values; the -1 entries past
    # each row's used pages point at a (poisoned) real page instead.
    kp2, vp2 = kp.clone(), vp.clone()
    kp2[~live] = 1e4
    vp2[~live] = 1e4
    spare = int((~live).all(dim=1).nonzero()[0])
    bt2 = torch.where(bt < 0, torch.full_like(bt, spare), bt)
    out2 = paged_attention(q, kp2, vp2, bt2, lens)
    torch.testing.assert_close(out2, out, rtol=0, atol=0)
    torch.testing.assert_close(reference_paged_attention(q, kp2, vp2, bt2, lens), out, rtol=1e-5, atol=1e-5)


def test_reference_matches_dense_softmax():
    gen = torch.Generator().manual_seed(4)
    n, G, d, dv, page_size = 37, 3, 8, 5, 16
    q = torch.randn(G, d, generator=gen, dtype=torch.float64)
    k = torch.randn(n, d, generator=gen, dtype=torch.float64)
    v = torch.randn(n, dv, generator=gen, dtype=torch.float64)
    expected = torch.softmax(q @ k.T / math.sqrt(d), dim=-1) @ v

    # Scatter the one row's tokens into pages 4, 0, 2 of 5 (pages 1 and 3 hold noise).
    pages = [4, 0, 2]
    kp = torch.randn(5, page_size, d, generator=gen, dtype=torch.float64)
    vp = torch.randn(5, page_size, dv, generator=gen, dtype=torch.float64)
    for i in range(n):
        kp[pages[i // page_size], i % page_size] = k[i]
        vp[pages[i // page_size], i % page_size] = v[i]
    bt = torch.tensor([pages + [-1]])
    got = reference_paged_attention(q[None], kp, vp, bt, torch.tensor([n]))
    torch.testing.assert_close(got[0], expected, rtol=1e-12, atol=1e-12)


def _args():
    q, kp, vp, bt, lens, _ = make_case([5, 16, 40, 64], G=2, page_size=16, spare_pages=1, seed=5)
    return {"q": q, "k_pages": kp, "v_pages": vp, "block_table": bt, "seq_lens": lens}


def _with(**changes):
    args = _args()
    args.update({name: change(args) for name, change in changes.items()})
    return args


INVALID = [
    (dict(q=lambda a: a["q"][0]), r"q must have layout \[R, G, d\] \(3 dims\), got shape \(2, 8\)"),
    (dict(q=lambda a: a["q"].tolist()), r"q must be a torch.Tensor with layout \[R, G, d\], got list"),
    (dict(k_pages=lambda a: a["k_pages"][0]), r"k_pages must have layout \[num_pages, page_size, d\]"),
    (dict(v_pages=lambda a: a["v_pages"][None]), r"v_pages must have layout \[num_pages, page_size, d_v\]"),
    (dict(block_table=lambda a: a["block_table"][0]), r"block_table must have layout \[R, max_pages\]"),
    (dict(seq_lens=lambda a: a["seq_lens"][:, None]), r"seq_lens must have layout \[R\]"),
    (dict(q=lambda a: a["q"].long()), "q must be a floating point tensor, got torch.int64"),
    (dict(v_pages=lambda a: a["v_pages"].int()), "v_pages must be a floating point tensor, got torch.int32"),
    (dict(block_table=lambda a: a["block_table"].float()), "block_table must be int32 or int64, got torch.float32"),
    (dict(seq_lens=lambda a: a["seq_lens"].short()), "seq_lens must be int32 or int64, got torch.int16"),
    (dict(k_pages=lambda a: a["k_pages"].to("meta")), "k_pages must be on q's device cpu, got meta"),
    (dict(seq_lens=lambda a: a["seq_lens"].to("meta")), "seq_lens must be on q's device cpu, got meta"),
    (dict(block_table=lambda a: a["block_table"][:3]), r"block_table has 3 rows, expected R = 4 \(q.shape\[0\]\)"),
    (dict(seq_lens=lambda a: a["seq_lens"][1:]), r"seq_lens has 3 rows, expected R = 4 \(q.shape\[0\]\)"),
    (dict(k_pages=lambda a: a["k_pages"][..., :6]), "k_pages head size 6 must equal q's head size d = 8"),
    (dict(v_pages=lambda a: a["v_pages"][:, :8]), r"must agree in \[num_pages, page_size\]"),
    (dict(v_pages=lambda a: a["v_pages"][:-1]), r"must agree in \[num_pages, page_size\]"),
    (
        dict(seq_lens=lambda a: torch.tensor([5, 16, 40, 70])),
        r"seq_lens must be in \[1, max_pages \* page_size\] = \[1, 64\]; row 3 has 70",
    ),
    (
        dict(seq_lens=lambda a: torch.tensor([5, 0, 40, 64])),
        r"seq_lens must be in \[1, max_pages \* page_size\] = \[1, 64\]; row 1 has 0",
    ),
    (
        dict(seq_lens=lambda a: torch.tensor([17, 16, 40, 64])),  # row 0 now uses its second entry, -1
        r"page indices in \[0, num_pages\) = \[0, 10\); block_table\[0, 1\] = -1",
    ),
    (
        dict(block_table=lambda a: a["block_table"].index_fill(1, torch.tensor([0]), 10)),
        r"page indices in \[0, num_pages\) = \[0, 10\); block_table\[0, 0\] = 10",
    ),
]


@pytest.mark.parametrize("changes, match", INVALID)
def test_invalid_inputs_raise(changes, match):
    args = _with(**changes)
    with pytest.raises(ValueError, match=match):
        paged_attention(**args)
    with pytest.raises(ValueError, match=match):
        reference_paged_attention(**args)


def test_valid_args_of_the_error_cases():
    args = _args()
    torch.testing.assert_close(paged_attention(**args), reference_paged_attention(**args), rtol=1e-5, atol=1e-5)


def test_check_values_off_skips_only_the_value_checks():
    """A caller that builds its block table (the engine's pool) skips the host-side value checks; shapes and
    dtypes are still checked."""
    args = _with(seq_lens=lambda a: torch.tensor([17, 16, 40, 64]))  # row 0 reads its entry -1: unchecked
    assert paged_attention(**args, check_values=False).shape == (4, 2, 12)
    with pytest.raises(ValueError, match="q must be a floating point tensor"):
        paged_attention(**_with(q=lambda a: a["q"].long()), check_values=False)


@pytest.mark.parametrize("scores", [None, "probs"])
@pytest.mark.parametrize("layout", ["rows", "strided"])
def test_planned_attention_appends_each_rows_new_entry_first(scores, layout):
    """``append``: each row's new entry is stored at its flat slot (here the row's last entry) and attended with
    the others, in the kernel's call on the compiled path: the pages and outputs of writing first, then attending.
    The new entries as rows ``[R, d]``, or strided ``[1, R, d]`` views (as the model's heads reach a cache)."""
    q, kp, vp, bt, lens, _ = make_case(ragged_lens(16), G=2, d=8, dv=12, seed=11)
    gen = torch.Generator().manual_seed(12)
    k_new, v_new = torch.randn(len(lens), 8, generator=gen), torch.randn(len(lens), 12, generator=gen)
    if layout == "strided":  # the same values, every row 2 d apart in memory
        k_new = torch.cat([k_new, k_new], -1)[None, :, :8]
        v_new = torch.cat([v_new, v_new], -1)[None, :, :12]
        assert not k_new.is_contiguous()
    last = lens - 1
    slots = bt[torch.arange(len(lens)), last // 16] * 16 + last % 16
    expected_k, expected_v = kp.clone(), vp.clone()
    expected_k.view(-1, 8)[slots], expected_v.view(-1, 12)[slots] = k_new.reshape(-1, 8), v_new.reshape(-1, 12)
    plan = paged_decode_plan(bt.to(torch.int32), lens, 16, 16 * 20 * 4, torch.float32)
    got = paged_attention_planned(q, kp, vp, plan, 0.3, scores=scores, append=(k_new, v_new, slots))
    assert torch.equal(kp, expected_k) and torch.equal(vp, expected_v)
    ref = reference_paged_attention(q, expected_k, expected_v, bt, lens, 0.3, scores=scores)
    for a, b in zip(got if scores else [got], ref if scores else [ref]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
