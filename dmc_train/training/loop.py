"""The training loop: megatron schedules (no PP / 1F1B / interleaved), DDP, optimizer, checkpoints.

One step = one optimizer update over ``train.global_batch_size`` samples, split into micro-batches
per data-parallel rank. The LM loss is a per-token mean over the whole global batch (megatron's
``calculate_per_token_loss``); a method's extra loss terms are added per token.
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from omegaconf import OmegaConf

from dmc_train import config as config_mod
from dmc_train import distributed
from dmc_train.data.datasets import build_datasets
from dmc_train.errors import TrainingDiverged
from dmc_train.methods import build_method
from dmc_train.methods.base import Method
from dmc_train.models.llama import build_model
from dmc_train.models.shape import count_parameters
from dmc_train.recipes import validate
from dmc_train.training import base_reference, hf_loading, run_lock
from dmc_train.training.best_checkpoint import validation_record
from dmc_train.training.checkpoint_dirs import (
    check_model_shape,
    checkpoint_root,
    find_checkpoint,
    newest_complete,
    read_meta,
)
from dmc_train.training.checkpoint_load import load_checkpoint, load_weights
from dmc_train.training.checkpoint_resume import resolve_resume
from dmc_train.training.checkpoint_save import save_checkpoint
from dmc_train.training.forward import batch_losses, evaluate_loss, lm_forward_step, reduce_losses
from dmc_train.training.logging import RunLogger
from dmc_train.training.preemption import PreemptionHandler
from dmc_train.training.setup import build_optimizer, build_scheduler, wrap_ddp


def total_steps(cfg: Any) -> int:
    steps = cfg.train.max_steps
    if cfg.train.max_tokens:
        tokens_per_step = cfg.train.global_batch_size * cfg.train.seq_length
        steps = min(steps, math.ceil(cfg.train.max_tokens / tokens_per_step))
    return steps


class StoppedDuringStartup(Exception):
    """A stop signal was agreed before the first step of this start (raised by :class:`Trainer`)."""


class Trainer:
    """Holds the model chunks, optimizer, scheduler and data position of one run."""

    def __init__(self, cfg: Any, method: Optional[Method] = None, lock_run_dir: bool = False,
                 preemption: Optional[PreemptionHandler] = None):
        """``lock_run_dir``: rank 0 takes ``run_dir``'s lock (:mod:`run_lock`) before anything reads or
        writes checkpoints; the caller releases it (``run_lock.release``). ``preemption``: asked (on every
        rank) once the process group is up, before any checkpoint is read or the model is built; a stop
        raises :class:`StoppedDuringStartup`."""
        validate(cfg, distributed.read_launch_env().world_size)
        self.env = distributed.initialize(cfg.parallel.tensor, cfg.parallel.pipeline, cfg.parallel.virtual_pipeline,
                                          cfg.train.seed, cfg.parallel.timeout_minutes)
        distributed.check_precision(cfg.train.precision)
        cfg.run_dir = distributed.broadcast_object(cfg.run_dir)  # e.g. a ${now:...} run dir: rank 0's wins
        if lock_run_dir:
            run_lock.hold(cfg.run_dir)
        self.preemption = preemption
        if preemption is not None and preemption.should_stop():  # a collective: every rank asks here
            raise StoppedDuringStartup()
        self.cfg = cfg
        self.method = method or build_method(cfg)
        # before building: mismatches fail fast
        self.resume = resolve_resume(cfg, log=lambda m: distributed.is_rank0() and print(m, flush=True))
        if self.resume is None and cfg.checkpoint.init_from and hf_loading.is_hf_dir(cfg.checkpoint.init_from):
            hf_loading.check_hf_model_shape(cfg.checkpoint.init_from, cfg)
        elif self.resume is None and cfg.checkpoint.init_from:
            init = find_checkpoint(cfg.checkpoint.init_from)
            check_model_shape(init, read_meta(init), cfg)
        self.base = base_reference.for_run(cfg, self.method, self.resume)  # a frozen-base method's base, checked
        self.validated: Optional[tuple[int, dict]] = None  # (step, validation metrics) of the last evaluation
        self.total_steps = total_steps(cfg)
        if cfg.optim.warmup_steps >= self.total_steps and distributed.is_rank0():
            print(f"warning: optim.warmup_steps={cfg.optim.warmup_steps} is not below the run's {self.total_steps} "
                  f"steps, so the learning rate never reaches optim.lr={cfg.optim.lr}; lower optim.warmup_steps",
                  file=sys.stderr, flush=True)
        # Data before the model: a missing prefix or a too-large vocabulary fails fast.
        self.train_data, self.valid_data, self.test_data = build_datasets(
            cfg, self.total_steps * cfg.train.global_batch_size)
        chunks = self.method.prepare_model(build_model(cfg, attention=self.method.attention()))
        if self.method.frozen_base:
            _check_frozen(chunks, self.method)
        self.model = wrap_ddp(cfg, chunks)
        self.optimizer = build_optimizer(cfg, self.model)
        self.scheduler = build_scheduler(cfg, self.optimizer, self.total_steps)
        self.step, self.consumed = 0, 0
        self.dp_size = ps.get_data_parallel_world_size()
        self.num_micro = config_mod.num_microbatches(cfg, self.dp_size)
        if self.resume is not None:
            self.step, self.consumed = load_checkpoint(cfg, *self.resume, self.model, self.optimizer,
                                                       self.scheduler, self.method)
        elif cfg.checkpoint.init_from:
            if hf_loading.is_hf_dir(cfg.checkpoint.init_from):  # a Hugging Face Llama directory
                hf_loading.load_hf_into_model(cfg.checkpoint.init_from, [m.module for m in self.model], cfg,
                                              skip=self.method.added_parameter)
            else:
                load_weights(cfg.checkpoint.init_from, [m.module for m in self.model], cfg,
                             added=self.method.added_parameter)
            self.optimizer.reload_model_params()
        self.method.attach(self)

    def train_step(self) -> dict:
        """One optimizer step; returns metrics (identical on every rank).

        A step whose loss or gradients are not finite (on any rank) is skipped: no optimizer or LR
        update, the batch counts as consumed, ``metrics["skipped"] = 1``.
        """
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.method.before_step(self.step, self.model)
        self.scheduler.set_factor(self.method.lr_factor(self.step))
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step uses
        t = self.cfg.train
        forward_step = lm_forward_step(self.method.lm_loss_weight, self.method.loss_terms)
        losses = batch_losses(self.model, self.train_data, self.consumed, t.global_batch_size, t.micro_batch_size,
                              t.seq_length, forward_step, forward_only=False)
        metrics = reduce_losses(losses)
        if self._all_finite(metrics["lm_loss"]):
            ok, grad_norm, _ = self.optimizer.step()
            if ok:
                self.scheduler.step(increment=1)
        else:
            ok, grad_norm = False, float("nan")
        self.step += 1
        self.consumed += self.cfg.train.global_batch_size
        metrics.update(self.method.after_step(self.step, self.model))
        metrics["lr"] = lr
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        if not ok:
            metrics["skipped"] = 1
        return metrics

    def _all_finite(self, loss: float) -> bool:
        """Loss and every local gradient finite, agreed over all ranks (a NaN may hit one stage only)."""
        flag = torch.tensor([1.0 if math.isfinite(loss) else 0.0], device=distributed.device())
        grads = [p.main_grad for chunk in self.model for p in chunk.parameters()
                 if getattr(p, "main_grad", None) is not None]
        if grads and flag.item():  # one check on the device (no host round trip per parameter)
            flag *= torch.stack([torch.isfinite(g).all() for g in grads]).all()
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def evaluate(self, dataset=None, batches: Optional[int] = None) -> dict[str, float]:
        """Mean LM loss over ``batches`` global batches of ``dataset`` (default: validation data,
        ``train.eval_iters`` batches; ``batches=-1``: every full global batch of the dataset)."""
        t = self.cfg.train
        return evaluate_loss(self.model, self.valid_data if dataset is None else dataset, batches or t.eval_iters,
                             t.global_batch_size, t.micro_batch_size, t.seq_length)

    def save(self) -> str:
        extra = {"method_metadata": self.method.checkpoint_metadata(self.model)}
        validation = validation_record(self.method.best_metric, self.step, self.validated)
        if validation is not None:
            extra["validation"] = validation
        return save_checkpoint(self.cfg, self.model, self.optimizer, self.scheduler, self.method,
                               self.step, self.consumed, extra, base=self.base)


def _check_frozen(chunks, method: Method) -> None:
    """A frozen-base method trains only the parameters it adds (its checkpoints hold nothing else)."""
    trained = [n for c in chunks for n, p in c.named_parameters() if p.requires_grad and not method.added_parameter(n)]
    if trained:
        raise RuntimeError(f"{type(method).__name__} sets frozen_base but trains base parameters {trained[:3]}")


def diverged_message(cfg: Any, step: int, bad_in_row: int) -> str:
    """The one line for a streak of non-finite steps. The weights at this point produced those losses (an
    update before the streak can have blown them up), so they are not saved; the message names the
    newest checkpoint (no save happens during a streak, so it was saved at a step with a finite loss)."""
    newest = newest_complete(checkpoint_root(cfg))
    saved = (f"the newest checkpoint is {newest}, saved before the streak (checkpoint.resume=auto continues "
             f"from it)" if newest else "no checkpoint was saved before the streak")
    return (f"training stopped at step {step}: {bad_in_row} consecutive steps with a non-finite loss or gradient; "
            f"the current weights produced them and are not saved; {saved}; lower optim.lr, check the data, "
            f"or raise train.max_nonfinite_steps")


def startup_seconds() -> float:
    """Seconds since this process started (imports, process group, model, optimizer, checkpoint load)."""
    import psutil

    return time.time() - psutil.Process().create_time()


def train(cfg: Any, method: Optional[Method] = None) -> dict:
    """Train until the step/token budget; returns a summary (final losses, steps, checkpoint).

    The run directory's lock is held from before the first checkpoint is read until the end, normal
    or not. The stop signals (:class:`PreemptionHandler`: SIGUSR1/SIGUSR2/SIGTERM) are caught from the
    start (and from the first line of the entry point with :func:`preemption.catch_early`): one that
    arrives before the first step stops the run before it (asked once the process group is up and again
    once the model is built): nothing new to save, so no checkpoint is written, and SIGUSR1/SIGUSR2
    requeue the job. The summary then has ``stopped_at_startup`` set."""
    preemption = PreemptionHandler().install()
    try:
        try:
            return _train(cfg, method, preemption)
        except StoppedDuringStartup:
            return _stopped_at_startup(cfg, preemption)
    finally:
        preemption.uninstall()
        run_lock.release(cfg.run_dir)


def _stopped_at_startup(cfg: Any, preemption: PreemptionHandler) -> dict:
    """Requeue (rank 0, after a requeue signal) and report a stop before the first step; nothing is written."""
    requeued = preemption.requeue()
    newest = newest_complete(checkpoint_root(cfg))
    if distributed.is_rank0():
        print(f"stopped by {preemption.agreed.name if preemption.agreed else 'a signal'} during start-up, before the "
              f"first step: nothing new to save ("
              + (f"newest checkpoint {newest}" if newest else "no checkpoint yet") + "); "
              + ("job requeued" if requeued else "not requeued (" + str(preemption.requeue_error) + ")"), flush=True)
    return {"steps": None, "history": [], "checkpoint": newest, "trainer": None, "preempted": True,
            "stopped_at_startup": True}


def _train(cfg: Any, method: Optional[Method], preemption: PreemptionHandler) -> dict:
    trainer = Trainer(cfg, method, lock_run_dir=True, preemption=preemption)
    if preemption.should_stop():  # a collective: a signal while the model was built or the checkpoint loaded
        raise StoppedDuringStartup()
    tokens_per_step = cfg.train.global_batch_size * cfg.train.seq_length
    log = RunLogger(cfg.run_dir, trainer.total_steps, tokens_per_step, cfg, cfg.logging.progress, trainer.step)
    if distributed.is_rank0():
        OmegaConf.save(cfg, os.path.join(cfg.run_dir, "config.yaml"), resolve=True)
    log.info(f"model {cfg.model.name}: {count_parameters(cfg.model) / 1e6:.2f}M parameters; layout "
             f"TP={cfg.parallel.tensor} PP={cfg.parallel.pipeline} DP={trainer.dp_size}"
             f"{' VPP=' + str(cfg.parallel.virtual_pipeline) if cfg.parallel.virtual_pipeline else ''}; "
             f"{trainer.num_micro} micro-batches/step; start-up {startup_seconds():.1f}s"
             + (f"; resumed from {trainer.resume[0]} at step {trainer.step}" if trainer.resume else ""))
    history, last_ckpt, not_training = [], None, 0.0
    save_every = cfg.checkpoint.save_interval
    stop_at = trainer.total_steps
    if cfg.train.max_steps_per_job is not None:
        stop_at = min(stop_at, trainer.step + cfg.train.max_steps_per_job)
    bad_in_row, preempted, save_due = 0, False, False

    def save() -> Optional[str]:
        """Save, unless the current weights produced a non-finite loss (then the newest checkpoint stays)."""
        if bad_in_row:
            log.info(f"step {trainer.step}: no checkpoint: the current weights produced a non-finite loss or gradient")
            return last_ckpt
        return trainer.save()

    try:
        while trainer.step < stop_at:
            metrics = trainer.train_step()
            bad_in_row = bad_in_row + 1 if metrics.get("skipped") else 0
            if bad_in_row:
                log.info(f"step {trainer.step}: non-finite loss or gradient, update skipped "
                         f"({bad_in_row} in a row, limit {cfg.train.max_nonfinite_steps})")
            if bad_in_row >= cfg.train.max_nonfinite_steps:
                raise TrainingDiverged(diverged_message(cfg, trainer.step, bad_in_row))
            if cfg.train.eval_interval and trainer.step % cfg.train.eval_interval == 0:
                t_eval = time.perf_counter()
                metrics["val_loss"] = trainer.evaluate()["lm_loss"]
                metrics.update({f"val_{k}": v for k, v in trainer.method.evaluation_metrics().items()
                                if isinstance(v, (int, float))})
                trainer.validated = (trainer.step, {k: v for k, v in metrics.items() if k.startswith("val_")})
                not_training += time.perf_counter() - t_eval
            history.append(metrics)
            if trainer.step % cfg.train.log_interval == 0 or trainer.step == stop_at:
                log.log(trainer.step, metrics, exclude_seconds=not_training)
                not_training = 0.0
            if preemption.should_stop():  # a collective: every rank asks after every step
                preempted = True
                break
            save_due = save_due or bool(save_every and trainer.step % save_every == 0)
            if save_due and not bad_in_row:  # a save due during a non-finite streak waits for a finite step
                t_save = time.perf_counter()
                last_ckpt, save_due = trainer.save(), False
                not_training += time.perf_counter() - t_save
        if preempted or (cfg.checkpoint.save_at_end and history
                         and (save_due or not save_every or trainer.step % save_every)):
            last_ckpt = save()
        if preempted:
            requeued = preemption.requeue()
            log.info(f"stopped by {preemption.agreed.name if preemption.agreed else 'a signal'} after step "
                     f"{trainer.step}; checkpoint {last_ckpt}; "
                     + ("job requeued" if requeued else "not requeued (" + str(preemption.requeue_error) + ")"))
    finally:
        preemption.uninstall()
    log.close()
    return {"steps": trainer.step, "history": history, "checkpoint": last_ckpt, "trainer": trainer,
            "preempted": preempted}
