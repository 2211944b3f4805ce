"""Which samples each data-parallel rank reads at each step.

Global step ``s`` (after ``consumed`` samples) uses samples ``[consumed, consumed + global_batch)``;
data-parallel rank ``r`` takes the ``r``-th contiguous slice, cut into micro-batches. The data
position is therefore just ``consumed_samples``, stored in every checkpoint.
"""

from __future__ import annotations

from typing import Iterator

import torch


def step_microbatches(dataset, consumed: int, global_batch: int, micro_batch: int,
                      dp_rank: int, dp_size: int, device: torch.device | None = None) -> list[dict]:
    """Micro-batches (dicts of ``[micro_batch, seq]`` tensors, on ``device``) for this rank's share of one step."""
    per_rank = global_batch // dp_size
    start = consumed + dp_rank * per_rank
    out = []
    for m in range(per_rank // micro_batch):
        idx = [(start + m * micro_batch + j) % len(dataset) for j in range(micro_batch)]
        samples = [dataset[i] for i in idx]
        out.append({k: torch.stack([torch.as_tensor(s[k]) for s in samples]).to(device, non_blocking=True)
                    for k in samples[0]})
    return out


def chunk_iterators(microbatches: list[dict], num_chunks: int) -> list[Iterator[dict]] | Iterator[dict]:
    """megatron's schedules call ``next`` once per micro-batch per model chunk: one iterator per chunk."""
    if num_chunks == 1:
        return iter(microbatches)
    return [iter(microbatches) for _ in range(num_chunks)]
