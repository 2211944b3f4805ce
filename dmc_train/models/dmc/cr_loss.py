"""DMC's compression-ratio loss over the whole model, under tensor and pipeline parallelism.

Four forms (``method.cr_loss``):

- ``paper`` (Eq. 10, default): ``l_CR = max(0, S - N / CR) / N`` with ``S = sum_{l,h,t} (1 - alpha)``
  over *all* layers, KV heads and tokens of the micro-batch and ``N`` their count.
- ``released`` (as the authors' Megatron-LM code): per *sequence* s of the micro-batch, the mean
  hard decision ``a_s`` over all layers, KV heads and tokens (straight-through: its gradient goes to
  the soft alphas), then ``l_CR = mean_s max(0, 1 - 1/CR - a_s)``. The released code takes the mean
  per sequence and tensor-parallel shard of heads (so its loss depends on the TP layout); here the
  mean runs over all heads of all layers, the same for every layout.
- ``per_head``: the same hinge per KV-head index ``h`` instead, ``a_h`` over layers, sequences and
  tokens, ``l_CR = mean_h max(0, 1 - 1/CR - a_h)``: head h of all layers together must reach the target.
- ``per_layer_head``: the hinge per (layer, KV head), ``a_lh`` over sequences and tokens,
  ``l_CR = mean_lh max(0, 1 - 1/CR - a_lh)``: every head of every layer must reach the target on its own.

All need sums over all layers and heads, i.e. over the tensor- and pipeline-parallel ranks, before
the hinge. A blocking collective in the forward would deadlock a pipeline schedule (stage 0 runs
micro-batch m's forward long before the last stage does). But the hinge's indicator is needed only
at backward time, and every rank finishes the forwards of micro-batch m (of all its model chunks)
before *any* rank starts m's backward. So each rank launches a non-blocking all-reduce of its
per-head partial sums for m as soon as all its chunks have run m's forward (every rank launches them
in the same order, m = 0, 1, ...), and waits for it only when m's first alpha gradient - or m's loss
value on the last stage - is needed.

The gradient is injected by an identity autograd function on each layer's alphas: in backward it
adds ``d l_CR / d alpha`` times the micro-batch's token count (the loop weights every loss term by
its tokens), so each rank's gradient flows only into its own alphas and from there through the
normal pipeline backward. The target CR is an input: each layer gives its step's target with its
alphas (:meth:`CRLossTracker.record`, kept for their backward), the loss value takes it as an argument.

The tracker also carries the DMC-C constraint's value (its gradient flows through the graph, see
``attention.py``), counts hard decisions per (layer, KV head) for the achieved CR, and keeps the training
forwards' decision logits ``k[c] - c0`` (mean and maximum): they start at ``-c0`` after the zero-out stage and
creep up for many steps before any crosses the threshold, while the achieved CR stays at the noise's level.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Optional

import torch
import torch.distributed as dist

from dmc_train import distributed

FORMS = ("paper", "released", "per_head", "per_layer_head")
# Columns of the per-micro-batch, per-(layer, KV head) sums (per sequence: HARD and COUNT).
KEEP, HARD, COUNT, CONSTRAINT = range(4)


class CRLossTracker:
    """Per-rank bookkeeping of the CR loss for the micro-batches of the running schedule.

    ``num_layers`` / ``num_heads``: the full model's layer and KV-head counts (layers and heads are
    indexed globally). ``group``: the model-parallel (TP x PP) process group, or None when this rank
    holds the whole model. ``form``: one of :data:`FORMS` (module docstring).
    """

    def __init__(self, num_layers: int, num_heads: int, num_chunks: int = 1, group=None, form: str = "paper"):
        self.num_layers, self.num_heads, self.num_chunks = num_layers, num_heads, num_chunks
        self.group, self.form = group, form
        # (appends, decisions), on the model's device like every buffer here
        self.stats = torch.zeros(num_layers, num_heads, 2, dtype=torch.float64, device=distributed.device())
        self._clear_logits()
        self._forwards = defaultdict(int)  # chunk -> forwards run so far (= its next micro-batch index)
        self._reset_microbatches()

    def _reset_microbatches(self) -> None:
        self.active: Optional[int] = None  # micro-batch whose forward is running
        self._buffers: dict[int, torch.Tensor] = {}  # m -> the flat buffer of both views below (one all-reduce)
        self._partial: dict[int, torch.Tensor] = {}  # m -> [layers, heads, 4] sums (this rank's layers filled)
        self._per_seq: dict[int, torch.Tensor] = {}  # m -> [b, 2] (HARD, COUNT) per sequence of the micro-batch
        self._tokens: dict[int, int] = {}  # m -> tokens in the micro-batch (b * n)
        self._done: dict[int, int] = defaultdict(int)  # m -> chunks of this rank done with m
        self._pending: dict[int, object] = {}  # m -> async all-reduce work
        self._forwards.clear()

    def _sums(self, m: int, batch: int = 0) -> torch.Tensor:
        """The [layers, heads, 4] sums of micro-batch m (``batch``: its sequences, known at the first record)."""
        if m not in self._partial:
            h = self.num_layers * self.num_heads * 4
            buf = torch.zeros(h + 2 * batch, dtype=torch.float64, device=distributed.device())
            self._buffers[m], self._per_seq[m] = buf, buf[h:].view(-1, 2)
            self._partial[m] = buf[:h].view(self.num_layers, self.num_heads, 4)
        return self._partial[m]

    # -- forward bookkeeping (model-chunk hooks) --------------------------------------------------
    def begin_chunk(self, chunk: int) -> None:
        self.active = self._forwards[chunk]
        self._forwards[chunk] += 1

    def end_chunk(self, chunk: int) -> None:
        m = self.active
        self._done[m] += 1
        if self._done[m] == self.num_chunks and self.group is not None:
            self._sums(m)
            self._pending[m] = dist.all_reduce(self._buffers[m], group=self.group, async_op=True)

    def record(self, alpha: torch.Tensor, layer: int, head_offset: int, target_cr: float,
               constraint: Optional[torch.Tensor] = None, logit: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Account for one layer's alphas ``[b, h_kv_local, n]`` (first token already 0).

        ``layer``: 0-based global layer index; ``head_offset``: global index of the first local KV
        head; ``target_cr``: the CR loss's target of the step; ``constraint``: the DMC-C term per local
        head ``[h_kv_local]`` (value only, for logging); ``logit``: the decision logits ``[n, b, h_kv_local]``
        the alphas were sampled from (kept for :meth:`reduce_logits` in a training forward). Returns ``alpha``
        unchanged, wired to receive the gradient of the CR loss at ``target_cr`` in backward.
        """
        m = self.active
        b, h, n = alpha.shape
        a = alpha.detach().double()
        hard = (a > 0.5).double()
        heads = slice(head_offset, head_offset + h)
        sums = self._sums(m, b)[layer]
        self._per_seq[m][:, 0] += hard.sum(dim=(1, 2))
        self._per_seq[m][:, 1] += h * n
        sums[heads, KEEP] += (1 - a).sum(dim=(0, 2))
        sums[heads, HARD] += hard.sum(dim=(0, 2))
        sums[heads, COUNT] += b * n
        if constraint is not None:
            sums[heads, CONSTRAINT] += constraint.detach().double()
        self._tokens[m] = b * n
        self.stats[layer, heads, 0] += (1 - hard).sum(dim=(0, 2))
        self.stats[layer, heads, 1] += b * n
        if not alpha.requires_grad:  # an evaluation's forward
            return alpha
        if logit is not None:
            logit = logit.detach().double()
            self._logit_sums[layer, heads, 0] += logit.sum((0, 1))
            self._logit_sums[layer, heads, 1] += b * n
            self._logit_max[layer, heads] = torch.maximum(self._logit_max[layer, heads], logit.amax((0, 1)))
        return _InjectCRGradient.apply(alpha, self, m, layer, head_offset, target_cr)

    # -- values needed at backward / loss time ----------------------------------------------------
    def _global_sums(self, m: int) -> torch.Tensor:
        work = self._pending.pop(m, None)
        if work is not None:
            work.wait()
        return self._partial[m]

    def _hinged(self, m: int) -> torch.Tensor:
        """``[..., 2]`` (hard decisions, decisions) of each group the hinge applies to: per sequence
        (``released``), per head (``per_head``) or per (layer, head) (``per_layer_head``)."""
        if self.form == "released":
            return self._per_seq[m]
        sums = self._global_sums(m)
        return sums[..., HARD:COUNT + 1].sum(0) if self.form == "per_head" else sums[..., HARD:COUNT + 1]

    def loss(self, m: int, target_cr: float) -> float:
        """The CR loss of micro-batch m (all layers and heads of the model) at target ``target_cr``."""
        sums = self._global_sums(m)
        if self.form == "paper":
            n = sums[..., COUNT].sum()
            return float((sums[..., KEEP].sum() - n / target_cr).clamp(min=0) / n)
        hinged = self._hinged(m)
        return float((1 - 1 / target_cr - hinged[..., 0] / hinged[..., 1]).clamp(min=0).mean())

    def constraint_loss(self, m: int) -> float:
        """The DMC-C term of micro-batch m, normalised per decision like Eq. 10."""
        sums = self._global_sums(m)
        return float(sums[..., CONSTRAINT].sum() / sums[..., COUNT].sum())

    def alpha_gradient(self, m: int, layer: int, head_offset: int, heads: int, target_cr: float) -> torch.Tensor:
        """``d (l_CR * tokens) / d alpha`` at target ``target_cr`` for the alphas ``[b, heads, n]`` of
        micro-batch m in global layer ``layer`` whose first KV head is global head ``head_offset``;
        broadcastable: ``[1, heads, 1]`` or, per sequence, ``[b, 1, 1]``."""
        sums = self._global_sums(m)
        tokens = self._tokens[m]
        if self.form == "paper":
            n = sums[..., COUNT].sum()
            active = float(sums[..., KEEP].sum() > n / target_cr)
            return torch.full((1, heads, 1), -tokens * active / float(n), dtype=torch.float64, device=sums.device)
        # hinge forms, over groups i: d mean_i max(0, 1 - 1/CR - hard_i / count_i) / d alpha
        # = -1 / (number of groups * count_i) where the hinge of i is active
        hinged = self._hinged(m)
        hard, count = hinged[..., 0], hinged[..., 1]
        coef = -tokens * (hard / count < 1 - 1 / target_cr).double() / (hard.numel() * count)
        if self.form == "released":
            return coef.view(-1, 1, 1)
        if self.form == "per_layer_head":
            coef = coef[layer]
        return coef[head_offset: head_offset + heads].view(1, -1, 1)

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

    def _clear_logits(self) -> None:
        shape, device = self.stats.shape[:2], self.stats.device
        self._logit_sums = torch.zeros(*shape, 2, dtype=torch.float64, device=device)  # (sum, count)
        self._logit_max = torch.full(shape, -torch.inf, dtype=torch.float64, device=device)

    def reduce_logits(self, group=None) -> Optional[tuple[float, float]]:
        """``(mean, max)`` of the decision logits of the training forwards since the last call, over all layers,
        heads and tokens (``group``: default all ranks); None when none were recorded (fixed pooling learns no
        decisions). Resets them."""
        sums, top = self._logit_sums, self._logit_max
        if dist.is_initialized():
            dist.all_reduce(sums, group=group)
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        self._clear_logits()
        total = sums.sum((0, 1))
        return (float(total[0] / total[1]), float(top.max())) if total[1] > 0 else None


class _InjectCRGradient(torch.autograd.Function):
    """Identity in forward; adds the CR loss's gradient to ``alpha [b, h, n]`` in backward."""

    @staticmethod
    def forward(ctx, alpha, tracker, m, layer, head_offset, target_cr):
        ctx.tracker, ctx.m, ctx.layer, ctx.head_offset, ctx.target_cr = tracker, m, layer, head_offset, target_cr
        return alpha.view_as(alpha)

    @staticmethod
    def backward(ctx, grad):
        coef = ctx.tracker.alpha_gradient(ctx.m, ctx.layer, ctx.head_offset, grad.shape[1], ctx.target_cr)
        return grad + coef.to(grad.dtype), None, None, None, None, None
