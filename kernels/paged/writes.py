"""Writing into paged caches, in plain tensor ops (any device).

- :func:`paged_write_torch`: store entries at given positions of given rows (append, or an eviction
  policy's in-place overwrite of a victim).
- :func:`take_spare_pages_torch`: the pages of a decode step's appends, taken from the caller's spare pages.
- :func:`dmc_cache_update_torch`: one DMC decode step per row (Algorithm 1): merge the new token into
  the open slot's running state or start a new one (the row's length counted), then store the open slot's
  normalised state ``u / z`` in its entry of the page.

Open-slot state per row: ``open_state [rows, ring, d + d_v + 1]`` fp32, per ring slot the omega-weighted key and
value side by side and their omega last, and ``open_tokens [rows]`` int64 (tokens in the open segment). ``ring = 1``
is exact accumulation (merges add to the sums); ``ring = w`` keeps the segment's last ``w`` weighted tokens (a
merge overwrites the oldest: the windowed accumulation of DMC's released inference).
"""

from __future__ import annotations

import torch

from ._checks import as_dtype


def write_slots_torch(k_pages, v_pages, slots, k, v) -> None:
    """``k [N, d]``, ``v [N, d_v]`` into flat slots ``page * page_size + offset`` ``[N]`` (int64) of contiguous
    pages: two row copies."""
    k_pages.view(-1, k_pages.shape[2]).index_copy_(0, slots, as_dtype(k, k_pages.dtype))
    v_pages.view(-1, v_pages.shape[2]).index_copy_(0, slots, as_dtype(v, v_pages.dtype))


def paged_write_torch(k_pages, v_pages, block_table, rows, positions, k, v) -> None:
    """``k [N, d]``, ``v [N, d_v]`` into entry ``positions [N]`` of ``rows [N]`` (pages already assigned)."""
    page_size = k_pages.shape[1]
    positions = positions.long()
    page = block_table[rows, positions // page_size].long()
    if k_pages.is_contiguous() and v_pages.is_contiguous():
        write_slots_torch(k_pages, v_pages, page * page_size + positions % page_size, k, v)
        return
    k_pages[page, positions % page_size] = k.to(k_pages.dtype)
    v_pages[page, positions % page_size] = v.to(v_pages.dtype)


def _open_slot_step(state, tokens, append, omega, kv1):
    """One Algorithm 1 step of the open slots of ``N`` rows, in place; returns their normalised state ``[N, D]``.

    ``state [N, ring, D + 1]`` fp32 (``D = d + d_v``; the module's layout), ``tokens [N]`` int64, ``append [N]``
    bool (close the open slot, start a new one with this token), ``omega [N]``, ``kv1 [N, D + 1]``: the new token's
    ``[k | v | 1]``. ``ring = 1`` (exact): a merge adds to the sums, an append starts them; ``ring = w`` (window):
    the newest token replaces the oldest. Returns ``sum u / sum z`` over the ring.
    """
    n, ring, width = state.shape
    new = as_dtype(kv1, torch.float32) * as_dtype(omega, torch.float32)[:, None]  # [N, D + 1]: omega k, omega v, omega
    state.masked_fill_(append.view(n, 1, 1), 0)
    tokens.masked_fill_(append, 0)
    if ring == 1:
        total = state.view(n, width).add_(new)
    else:
        total = state.scatter_(1, (tokens % ring).view(n, 1, 1).expand(n, 1, width), new[:, None]).sum(1)
    tokens.add_(1)
    return total[:, :-1] / total[:, -1:]


def take_spare_pages_torch(block_table, seq_lens, rows, alpha, page_size: int, spare, spare_left) -> None:
    """A decode step's appending rows (``alpha == 0``; every row when ``alpha`` is None) whose last page is full get
    the page their new entry starts: ``spare[spare_left - 1]``, then the one before, in row order, ``spare_left``
    counting them down (:func:`kernels.paged.dmc_cache_update`). Raises ValueError, changing nothing, when fewer
    are left than needed or a row would pass its block-table row's pages."""
    lens = seq_lens[rows].long()
    needs = lens % page_size == 0
    if alpha is not None:
        needs &= alpha.reshape(-1) == 0
    column = lens[needs] // page_size
    needed, left = column.numel(), int(spare_left)
    if needed and int(column.max()) >= block_table.shape[1]:
        raise ValueError(f"a row would hold more entries than its block-table row's {block_table.shape[1]} pages")
    if needed > left:
        raise ValueError(f"the step's appends need more pages than the {left} spare ones left; lend more "
                         f"(PagePool.lend_pages)")
    pages = spare[left - needed: left].flip(0).to(device=block_table.device, dtype=block_table.dtype)
    block_table[rows[needs], column] = pages
    spare_left -= needed


def dmc_cache_update_torch(k_pages, v_pages, block_table, seq_lens, rows, alpha, omega, k, v, open_state,
                           open_tokens, spare=None, spare_left=None) -> torch.Tensor:
    """:func:`kernels.paged.dmc_cache_update` in tensor ops (inputs and output as there): the pages the appends start
    taken (:func:`take_spare_pages_torch`), the appending rows' lengths counted, the rows' state gathered, stepped
    (:func:`_open_slot_step`) and written back, the normalised state written into entry ``len - 1``; returns
    ``lens [N]``."""
    if spare is not None:
        take_spare_pages_torch(block_table, seq_lens, rows, alpha, k_pages.shape[1], spare, spare_left)
    n, d = rows.shape[0], k.shape[-1]
    append = (alpha == 0).reshape(n)
    seq_lens.index_add_(0, rows, append.to(seq_lens.dtype))
    lens = seq_lens[rows]
    state, tokens = open_state[rows], open_tokens[rows]
    kv1 = torch.cat([k, v, torch.ones_like(k[..., :1])], -1).view(n, -1)
    avg = _open_slot_step(state, tokens, append, omega.reshape(n), kv1)
    open_state[rows], open_tokens[rows] = state, tokens
    paged_write_torch(k_pages, v_pages, block_table, rows, lens.long() - 1, avg[:, :d], avg[:, d:])
    return lens
