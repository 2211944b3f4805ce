"""Writing into paged caches, in plain tensor ops (any device).

- :func:`paged_write_torch`: store entries at given positions of given rows (append, or an eviction
  policy's in-place overwrite of a victim).
- :func:`dmc_cache_update_torch`: one DMC decode step per row (Algorithm 1): merge the new token into
  the open slot's running state or start a new one, then store the open slot's normalised state
  ``u / z`` in its entry of the page.

Open-slot state per row (fp32): ``open_k [rows, ring, d]``, ``open_v [rows, ring, d_v]`` (omega-weighted
keys / values), ``open_w [rows, ring]`` (their omegas), ``open_tokens [rows]`` (tokens in the open
segment). ``ring = 1`` is exact accumulation (merges add to the sums); ``ring = w`` keeps the segment's
last ``w`` weighted tokens (a merge overwrites the oldest: the windowed accumulation of DMC's
released inference).
"""

from __future__ import annotations


def write_slots_torch(k_pages, v_pages, slots, k, v) -> None:
    """``k [N, d]``, ``v [N, d_v]`` into flat slots ``page * page_size + offset`` ``[N]`` (int64) of contiguous
    pages: two row copies."""
    k_pages.view(-1, k_pages.shape[2]).index_copy_(0, slots, k.to(k_pages.dtype))
    v_pages.view(-1, v_pages.shape[2]).index_copy_(0, slots, v.to(v_pages.dtype))


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


def dmc_cache_update_torch(k_pages, v_pages, block_table, seq_lens, rows, append, omega, k, v,
                           open_k, open_v, open_w, open_tokens) -> None:
    """One token per row: ``rows [N]``, ``append [N]`` bool, ``omega [N]``, ``k [N, d]``, ``v [N, d_v]``.

    ``seq_lens`` are the rows' lengths *after* the step (the caller grew the appending rows by one and
    gave them a page); the open slot is entry ``seq_lens[row] - 1``. Updates the state in place.
    """
    ring = open_k.shape[1]
    omega, k, v = omega.float(), k.float(), v.float()
    if ring == 1:  # exact: a merge adds to the running sums, an append starts them (old sums times 0)
        keep = (~append).float()
        u_k = open_k[rows, 0] * keep[:, None] + omega[:, None] * k
        u_v = open_v[rows, 0] * keep[:, None] + omega[:, None] * v
        z = open_w[rows, 0] * keep + omega
        open_k[rows, 0], open_v[rows, 0], open_w[rows, 0] = u_k, u_v, z
        open_tokens[rows] = open_tokens[rows] * keep.long() + 1
        z = z[:, None]
    else:  # window: the newest token replaces the oldest of the ring
        fresh = rows[append]
        open_k[fresh], open_v[fresh], open_w[fresh], open_tokens[fresh] = 0, 0, 0, 0
        slot = open_tokens[rows] % ring
        open_k[rows, slot] = omega[:, None] * k
        open_v[rows, slot] = omega[:, None] * v
        open_w[rows, slot] = omega
        open_tokens[rows] += 1
        u_k, u_v, z = open_k[rows].sum(1), open_v[rows].sum(1), open_w[rows].sum(-1, keepdim=True)
    paged_write_torch(k_pages, v_pages, block_table, rows, seq_lens[rows].long() - 1, u_k / z, u_v / z)
