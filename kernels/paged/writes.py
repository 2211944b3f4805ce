"""Writing into paged caches, in plain tensor ops (any device).

- :func:`paged_write_torch`: store entries at given positions of given rows (append, or an eviction
  policy's in-place overwrite of a victim).
- :func:`dmc_cache_update_torch`: one DMC decode step per row (Algorithm 1): merge the new token into
  the open slot's running state or start a new one, then store the open slot's normalised state
  ``u / z`` in its entry of the page. The state update itself is :func:`dmc_open_slot_step`, on the rows'
  state gathered side by side (the DMC cache runs it on a decode step's own copy for every layer).

Open-slot state per row (fp32): ``open_k [rows, ring, d]``, ``open_v [rows, ring, d_v]`` (omega-weighted
keys / values), ``open_w [rows, ring]`` (their omegas), ``open_tokens [rows]`` (tokens in the open
segment). ``ring = 1`` is exact accumulation (merges add to the sums); ``ring = w`` keeps the segment's
last ``w`` weighted tokens (a merge overwrites the oldest: the windowed accumulation of DMC's
released inference).
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


def dmc_open_slot_step(state, tokens, append, omega, kv1):
    """One Algorithm 1 step of the open slots of ``N`` rows, in place; returns their normalised state ``[N, D]``.

    ``state [N, ring, D + 1]`` fp32: per ring slot the omega-weighted ``[k | v]`` (``D = d + d_v``) and its omega
    last (the layout of ``open_k``, ``open_v``, ``open_w`` side by side); ``tokens [N]`` int64: tokens in the
    open segment; ``append [N]`` bool (close the open slot, start a new one with this token); ``omega [N]``;
    ``kv1 [N, D + 1]``: the new token's ``[k | v | 1]``. ``ring = 1`` (exact): a merge adds to the sums, an
    append starts them; ``ring = w`` (window): the newest token replaces the oldest. Returns ``sum u / sum z``
    over the ring.
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


def dmc_cache_update_torch(k_pages, v_pages, block_table, seq_lens, rows, append, omega, k, v,
                           open_k, open_v, open_w, open_tokens) -> None:
    """One token per row: ``rows [N]``, ``append [N]`` bool, ``omega [N]``, ``k [N, d]``, ``v [N, d_v]``.

    ``seq_lens`` are the rows' lengths *after* the step (the caller grew the appending rows by one and
    gave them a page); the open slot is entry ``seq_lens[row] - 1``. Updates the state in place
    (:func:`dmc_open_slot_step` on the rows' state gathered side by side, then scattered back).
    """
    d = k.shape[1]
    state = torch.cat([open_k[rows], open_v[rows], open_w[rows][..., None]], -1)
    tokens = open_tokens[rows]
    avg = dmc_open_slot_step(state, tokens, append, omega, torch.cat([k, v, torch.ones_like(k[:, :1])], -1))
    open_k[rows], open_v[rows], open_w[rows] = state[..., :d], state[..., d:-1], state[..., -1]
    open_tokens[rows] = tokens
    paged_write_torch(k_pages, v_pages, block_table, rows, seq_lens[rows].long() - 1, avg[:, :d], avg[:, d:])
