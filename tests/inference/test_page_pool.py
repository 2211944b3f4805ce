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


def test_growing_pages_leaves_the_lengths_to_the_caller():
    """grow_pages takes the pages grow would take and sets no length (DMC's update op counts its appends itself);
    the rows then grow into them by their lengths alone, and the same checks refuse what grow refuses."""
    p, q = pool(), pool()
    rows = p.new_rows(2)
    q.new_rows(2)
    p.grow(rows, torch.tensor([16, 5]))
    q.grow(rows, torch.tensor([16, 5]))
    p.grow_pages(rows, torch.tensor([17, 6]))
    assert p.seq_lens[rows].tolist() == [16, 5] and p.used_pages == 3
    q.grow(rows, torch.tensor([17, 6]))
    assert torch.equal(p.block_table, q.block_table) and p.peak_pages == q.peak_pages == 3
    with pytest.raises(InferenceError, match="would hold 65 entries, more than the model's 64 positions"):
        p.grow_pages(rows[:1], torch.tensor([65]))


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


def test_a_reserved_next_page_is_returned_unless_the_row_grew_into_it():
    """reserve_next gives a page only to rows whose last page is full; return_unused returns the ones left
    unused, and the peak counts only pages that held entries."""
    p = pool(num_pages=8, rows=3)
    rows = p.new_rows(3)
    p.grow(rows, torch.tensor([16, 5, 32]))  # full, not full, full: 1 + 1 + 2 pages
    reserved = p.reserve_next(rows)
    assert p.used_pages == 6 and len(p.free_pages) == 2
    assert reserved[0].tolist() == rows[[0, 2]].tolist() and reserved[1].tolist() == [1, 2]
    assert (p.block_table[rows[[0, 2]], torch.tensor([1, 2])] >= 0).all() and p.block_table[rows[1], 1] == -1
    p.seq_lens[rows[0]] = 17  # row 0 grows into its reserved page (by its length alone), row 2 does not
    p.return_unused(reserved)
    assert p.used_pages == 5 == p.pages_of(rows) and p.peak_pages == 5
    assert p.block_table[rows[2], 2] == -1
    p.free_rows(rows)
    assert sorted(p.free_pages) == list(range(8))


def test_reserving_changes_nothing_when_pages_or_positions_run_out():
    p = pool(num_pages=2, rows=2, entries=32)
    rows = p.new_rows(2)
    p.grow(rows, torch.tensor([16, 16]))
    before = (p.block_table.clone(), list(p.free_pages))
    with pytest.raises(OutOfPages, match="out of KV pages: 2 needed, 0 free of 2"):
        p.reserve_next(rows)
    assert torch.equal(p.block_table, before[0]) and p.free_pages == before[1]
    big = pool(num_pages=4, rows=1, entries=32)
    row = big.new_rows(1)
    big.grow(row, torch.tensor([32]))  # at the model's positions: no next page to reserve
    assert big.reserve_next(row) is None and big.used_pages == 2
