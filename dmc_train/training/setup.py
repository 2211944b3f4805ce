"""Wrap model chunks in megatron DDP and build the megatron optimizer and LR scheduler from config."""

from __future__ import annotations

from typing import Any

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


def wrap_ddp(cfg: Any, chunks: list) -> list[DistributedDataParallel]:
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=cfg.parallel.distributed_optimizer,
        check_for_nan_in_grad=False,
    )
    wrapped = []
    for i, chunk in enumerate(chunks):
        wrapped.append(DistributedDataParallel(
            config=chunk.config, ddp_config=ddp_config, module=chunk,
            # Only the first chunk uses bucketing (as megatron's own training does with VPP).
            disable_bucketing=i > 0,
        ))
    config = chunks[0].config
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [m.no_sync for m in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
    return wrapped


def build_optimizer(cfg: Any, model: list):
    o, t = cfg.optim, cfg.train
    opt_config = OptimizerConfig(
        optimizer="adam",  # AdamW (decoupled weight decay) in megatron's torch fallback
        lr=o.lr,
        min_lr=o.lr * o.min_lr_ratio,
        weight_decay=o.weight_decay,
        adam_beta1=o.beta1,
        adam_beta2=o.beta2,
        adam_eps=o.eps,
        clip_grad=o.clip_grad,
        bf16=t.precision == "bf16",
        fp16=t.precision == "fp16",
        params_dtype=model[0].module.config.params_dtype,
        use_distributed_optimizer=cfg.parallel.distributed_optimizer,
        initial_loss_scale=2.0 ** 16 if t.precision == "fp16" else None,
    )
    optimizer = get_megatron_optimizer(opt_config, model)
    model[0].module.config.grad_scale_func = optimizer.scale_loss
    return optimizer


class Scheduler(OptimizerParamScheduler):
    """megatron's LR/weight-decay scheduler times a factor a method contributes (``Method.lr_factor``).

    The only writer of the optimizer's learning rate: ``set_factor`` re-applies the schedule.
    """

    def __init__(self, *args, **kwargs):
        self.factor = 1.0
        super().__init__(*args, **kwargs)

    def set_factor(self, factor: float) -> None:
        self.factor = factor
        self.step(increment=0)

    def get_lr(self, param_group: dict) -> float:
        lr = super().get_lr(param_group)
        return lr if self.factor == 1.0 else lr * self.factor


def build_scheduler(cfg: Any, optimizer, total_steps: int) -> Scheduler:
    """LR per optimizer step: linear warm-up, then constant / linear / cosine to ``lr * min_lr_ratio``,
    or ``wsd``: constant, then a cosine to ``lr * min_lr_ratio`` over the last ``anneal_steps`` of the
    decay steps (megatron's warmup-stable-decay).

    Megatron's scheduler counts samples; we step it by 1 per optimizer step so its units are steps.
    On resume only the step count comes from the checkpoint: the config's lr, schedule and warm-up apply
    (``config.yaml`` stays true; ``checkpoint_resume.resolve_resume`` names what changed).
    """
    o = cfg.optim
    warmup = o.warmup_steps
    decay = o.decay_steps or max(total_steps, warmup + 1)
    return Scheduler(
        optimizer,
        init_lr=0.0 if warmup else o.lr,
        max_lr=o.lr,
        min_lr=o.lr * o.min_lr_ratio if o.schedule != "constant" else o.lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=decay,
        lr_decay_style="WSD" if o.schedule == "wsd" else o.schedule,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=decay,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
        wsd_decay_steps=o.anneal_steps if o.schedule == "wsd" else None,
        lr_wsd_decay_style="cosine" if o.schedule == "wsd" else None,
    )
