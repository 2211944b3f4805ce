"""DMC retrofitting as a training method (docs/METHODS.md#dmc): attention, CR loss, three-stage schedule.

Stages, by optimizer step ``s`` (0-based), with Z / R / F = ``method.zero_out_steps`` /
``method.ramp_steps`` / ``method.finetune_steps``:

1. zero-out, ``s < Z``: vanilla attention with the decision channel of q and k scaled by
   ``1 - s / (Z * method.zero_out_fraction)`` (Eq. 12, floored at 0); before step Z the matching rows of
   W_q and W_k are zeroed (so alpha starts at sigmoid(-c0) and omega at sigmoid(c0)).
2. retrofit, ``Z <= s < Z + R``: DMC attention; the target CR rises linearly from 1 to
   ``method.target_cr`` (reached at the last ramp step).
3. finetune, ``s >= Z + R``: fixed target CR; when F > 0 the learning rate follows a cosine from
   ``optim.lr`` down to ``optim.lr * method.finetune_min_lr_ratio`` over F steps (a factor on the
   scheduler's LR, which the DMC recipes keep constant).

The schedule is a pure function of the step, so a resumed run continues it exactly.
``method=fixed_pooling`` is the paper's non-learned ablation (average every ``method.pool`` tokens).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from megatron.core import parallel_state as ps

from dmc_train import distributed
from dmc_train.config import kv_groups
from dmc_train.methods.base import Method
from dmc_train.methods.configs import dmc_settings
from dmc_train.models.dmc import CRLossTracker, DMCState, dmc_self_attention_spec, track_chunks, zero_decision_rows


def dmc_stage(d: Any, step: int) -> tuple[str, float]:
    """``(stage, value)`` of optimizer step ``step`` for DMC settings ``d``: the zero-out factor in
    stage ``zero_out``, else the target CR (``retrofit`` ramp, then ``finetune``)."""
    z, r = d.zero_out_steps, d.ramp_steps
    if step < z:
        return "zero_out", max(0.0, 1.0 - step / (z * d.zero_out_fraction))
    if step < z + r:
        return "retrofit", 1.0 + (d.target_cr - 1.0) * (step - z + 1) / r
    return "finetune", d.target_cr


def finetune_lr_factor(d: Any, step: int) -> float:
    """Learning-rate factor of ``step`` for DMC settings ``d``: 1 before the finetune stage, then a
    cosine from 1 down to ``d.finetune_min_lr_ratio`` over ``d.finetune_steps``."""
    t = step - d.zero_out_steps - d.ramp_steps
    if d.finetune_steps <= 0 or t < 0:
        return 1.0
    progress = min(1.0, t / d.finetune_steps)
    low = d.finetune_min_lr_ratio
    return low + (1 - low) * 0.5 * (1 + math.cos(math.pi * progress))


def achieved_cr(stats: torch.Tensor) -> dict:
    """Achieved compression (decisions / appends) from hard-decision counts ``[layers, heads, 2]``
    (appends, decisions): global, per layer, per (layer, head)."""
    appends, decisions = stats[..., 0], stats[..., 1]
    return {"achieved_cr": float(decisions.sum() / appends.sum()),
            "achieved_cr_per_layer": (decisions.sum(-1) / appends.sum(-1)).tolist(),
            "achieved_cr_per_head": (decisions / appends).tolist()}


class DMCMethod(Method):
    """DMC retrofitting: DMC attention in every layer, the CR loss, the three-stage schedule."""

    def __init__(self, cfg: Any):
        super().__init__(cfg)  # settings were checked by DMCConfig.check
        d, m = cfg.method, cfg.model
        head_dim = m.hidden_size // m.num_attention_heads
        model_parallel = ps.get_tensor_model_parallel_world_size() * ps.get_pipeline_model_parallel_world_size()
        self.tracker = CRLossTracker(m.num_layers, kv_groups(m), num_chunks=cfg.parallel.virtual_pipeline or 1,
                                     group=ps.get_model_parallel_group() if model_parallel > 1 else None,
                                     form=d.cr_loss)
        # no step: the trainer runs the zero-out stage too (dmc_settings refuses it for inference)
        self.state = DMCState(dmc_settings(d, head_dim), noise_seed=cfg.train.seed,
                              dp_rank=ps.get_data_parallel_rank(), tracker=self.tracker)
        self.last_stats = None  # [layers, heads, 2] hard-decision counts of the last step, all ranks

    # -- model ------------------------------------------------------------------------------------
    def attention(self):
        return dmc_self_attention_spec(self.state)

    def prepare_model(self, chunks):
        track_chunks(chunks, self.tracker)
        return chunks

    def attach(self, trainer) -> None:
        self.optimizer = trainer.optimizer

    # -- schedule ---------------------------------------------------------------------------------
    def stage(self, step: int) -> tuple[str, float]:
        return dmc_stage(self.cfg.method, step)

    def lr_factor(self, step: int) -> float:
        return finetune_lr_factor(self.cfg.method, step)

    def before_step(self, step: int, model_chunks) -> None:
        self.tracker.drain()
        self.tracker.stats.zero_()  # forget decisions counted by an evaluation since the last step
        self.state.step = step
        stage, value = self.stage(step)
        if stage == "zero_out":
            self.state.phase, self.state.zero_out_factor = "zero_out", value
            return
        if step == self.cfg.method.zero_out_steps and step > 0:
            zero_decision_rows([chunk.module for chunk in model_chunks], self.state.settings.channel)
            self.optimizer.reload_model_params()  # the optimizer's fp32 main copy too
        self.state.phase, self.state.target_cr = "dmc", value

    # -- loss and metrics -------------------------------------------------------------------------
    def loss_terms(self, model_chunk) -> dict[str, torch.Tensor]:
        if self.state.phase != "dmc":  # zero-out stage; fixed pooling learns no decisions
            return {}
        m = self.tracker.active
        device = distributed.device()
        terms = {"cr_loss": torch.tensor(self.tracker.loss(m, self.state.target_cr), device=device)}
        if self.state.settings.variant == "c":  # reported only: its gradient flows through the layers (AttachLoss)
            terms["cr_c_loss"] = torch.tensor(self.tracker.constraint_loss(m), device=device)
        return terms

    def after_step(self, step: int, model_chunks) -> dict:
        self.tracker.drain()
        metrics = {"target_cr": self.state.target_cr if self.state.phase != "zero_out" else 1.0}
        stats = self.tracker.reduce_stats()
        if self.state.phase == "zero_out":
            return metrics
        self.last_stats = stats
        summary = achieved_cr(stats)
        metrics.update(cr=summary["achieved_cr"], cr_layers=summary["achieved_cr_per_layer"])
        logits = self.tracker.reduce_logits()
        if logits is not None:  # how far the decisions are from merging (cr_loss.py)
            metrics.update(alpha_logit_mean=logits[0], alpha_logit_max=logits[1])
        return metrics

    def evaluation_metrics(self) -> dict:
        """Achieved CR of the evaluation pass just run (hard decisions, as at inference)."""
        self.tracker.drain()
        return achieved_cr(self.tracker.reduce_stats())

    def checkpoint_metadata(self, model_chunks) -> dict:
        stage, value = self.stage(self.state.step)
        meta = {"stage": stage, "target_cr": value if stage != "zero_out" else 1.0}
        if self.last_stats is not None:
            meta.update(achieved_cr(self.last_stats))
        return meta

    def write_artifacts(self, ckpt_dir: str, meta: dict) -> None:
        """The per-layer x head CR heatmap of the last step (as the paper's Fig. 6)."""
        meta = meta.get("method_metadata", {})
        if "achieved_cr_per_head" in meta:
            from dmc_train.plotting import cr_heatmap

            cr_heatmap(meta["achieved_cr_per_head"], os.path.join(ckpt_dir, "cr_heatmap.png"),
                       title=f"achieved CR per head (step {self.state.step + 1}, target {meta['target_cr']:.2f})")


class FixedPoolingMethod(DMCMethod):
    """Fixed Memory Pooling (the DMC paper's ablation): average every ``method.pool`` tokens; no
    decisions are learned, so there is no schedule and no CR loss. Its target CR (metrics and checkpoint
    metadata) is the pool size."""

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        self.state.phase = "fixed"  # every settings.pool tokens share a slot
        self.state.target_cr = float(cfg.method.pool)

    def stage(self, step: int) -> tuple[str, float]:
        return "fixed", self.state.target_cr

    def lr_factor(self, step: int) -> float:
        return 1.0

    def before_step(self, step: int, model_chunks) -> None:
        self.tracker.drain()
        self.tracker.stats.zero_()
        self.state.step = step
