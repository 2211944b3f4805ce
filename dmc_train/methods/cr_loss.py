"""DMC's compression-ratio loss (Eq. 10) over the whole model, under tensor and pipeline parallelism.

    l_CR = max(0, S - N / CR) / N,   S = sum_{l,h,t} (1 - alpha_lht),   N = n_l n_h n

S and N run over *all* layers and KV heads of the model, so each micro-batch's partial sums must be
reduced across the tensor- and pipeline-parallel ranks before the hinge. A blocking collective in
the forward would deadlock a pipeline schedule (stage 0 runs micro-batch m's forward long before the
last stage does). But the hinge's indicator ``[S > N / CR]`` is needed only at backward time, and
every rank finishes the forwards of micro-batch m (of all its model chunks) before *any* rank starts
m's backward. So each rank launches a non-blocking all-reduce of its partial sums for m as soon as
all its chunks have run m's forward (every rank launches them in the same order, m = 0, 1, ...), and
waits for it only when m's first alpha gradient - or m's loss value on the last stage - is needed.

The gradient is injected by an identity autograd function on each layer's alphas: in backward it
adds ``d l_CR / d alpha = -[S > N / CR] / N`` times the micro-batch's token count (the loop weights
every loss term by its tokens), so each rank's gradient flows only into its own alphas and from
there through the normal pipeline backward.

The tracker also counts hard decisions per (layer, KV head) for the achieved compression ratio.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Optional

import torch
import torch.distributed as dist


class CRLossTracker:
    """Per-rank bookkeeping of Eq. 10 for the micro-batches of the running schedule.

    ``num_layers`` / ``num_heads``: the full model's layer and KV-head counts (for the per-head
    statistics, indexed globally). ``group``: the model-parallel (TP x PP) process group, or None
    when this rank holds the whole model.
    """

    def __init__(self, num_layers: int, num_heads: int, num_chunks: int = 1, group=None):
        self.num_chunks, self.group = num_chunks, group
        self.target_cr = 1.0
        self.stats = torch.zeros(num_layers, num_heads, 2, dtype=torch.float64)  # (appends, decisions)
        self._forwards = defaultdict(int)  # chunk -> forwards run so far (= its next micro-batch index)
        self._reset_microbatches()

    def _reset_microbatches(self) -> None:
        self.active: Optional[int] = None  # micro-batch whose forward is running
        self._partial: dict[int, torch.Tensor] = {}  # m -> [S, N] of this rank's layers
        self._tokens: dict[int, int] = {}  # m -> tokens in the micro-batch (b * n)
        self._done: dict[int, int] = defaultdict(int)  # m -> chunks of this rank done with m
        self._pending: dict[int, object] = {}  # m -> async all-reduce work
        self._forwards.clear()

    # -- forward bookkeeping (model-chunk hooks) --------------------------------------------------
    def begin_chunk(self, chunk: int) -> None:
        self.active = self._forwards[chunk]
        self._forwards[chunk] += 1

    def end_chunk(self, chunk: int) -> None:
        m = self.active
        self._done[m] += 1
        if self._done[m] == self.num_chunks:
            sums = self._partial.setdefault(m, torch.zeros(2, dtype=torch.float64))
            if self.group is not None:
                self._pending[m] = dist.all_reduce(sums, group=self.group, async_op=True)

    def record(self, alpha: torch.Tensor, layer: int, head_offset: int, count_stats: bool = True) -> torch.Tensor:
        """Account for one layer's alphas ``[b, h_kv_local, n]`` (first token already 0).

        ``layer``: 0-based global layer index; ``head_offset``: global index of the first local KV
        head; ``count_stats``: add the hard decisions to the per-head statistics (training passes).
        Returns ``alpha`` unchanged, wired to receive the CR-loss gradient in backward.
        """
        m = self.active
        b, h, n = alpha.shape
        sums = self._partial.setdefault(m, torch.zeros(2, dtype=torch.float64))
        sums[0] += (1 - alpha.detach()).sum().double()
        sums[1] += alpha.numel()
        self._tokens[m] = b * n
        if count_stats:
            appends = (alpha.detach() <= 0.5).double().sum(dim=(0, 2))
            self.stats[layer, head_offset: head_offset + h, 0] += appends
            self.stats[layer, head_offset: head_offset + h, 1] += b * n
        if alpha.requires_grad:
            return _InjectCRGradient.apply(alpha, self, m)
        return alpha

    # -- values needed at backward / loss time ----------------------------------------------------
    def _global_sums(self, m: int) -> tuple[float, float]:
        work = self._pending.pop(m, None)
        if work is not None:
            work.wait()
        s, n = self._partial[m].tolist()
        return s, n

    def loss(self, m: int) -> float:
        s, n = self._global_sums(m)
        return max(0.0, s - n / self.target_cr) / n

    def alpha_gradient(self, m: int) -> float:
        """``d (l_CR * tokens) / d alpha`` for every alpha of micro-batch m."""
        s, n = self._global_sums(m)
        return -self._tokens[m] / n if s > n / self.target_cr else 0.0

    # -- step boundaries --------------------------------------------------------------------------
    def drain(self) -> None:
        """Finish outstanding reductions (e.g. of an evaluation pass) and forget all micro-batches."""
        for work in self._pending.values():
            work.wait()
        self._reset_microbatches()

    def reduce_stats(self, group=None) -> torch.Tensor:
        """Sum the per-(layer, head) counts over ``group`` (default: all ranks), return and reset them."""
        stats = self.stats.clone()
        if dist.is_initialized():
            dist.all_reduce(stats, group=group)
        self.stats.zero_()
        return stats


class _InjectCRGradient(torch.autograd.Function):
    """Identity in forward; adds the CR hinge's gradient to ``alpha`` in backward."""

    @staticmethod
    def forward(ctx, alpha, tracker, m):
        ctx.tracker, ctx.m = tracker, m
        return alpha.view_as(alpha)

    @staticmethod
    def backward(ctx, grad):
        return grad + ctx.tracker.alpha_gradient(ctx.m), None, None

