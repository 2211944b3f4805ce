"""Forward passes of built model chunks under megatron's pipeline schedules: the per-token LM loss
of one global batch (train or eval), and full-vocabulary logits.

Used by the training loop and by model-only consumers (evaluation, conversion checks). ``model`` is
this rank's list of chunks (megatron DDP-wrapped or plain ``GPTModel``; one per virtual stage).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func

from dmc_train import distributed
from dmc_train.training.batches import chunk_iterators, step_microbatches

# Extra loss terms of a micro-batch, computed on the last stage after its forward (Method.loss_terms).
LossTerms = Callable[[torch.nn.Module], dict[str, torch.Tensor]]


def lm_loss(loss_mask: torch.Tensor, model, per_token_loss: torch.Tensor, lm_weight: float = 1.0,
            loss_terms: Optional[LossTerms] = None):
    """``per_token_loss [b, s]`` -> (loss sum, token count, metrics), megatron's per-token convention.

    The optimised sum is ``lm_weight * LM sum + sum_terms term * tokens``; metrics hold
    ``(value * tokens, tokens)`` pairs for the LM loss and each term (``reduce_losses`` averages them).
    """
    mask = loss_mask.float()
    lm_sum = (per_token_loss.float() * mask).sum()
    num_tokens = mask.sum()
    total = lm_sum * lm_weight
    metrics = {"lm_loss": torch.stack([lm_sum.detach(), num_tokens])}
    for name, term in (loss_terms(model) if loss_terms is not None else {}).items():
        total = total + term * num_tokens
        metrics[name] = torch.stack([term.detach() * num_tokens, num_tokens])
    return total, num_tokens.int(), metrics


def run_schedule(model: list, microbatches: list[dict], forward_step, seq_length: int, micro_batch_size: int,
                 forward_only: bool, **kwargs) -> list:
    """One pass of megatron's schedule (no PP / 1F1B / interleaved, picked by the parallel state)."""
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=chunk_iterators(microbatches, len(model)),
        model=model if len(model) > 1 else model[0],
        num_microbatches=len(microbatches),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
        **kwargs,
    )


def lm_forward_step(lm_weight: float = 1.0, loss_terms: Optional[LossTerms] = None):
    """A megatron ``forward_step_func`` computing :func:`lm_loss` on dict batches."""

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

        def loss(per_token_loss):
            return lm_loss(batch["loss_mask"], model, per_token_loss, lm_weight, loss_terms)

        return output, loss

    return forward_step


def batch_losses(model: list, dataset, consumed: int, global_batch: int, micro_batch: int, seq_length: int,
                 forward_step, forward_only: bool) -> list[dict]:
    """Run global batch ``[consumed, consumed + global_batch)`` of ``dataset`` (this rank's share)."""
    micro = step_microbatches(dataset, consumed, global_batch, micro_batch,
                              ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), distributed.device())
    return run_schedule(model, micro, forward_step, seq_length, micro_batch, forward_only)


@torch.no_grad()
def evaluate_loss(model: list, dataset, batches: int, global_batch: int, micro_batch: int, seq_length: int,
                  forward_step=None) -> dict[str, float]:
    """Mean per-token losses over the first ``batches`` global batches of ``dataset`` (-1: every full
    global batch), in eval mode; the chunks' train/eval mode is restored afterwards."""
    if batches == -1:
        batches = len(dataset) // global_batch
    was_training = [chunk.training for chunk in model]
    for chunk in model:
        chunk.eval()
    per_micro = []
    for i in range(batches):
        per_micro += batch_losses(model, dataset, i * global_batch, global_batch, micro_batch, seq_length,
                                  forward_step or lm_forward_step(), forward_only=True)
    for chunk, training in zip(model, was_training):
        chunk.train(training)
    return reduce_losses(per_micro)


@torch.no_grad()
def logits(model: list, tokens: torch.Tensor) -> Optional[torch.Tensor]:
    """Full-vocabulary logits ``[b, s, vocab]`` for ``tokens [b, s]`` (eval mode, any layout).

    Returned on the last pipeline stage (None elsewhere), gathered across tensor-parallel ranks, on the model's
    device (:func:`dmc_train.distributed.device`; ``tokens`` may be on any device).
    """
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    was_training = [chunk.training for chunk in model]
    for chunk in model:
        chunk.eval()
    tokens = tokens.to(distributed.device())
    batch = {"tokens": tokens, "position_ids": torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)}

    def forward_step(data_iterator, chunk):
        b = next(data_iterator)
        out = chunk(b["tokens"], b["position_ids"], None)
        return out, lambda o, non_loss_data=True: gather_from_tensor_model_parallel_region(o)

    out = run_schedule(model, [batch], forward_step, tokens.shape[1], tokens.shape[0], forward_only=True,
                       collect_non_loss_data=True)
    for chunk, training in zip(model, was_training):
        chunk.train(training)
    return out[0] if out else None


def reduce_losses(per_micro: list[dict]) -> dict[str, float]:
    """Sum (value_sum, tokens) over micro-batches and DP ranks on the last stage; share with all ranks."""
    names = sorted(per_micro[0]) if per_micro else []
    if dist.is_initialized():
        names = _names_from_last_stage(names)
    sums = torch.zeros(2 * len(names), dtype=torch.float64, device=distributed.device())
    for m in per_micro:
        for i, n in enumerate(names):
            sums[2 * i: 2 * i + 2] += m[n].double()
    if dist.is_initialized():
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            dist.all_reduce(sums, group=ps.get_data_parallel_group())
        dist.broadcast(sums, src=ps.get_pipeline_model_parallel_last_rank(),
                       group=ps.get_pipeline_model_parallel_group())
    return {n: (sums[2 * i] / sums[2 * i + 1]).item() for i, n in enumerate(names)}


def _names_from_last_stage(names: list[str]) -> list[str]:
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return names
    box = [names]
    dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                               group=ps.get_pipeline_model_parallel_group())
    return box[0]
