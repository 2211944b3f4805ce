"""DMC retrofitting as a training method (METHODS.md §1): attention spec, CR loss, three-stage schedule.

Stages, by optimizer step ``s`` (0-based), with Z / R / F = ``dmc.zero_out_steps`` /
``dmc.ramp_steps`` / ``dmc.finetune_steps``:

1. zero-out, ``s < Z``: vanilla attention with the decision channel of q and k scaled by
   ``1 - s / (Z * dmc.zero_out_fraction)`` (Eq. 12, floored at 0); before step Z the matching rows of
   W_q and W_k are zeroed (so alpha starts at sigmoid(-c0) and omega at sigmoid(c0)).
2. retrofit, ``Z <= s < Z + R``: DMC attention; the target CR rises linearly from 1 to
   ``dmc.target_cr`` (reached at the last ramp step).
3. finetune, ``s >= Z + R``: fixed target CR; when F > 0 the learning rate follows a cosine from
   ``optim.lr`` down to ``optim.lr * dmc.finetune_min_lr_ratio`` over F steps.

The schedule is a pure function of the step, so a resumed run continues it exactly.
``method.name=fixed_pooling`` is the paper's non-learned ablation (average every ``target_cr`` tokens).
"""

from __future__ import annotations

import math
import os
from typing import Any, Optional

import torch
from megatron.core import parallel_state as ps
from megatron.core.transformer.spec_utils import ModuleSpec

from dmc_train.errors import ConfigError
from dmc_train.methods.base import Method, register
from dmc_train.methods.cr_loss import FORMS, CRLossTracker
from dmc_train.models.dmc_attention import DMCCoreAttention, DMCSelfAttention, DMCState

CHANNELS = ("last", "first")
ACCUMULATIONS = ("exact", "window")
ATTENTION_IMPLS = ("auto", "fused_cpu", "blocked")
VARIANTS = ("dmc", "c", "hardc")


def validate_dmc(cfg: Any) -> None:
    """One-line ConfigError for DMC settings that cannot work (called before any model is built)."""
    d, m = cfg.dmc, cfg.model
    head_dim = m.hidden_size // m.num_attention_heads
    for key, value, allowed in (("dmc.decision_channel", d.decision_channel, CHANNELS),
                                ("dmc.accumulation", d.accumulation, ACCUMULATIONS),
                                ("dmc.attention_impl", d.attention_impl, ATTENTION_IMPLS),
                                ("dmc.cr_loss", d.cr_loss, FORMS), ("dmc.variant", d.variant, VARIANTS)):
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}")
    if not d.target_cr >= 1:
        raise ConfigError(f"dmc.target_cr={d.target_cr} must be >= 1 (1 = no compression)")
    if d.window < 1:
        raise ConfigError(f"dmc.window={d.window} must be >= 1")
    if d.tau <= 0:
        raise ConfigError(f"dmc.tau={d.tau} must be > 0")
    if min(d.zero_out_steps, d.ramp_steps, d.finetune_steps) < 0:
        raise ConfigError("dmc.zero_out_steps, dmc.ramp_steps and dmc.finetune_steps must be >= 0")
    if not 0 < d.zero_out_fraction <= 1:
        raise ConfigError(f"dmc.zero_out_fraction={d.zero_out_fraction} must be in (0, 1]")
    if head_dim < 2:
        raise ConfigError(f"DMC needs a head dimension >= 2 to free a decision channel; "
                          f"model.hidden_size / model.num_attention_heads = {head_dim}")
    if cfg.train.recompute != "none":
        raise ConfigError(f"train.recompute={cfg.train.recompute!r} is not supported with DMC (its attention "
                          f"is already O(n) in memory); set train.recompute=none")
    if cfg.train.precision == "fp16":
        raise ConfigError("train.precision=fp16 is not supported with DMC (loss scaling of the CR gradient); "
                          "use bf16 or fp32")
    if cfg.method.name == "fixed_pooling" and d.target_cr != int(d.target_cr):
        raise ConfigError(f"fixed_pooling averages every dmc.target_cr tokens: it must be an integer, "
                          f"got {d.target_cr}")


def dmc_stage(d: Any, step: int) -> tuple[str, float]:
    """``(stage, value)`` of optimizer step ``step`` for DMC settings ``d``: the zero-out factor in
    stage ``zero_out``, else the target CR (``retrofit`` ramp, then ``finetune``)."""
    z, r = d.zero_out_steps, d.ramp_steps
    if step < z:
        return "zero_out", max(0.0, 1.0 - step / (z * d.zero_out_fraction))
    if step < z + r:
        return "retrofit", 1.0 + (d.target_cr - 1.0) * (step - z + 1) / r
    return "finetune", d.target_cr


def finetune_lr(cfg: Any, step: int) -> Optional[float]:
    """Learning rate of ``step`` in the finetune stage (cosine from ``optim.lr`` to
    ``optim.lr * dmc.finetune_min_lr_ratio`` over ``dmc.finetune_steps``); None before it."""
    d, o = cfg.dmc, cfg.optim
    t = step - d.zero_out_steps - d.ramp_steps
    if d.finetune_steps <= 0 or t < 0:
        return None
    progress = min(1.0, t / d.finetune_steps)
    low = d.finetune_min_lr_ratio
    return o.lr * (low + (1 - low) * 0.5 * (1 + math.cos(math.pi * progress)))


def achieved_cr(stats: torch.Tensor) -> dict:
    """Achieved compression (decisions / appends) from hard-decision counts ``[layers, heads, 2]``
    (appends, decisions): global, per layer, per (layer, head)."""
    appends, decisions = stats[..., 0], stats[..., 1]
    return {"achieved_cr": float(decisions.sum() / appends.sum()),
            "achieved_cr_per_layer": (decisions.sum(-1) / appends.sum(-1)).tolist(),
            "achieved_cr_per_head": (decisions / appends).tolist()}


