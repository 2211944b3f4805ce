"""The paged KV pool: fixed-size pages shared by every layer, one block-table row per (sequence, layer, KV head).

Public paged-attention layouts (vLLM, FlashInfer, flash-attn's ``flash_attn_with_kvcache``) page per
*sequence*: one page holds every KV head of a token. DMC and the eviction policies keep a different
number of entries per (sequence, layer, KV head), so here every such triple is its own **row**:

    k_pages, v_pages   [num_pages, page_size, head_dim]   one pool for all layers (one free list, one budget)
    block_table        [max_rows, max_pages_per_row]      entry i of row r is at page block_table[r, i // page_size]
    seq_lens           [max_rows]                         entries held by row r

Pages are taken from the free list when a row grows past a page boundary and return to it when the
request ends (:meth:`PagePool.free_rows`). :meth:`nbytes` reports what is allocated now and at peak.
All page arithmetic is here: :meth:`PagePool.for_budget` turns a byte budget into pages.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from dmc_train.errors import InferenceError, OutOfPages
from dmc_train.units import parse_size
from kernels.paged import (
    DecodePlan,
    paged_attention,
    paged_attention_planned,
    paged_decode_plan,
    paged_write,
)

MIN_PAGE_SIZE = 16
# The default K/V budget (``kv_bytes=None``): at most this share of the device's free memory when the pool is made
# (on a GPU, what the weights left free; on the CPU, the memory available to new processes), and never more than
# every row at the model's maximum positions.
DEFAULT_MEMORY_SHARE = {"cuda": 0.9, "cpu": 0.2}


def check_page_size(page_size: int) -> None:
    if page_size < MIN_PAGE_SIZE or page_size & (page_size - 1):
        raise InferenceError(f"page_size={page_size} must be a power of two >= {MIN_PAGE_SIZE} (e.g. 16, 32, 256)")


def free_memory(device: torch.device) -> int:
    """Bytes free on ``device`` now: the GPU's free memory, or the memory available to new processes on the CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


class PageLoan(NamedTuple):
    """Pages of the free list lent to ops that take pages themselves (:meth:`PagePool.lend_pages`), on the pool's
    device: ``pages [m]`` int32, the free list's last m pages in its order, and ``left [1]`` int64, how many of them
    are not taken yet: an op takes ``pages[left - 1]`` and counts ``left`` down (the page ``pop()`` would give)."""

    pages: torch.Tensor
    left: torch.Tensor


