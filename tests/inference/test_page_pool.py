"""The paged KV pool: pages on demand, free list, peak accounting, clear failures that change nothing."""

import pytest
import torch

from dmc_train.errors import InferenceError, OutOfPages
from dmc_train.inference.pool import PagePool


def pool(num_pages=8, page_size=16, rows=4, entries=64):
    return PagePool(num_pages, page_size, head_dim=8, max_rows=rows, max_entries=entries)


@pytest.mark.parametrize("page_size", [8, 24, 0, 100])
def test_page_size_must_be_a_power_of_two_of_at_least_16(page_size):
    with pytest.raises(InferenceError, match=f"page_size={page_size} must be a power of two >= 16"):
        pool(page_size=page_size)


def test_pages_are_taken_on_demand_and_returned():
    p = pool()
    rows = p.new_rows(2)
    p.grow(rows, torch.tensor([1, 17]))  # 1 page + 2 pages
    assert p.used_pages == 3 and p.pages_of(rows) == 3
    p.grow(rows, torch.tensor([16, 32]))  # still within the pages held
    assert p.used_pages == 3
    p.grow(rows, torch.tensor([17, 32]))
    assert p.used_pages == 4
    k, v = torch.randn(4, 8), torch.randn(4, 8)
    p.write(rows[[0, 0, 1, 1]], torch.tensor([0, 16, 0, 31]), k, v)
    got_k, got_v = p.read(int(rows[1]))
    assert torch.equal(got_k[[0, 31]], k[2:]) and torch.equal(got_v[[0, 31]], v[2:])
    assert p.nbytes()["allocated"] == 4 * p.page_bytes
    p.free_rows(rows)
    assert p.used_pages == 0 and sorted(p.free_pages) == list(range(8))
    assert p.nbytes() == {"allocated": 0, "peak": 4 * p.page_bytes, "total": 8 * p.page_bytes}
    assert p.seq_lens.sum() == 0 and (p.block_table == -1).all()


def test_out_of_pages_changes_nothing():
    p = pool(num_pages=3)
    rows = p.new_rows(2)
    p.grow(rows, torch.tensor([16, 16]))
    before = (p.block_table.clone(), p.seq_lens.clone(), list(p.free_pages))
    with pytest.raises(OutOfPages, match="out of KV pages: 2 needed, 1 free of 3"):
        p.grow(rows, torch.tensor([17, 17]))
    assert torch.equal(p.block_table, before[0]) and torch.equal(p.seq_lens, before[1])
    assert p.free_pages == before[2]


def test_rows_are_limited_and_cannot_outgrow_the_model():
    p = pool(rows=2, entries=32)
    rows = p.new_rows(2)
    with pytest.raises(OutOfPages, match="the block table has 0 free rows, 1 needed; raise the engine's max_batch"):
        p.new_rows(1)
    with pytest.raises(InferenceError, match="would hold 33 entries, more than the model's 32 positions"):
        p.grow(rows[:1], torch.tensor([33]))


def test_a_byte_budget_becomes_whole_pages_in_the_pool():
    fp32 = PagePool.bytes_per_page(16, 8, torch.float32)
    assert fp32 == 16 * (8 + 8) * 4 and PagePool.bytes_per_page(16, 8, torch.bfloat16, value_dim=4) == 16 * 12 * 2
    p = PagePool.for_budget(10 * fp32 + fp32 // 2, 16, 8, max_rows=4, max_entries=64, rows_per_seq=2)
    assert p.num_pages == 10 and p.page_bytes == fp32  # whole pages only
    assert PagePool.for_budget("5KiB", 16, 8, 4, 64, 2).num_pages == 5 * 1024 // fp32
    assert PagePool.for_budget(None, 16, 8, max_rows=4, max_entries=40, rows_per_seq=2).num_pages == 4 * 3  # full rows
    with pytest.raises(InferenceError, match=f"kv_bytes=1500 holds 1 pages of {fp32} bytes, fewer than one page per "
                                             f"KV head per layer \\(2\\); raise it to at least {2 * fp32}"):
        PagePool.for_budget(1500, 16, 8, 4, 64, rows_per_seq=2)


def test_lent_pages_leave_the_free_list_only_when_taken():
    """lend_pages lends the free list's last pages (no change to it); settle takes off the ones an op took (the last
    ``m - left``, which pop() would have given), and the peak counts only them."""
    p = pool(num_pages=8, rows=3)
    rows = p.new_rows(3)
    p.grow(rows, torch.tensor([16, 5, 32]))  # 1 + 1 + 2 pages
    free = list(p.free_pages)
    loan = p.lend_pages(3)
    assert loan.pages.tolist() == free[-3:] and int(loan.left) == 3 and p.free_pages == free
    p.block_table[rows[0], 1] = loan.pages[int(loan.left) - 1]  # an op takes one: the page pop() would give
    loan.left.sub_(1)
    p.seq_lens[rows[0]] = 17
    p.settle(loan)
    assert p.free_pages == free[:-1] and p.block_table[rows[0], 1] == free[-1]
    assert p.used_pages == 5 == p.pages_of(rows) and p.peak_pages == 5
    assert len(p.lend_pages(10).pages) == 3  # at most the free pages
    p.settle(p.lend_pages(2))  # nothing taken: nothing changes
    assert p.free_pages == free[:-1]
    short = p.lend_pages(2)
    short.left.sub_(3)  # an op that counts down without checking on the host (Triton's) took one page too many
    with pytest.raises(InferenceError, match="^a decode step's appends needed 1 more pages than the 2 lent"):
        p.settle(short)
    assert p.free_pages == free[:-1]
    p.free_rows(rows)
    assert sorted(p.free_pages) == list(range(8))