@register
class DMCMethod(Method):
    name = "dmc"

    def __init__(self, cfg: Any):
        super().__init__(cfg)  # settings were checked by config.validate (validate_dmc)
        d, m = cfg.dmc, cfg.model
        head_dim = m.hidden_size // m.num_attention_heads
        model_parallel = ps.get_tensor_model_parallel_world_size() * ps.get_pipeline_model_parallel_world_size()
        self.tracker = CRLossTracker(m.num_layers, m.num_query_groups or m.num_attention_heads,
                                     num_chunks=cfg.parallel.virtual_pipeline or 1,
                                     group=ps.get_model_parallel_group() if model_parallel > 1 else None,
                                     form=d.cr_loss)
        self.state = DMCState(
            channel=head_dim - 1 if d.decision_channel == "last" else 0, init_offset=d.init_offset, tau=d.tau,
            accumulation=d.accumulation, window=d.window, attention_impl=d.attention_impl, variant=d.variant,
            noise_seed=cfg.train.seed, dp_rank=ps.get_data_parallel_rank(), tracker=self.tracker)
        self.last_stats = None  # [layers, heads, 2] hard-decision counts of the last step, all ranks

    # -- model ------------------------------------------------------------------------------------
    def layer_spec(self, spec: ModuleSpec) -> ModuleSpec:
        attn = spec.submodules.self_attention
        attn.module = DMCSelfAttention
        attn.params = {**attn.params, "dmc_state": self.state}
        attn.submodules.core_attention = DMCCoreAttention
        return spec

    def attach(self, trainer) -> None:
        self.trainer = trainer
        for i, chunk in enumerate(trainer.model):
            chunk.module.register_forward_pre_hook(lambda *_, i=i: self.tracker.begin_chunk(i))
            chunk.module.register_forward_hook(lambda *_, i=i: self.tracker.end_chunk(i))

    # -- schedule ---------------------------------------------------------------------------------
    def stage(self, step: int) -> tuple[str, float]:
        return dmc_stage(self.cfg.dmc, step)

    def before_step(self, step: int, model_chunks) -> None:
        self.tracker.drain()
        self.tracker.stats.zero_()  # forget decisions counted by an evaluation since the last step
        self.state.step = step
        stage, value = self.stage(step)
        if stage == "zero_out":
            self.state.phase, self.state.zero_out_factor = "zero_out", value
            return
        if step == self.cfg.dmc.zero_out_steps and step > 0:
            self._zero_decision_rows(model_chunks)
        self.state.phase = "dmc"
        self.tracker.target_cr = value
        lr = finetune_lr(self.cfg, step)
        if lr is not None:
            for group in self.trainer.optimizer.param_groups:
                group["lr"] = lr

    @torch.no_grad()
    def _zero_decision_rows(self, model_chunks) -> None:
        """Zero the W_q / W_k rows of the decision channel (end of stage 1), in the model and in the
        optimizer's main (fp32) copy."""
        c = self.state.channel
        for chunk in model_chunks:
            for module in chunk.modules():
                if isinstance(module, DMCSelfAttention):
                    w = module.linear_qkv.weight  # [groups/TP * (G + 2) * d, hidden]
                    d = module.hidden_size_per_attention_head
                    G = module.num_attention_heads_per_partition // module.num_query_groups_per_partition
                    rows = w.view(module.num_query_groups_per_partition, G + 2, d, -1)
                    rows[:, : G + 1, c, :] = 0  # the G query heads and the key head of every group
        self.trainer.optimizer.reload_model_params()

    # -- loss and metrics -------------------------------------------------------------------------
    def loss_terms(self, model_chunk) -> dict[str, torch.Tensor]:
        if self.state.phase != "dmc":  # zero-out stage; fixed pooling learns no decisions
            return {}
        m = self.tracker.active
        terms = {"cr_loss": torch.tensor(self.tracker.loss(m))}
        if self.state.variant == "c":  # reported only: its gradient flows through the layers (AttachLoss)
            terms["cr_c_loss"] = torch.tensor(self.tracker.constraint_loss(m))
        return terms

    def after_step(self, step: int, model_chunks) -> dict:
        self.tracker.drain()
        metrics = {"target_cr": self.tracker.target_cr if self.state.phase != "zero_out" else 1.0}
        stats = self.tracker.reduce_stats()
        if self.state.phase == "zero_out":
            return metrics
        self.last_stats = stats
        summary = achieved_cr(stats)
        return {**metrics, "cr": summary["achieved_cr"], "cr_layers": summary["achieved_cr_per_layer"]}

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
            from dmc_train.evaluation.plots import cr_heatmap

            cr_heatmap(meta["achieved_cr_per_head"], os.path.join(ckpt_dir, "cr_heatmap.png"),
                       title=f"achieved CR per head (step {self.state.step + 1}, target {meta['target_cr']:.2f})")


@register
class FixedPoolingMethod(DMCMethod):
    """Fixed Memory Pooling (the DMC paper's ablation): average every ``dmc.target_cr`` tokens; no
    decisions are learned, so there is no schedule and no CR loss."""

    name = "fixed_pooling"

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        self.state.phase, self.state.pool = "fixed", int(cfg.dmc.target_cr)
        self.tracker.target_cr = cfg.dmc.target_cr

    def before_step(self, step: int, model_chunks) -> None:
        self.tracker.drain()
        self.tracker.stats.zero_()
        self.state.step = step