class PagePool:
    """K/V pages, the free list, and the block table + lengths of every row.

    Args:
        num_pages: pages in the pool (the KV budget); ``page_bytes`` each.
        page_size: entries per page (power of two >= 16).
        head_dim, value_dim: channels of keys and values.
        max_rows: rows the block table can hold (max sequences x layers x KV heads).
        max_entries: longest row (the model's maximum positions).
    """

    def __init__(self, num_pages: int, page_size: int, head_dim: int, max_rows: int, max_entries: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", value_dim: int | None = None):
        check_page_size(page_size)
        value_dim = value_dim or head_dim
        self.page_size, self.dtype = page_size, dtype
        self.k_pages = torch.zeros(num_pages, page_size, head_dim, dtype=dtype, device=device)
        self.v_pages = torch.zeros(num_pages, page_size, value_dim, dtype=dtype, device=device)
        self.max_pages_per_row = -(-max_entries // page_size)
        self.block_table = torch.full((max_rows, self.max_pages_per_row), -1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_rows, dtype=torch.int32, device=device)
        self.free_pages: list[int] = list(range(num_pages - 1, -1, -1))  # pop() takes page 0 first
        self.free_row_ids: list[int] = list(range(max_rows - 1, -1, -1))
        self.peak_pages = 0

    @classmethod
    def for_budget(cls, kv_bytes: int | str | None, page_size: int, head_dim: int, max_rows: int, max_entries: int,
                   rows_per_seq: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                   value_dim: int | None = None) -> "PagePool":
        """The pool whose K/V pages fit in ``kv_bytes`` (bytes, or a size such as ``"64MB"``; None: every one
        of ``max_rows`` rows can hold ``max_entries`` entries, within :data:`DEFAULT_MEMORY_SHARE` of the device's
        free memory). A one-line error when it would not hold one page for each of the ``rows_per_seq`` rows of a
        sequence."""
        check_page_size(page_size)
        device = torch.device(device)
        page_bytes = cls.bytes_per_page(page_size, head_dim, dtype, value_dim)
        if kv_bytes is None:
            share, free = DEFAULT_MEMORY_SHARE[device.type], free_memory(device)
            num_pages = min(max_rows * -(-max_entries // page_size), int(share * free) // page_bytes)
            if num_pages < rows_per_seq:
                raise InferenceError(f"{share:.0%} of the {free / 2**30:.2f} GiB free on {device} holds "
                                     f"fewer than one KV page per KV head per layer ({rows_per_seq}); free memory or "
                                     f"pass kv_bytes")
        else:
            num_pages = parse_size(kv_bytes, "kv_bytes") // page_bytes
        if num_pages < rows_per_seq:
            raise InferenceError(f"kv_bytes={kv_bytes} holds {num_pages} pages of {page_bytes} bytes, fewer than one "
                                 f"page per KV head per layer ({rows_per_seq}); raise it to at least "
                                 f"{rows_per_seq * page_bytes}")
        return cls(num_pages, page_size, head_dim, max_rows, max_entries, dtype, device, value_dim)

    @staticmethod
    def bytes_per_page(page_size: int, head_dim: int, dtype: torch.dtype, value_dim: int | None = None) -> int:
        """Bytes of one page: ``page_size`` keys of ``head_dim`` and values of ``value_dim`` (default head_dim)."""
        return page_size * (head_dim + (value_dim or head_dim)) * dtype.itemsize

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.k_pages.device

    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[0]

    @property
    def page_bytes(self) -> int:
        return self.bytes_per_page(self.page_size, self.k_pages.shape[-1], self.dtype, self.v_pages.shape[-1])

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self.free_pages)

    def nbytes(self) -> dict[str, int]:
        """Bytes of K/V pages allocated now and at peak (the pool's own size is ``total``)."""
        return {"allocated": self.used_pages * self.page_bytes, "peak": self.peak_pages * self.page_bytes,
                "total": self.num_pages * self.page_bytes}

    def pages_for(self, lens: torch.Tensor) -> torch.Tensor:
        """Pages needed to hold ``lens`` entries (elementwise, int64)."""
        return (lens.long() + self.page_size - 1) // self.page_size

    def pages_of(self, rows: torch.Tensor) -> int:
        """Pages held by ``rows``."""
        return int(self.pages_for(self.seq_lens[rows]).sum())

    # -- rows -------------------------------------------------------------------------------------
    def new_rows(self, count: int) -> torch.Tensor:
        """``count`` empty rows ``[count]`` (int64)."""
        if count > len(self.free_row_ids):
            raise OutOfPages(f"the block table has {len(self.free_row_ids)} free rows, {count} needed; "
                             f"raise the engine's max_batch")
        return torch.tensor([self.free_row_ids.pop() for _ in range(count)], dtype=torch.long, device=self.device)

    def free_rows(self, rows: torch.Tensor) -> None:
        """Return ``rows`` and their pages to the free lists."""
        table = self.block_table[rows]  # [n, max_pages]; row by row, in order, as pop() hands them out again
        used = torch.arange(table.shape[1], device=table.device) < self.pages_for(self.seq_lens[rows])[:, None]
        self.free_pages.extend(table[used].tolist())
        self.block_table[rows] = -1
        self.seq_lens[rows] = 0
        self.free_row_ids.extend(rows.tolist())

    # -- growing rows -----------------------------------------------------------------------------
    def pages_needed(self, rows: torch.Tensor, new_lens: torch.Tensor) -> int:
        """Pages that :meth:`grow` would take to give ``rows`` lengths ``new_lens``."""
        return int((self.pages_for(new_lens) - self.pages_for(self.seq_lens[rows])).clamp(min=0).sum())

    def grow(self, rows: torch.Tensor, new_lens: torch.Tensor) -> None:
        """Set the lengths of ``rows [n]`` to ``new_lens [n]`` (>= current), taking pages as needed.

        Raises :class:`OutOfPages` (and changes nothing) when the free list is too short.
        """
        have, need = self.pages_for(self.seq_lens[rows]), self.pages_for(new_lens)
        extra = (need - have).clamp(min=0)
        needed = int(extra.sum())
        if needed:
            if needed > len(self.free_pages):  # (a row can pass the model's positions only by needing a page)
                raise OutOfPages(f"out of KV pages: {needed} needed, {len(self.free_pages)} free of {self.num_pages}")
            longest = int(new_lens.max())
            if longest > self.max_pages_per_row * self.page_size:
                raise InferenceError(f"a row would hold {longest} entries, more than the model's "
                                     f"{self.max_pages_per_row * self.page_size} positions")
            # the pages pop() would take, in row order: row r's new pages go to its entries have[r]..need[r]-1
            pages = self.free_pages[: -needed - 1: -1]
            del self.free_pages[-needed:]
            first = (extra.cumsum(0) - extra).repeat_interleave(extra)  # where each row's new pages start
            index = have.repeat_interleave(extra) + torch.arange(needed, device=self.device) - first
            self.block_table[rows.repeat_interleave(extra), index] = torch.tensor(pages, dtype=torch.int32,
                                                                                  device=self.device)
            self.peak_pages = max(self.peak_pages, self.used_pages)
        self.seq_lens[rows] = new_lens.to(torch.int32)

    def lend_pages(self, count: int) -> PageLoan:
        """Lend the last ``min(count, free)`` pages of the free list to ops that take pages as they go (DMC's
        decode step: :func:`kernels.paged.dmc_cache_update`), in the order ``pop()`` would give them. The free list
        is unchanged until :meth:`settle`; nothing else may take or return pages in between."""
        pages = self.free_pages[len(self.free_pages) - min(count, len(self.free_pages)):]
        return PageLoan(torch.tensor(pages, dtype=torch.int32, device=self.device),
                        torch.tensor([len(pages)], device=self.device))

    def settle(self, loan: PageLoan) -> None:
        """Take the pages the ops took from ``loan`` (the last ``m - left`` of the free list) off the free list and
        count the peak (the count is read once, on the host)."""
        left = int(loan.left)
        if left < 0:  # only an op that takes pages without checking on the host (the Triton one) gets here
            raise InferenceError(f"a decode step's appends needed {-left} more pages than the {len(loan.pages)} "
                                 f"lent (PagePool.lend_pages); the cache is inconsistent, restart the engine")
        taken = len(loan.pages) - left
        if taken:
            del self.free_pages[-taken:]
            self.peak_pages = max(self.peak_pages, self.used_pages)

    # -- reading and writing entries --------------------------------------------------------------
    def locate(self, rows: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(page, offset)`` of entry ``positions`` of ``rows`` (same shapes, broadcastable)."""
        positions = positions.long()
        page = self.block_table[rows, positions // self.page_size].long()
        return page, positions % self.page_size

    def write(self, rows: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k [n, d]``, ``v [n, d_v]`` at entry ``positions [n]`` of ``rows [n]`` (already allocated)."""
        paged_write(self.k_pages, self.v_pages, self.block_table, rows, positions, k, v)

    def slots(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat slot ``page * page_size + offset`` of entry ``positions`` of ``rows`` (int64, broadcast shape),
        where :meth:`attend_planned`'s ``append`` writes."""
        page, offset = self.locate(rows, positions)
        return page * self.page_size + offset

    def read(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All entries of one row: ``(k [len, d], v [len, d_v])`` (tests and inspection)."""
        n = int(self.seq_lens[row])
        page, offset = self.locate(torch.full((n,), row, device=self.device), torch.arange(n, device=self.device))
        return self.k_pages[page, offset], self.v_pages[page, offset]

    def attend(self, rows: torch.Tensor, q: torch.Tensor, scale: float, scores: str | None = None,
               return_lse: bool = False):
        """Decode attention of ``q [n, G, d]`` (one token, G query heads per row) over ``rows [n]``
        -> ``[n, G, d_v]`` (cost grows with the entries the rows hold, not with a padded maximum); with
        ``scores`` (``"probs"`` | ``"logits"``) also the per-entry scores ``[n, L]`` summed over G, with
        ``return_lse`` the log-sum-exp ``[n, G]`` (:func:`kernels.paged.paged_attention`; the pool's block table
        and lengths are right by construction, so their values are not checked on the host every call)."""
        return paged_attention(q, self.k_pages, self.v_pages, self.block_table[rows], self.seq_lens[rows], scale,
                               scores=scores, return_lse=return_lse, check_values=False)

    def plan(self, rows: torch.Tensor, lens: Optional[torch.Tensor] = None,
             max_len: Optional[int] = None) -> DecodePlan:
        """What :meth:`attend_planned` over ``rows [..., n]`` needs beside q, computed once
        (:func:`kernels.paged.paged_decode_plan`). ``lens [n]``: the rows' lengths (default ``seq_lens`` of
        ``rows``, which must be 1-d then); with leading dims (e.g. ``[layers, n]``), the rows of every leading
        index must hold ``lens``; ``max_len``: a bound on them the caller knows (an eviction policy's budget)."""
        return self.plan_table(self.block_table[rows], self.seq_lens[rows] if lens is None else lens, max_len)

    def plan_table(self, table: torch.Tensor, lens: torch.Tensor, max_len: Optional[int] = None) -> DecodePlan:
        """:meth:`plan` of rows whose block table ``[..., n, max_pages]`` (``block_table[rows]``) the caller took."""
        return paged_decode_plan(table, lens, self.page_size, self.page_bytes, self.dtype, max_len)

    def attend_planned(self, plan: DecodePlan, q: torch.Tensor, scale: float, index: Optional[int] = None,
                       scores: str | None = None, return_lse: bool = False,
                       append: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None):
        """:meth:`attend` of ``q [n, G, d]`` over the rows of ``plan`` (its ``[index]`` with leading dims); ``append``
        ``(k [n, d], v [n, d_v], slots [n])``: each row's new entry, written at its flat slot (:meth:`slots`) first,
        in the same kernel call where it can be (:func:`kernels.paged.paged_attention_planned`)."""
        return paged_attention_planned(q, self.k_pages, self.v_pages, plan, scale, scores=scores,
                                       return_lse=return_lse, index=index, append=append)
