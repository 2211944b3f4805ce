"""LESS distillation (Dong et al., 2024) on the megatron trainer: the base model is frozen, and in every
attention layer small per-head kernels learn the part of the attention an eviction policy loses.

- ``attention()``: the LESS variant of the layer spec (``dmc_train/models/less``): the layer returns the
  full model's attention (so the next layer gets the full hidden state) and computes its own loss,
  the MSE between full and LESS attention after the output projection on positions past the budget.
- ``prepare_model``: freezes every base parameter (only the kernels train) and chains the layers' losses
  into the backward (:func:`~dmc_train.models.layer_loss.attach_layer_losses`): each layer's kernels
  learn from their own layer, as in the paper, but all layers in one run. megatron's DDP and optimizer
  fix the trainable parameters when they are built, so "layer by layer" is all layers at once,
  independent by construction, not unfreezing layers during a run.
- ``lm_loss_weight = 0``: the LM loss of the frozen model is reported, not optimised.
- metrics: the per-layer MSE (``less_mse`` = mean over layers, ``less_mse_layers``), on training steps and
  on validation (``val_less_mse``); a bar plot per layer is written into each checkpoint.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from dmc_train.config import kv_groups
from dmc_train.errors import ConfigError
from dmc_train.methods.base import Method
from dmc_train.methods.configs import less_settings
from dmc_train.models.layer_loss import attach_layer_losses
from dmc_train.models.less import LESSSelfAttention, LESSState, less_self_attention_spec
from dmc_train.policies import build_scorer
from dmc_train.policies.parallel import run_policy


def less_scorer(cfg: Any):
    """The method's eviction policy (scorer) and its budget in entries, from ``cfg.method`` and ``cfg.model``."""
    m, model = cfg.method, cfg.model
    head_dim = model.hidden_size // model.num_attention_heads
    options = {"budget": m.budget, **dict(m.policy_options)}
    scorer = build_scorer(m.policy, options, head_dim, model.num_attention_heads // kv_groups(model),
                          head_dim ** -0.5)
    budget = scorer.budget(cfg.train.seq_length)  # a fraction: of the sequence the parallel form sees
    if scorer.cfg.aggregate == "layer" and cfg.parallel.tensor > 1:
        raise ConfigError(f"method.policy={m.policy} averages its scores over the KV heads of a layer, which "
                          f"tensor parallelism splits; add +method.policy_options.aggregate=kv_head")
    return scorer, budget


def _evictions(scorer, budget: int, q, k, v, layer: int) -> torch.Tensor:
    return run_policy(scorer, q, k, v, budget, layer).evicted_at


class LESSMethod(Method):
    lm_loss_weight = 0.0
    frozen_base = True  # checkpoints hold the kernels and a reference to the base
    best_metric = "val_less_mse"  # the mean per-layer validation MSE (the paper keeps the best validation loss)

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        m = cfg.method
        scorer, budget = less_scorer(cfg)
        if budget >= cfg.train.seq_length:
            raise ConfigError(f"method.budget={m.budget} keeps {budget} entries, not fewer than train.seq_length="
                              f"{cfg.train.seq_length}: nothing is evicted, LESS has nothing to learn")
        self.budget = budget
        self.state = LESSState(functools.partial(_evictions, scorer, budget), budget, less_settings(m),
                               cfg.model.num_layers, cfg.train.seed)
        self.last_mse: list[float] = []

    def attention(self):
        return less_self_attention_spec(self.state)

    def added_parameter(self, name: str) -> bool:
        return ".less." in name

    def prepare_model(self, chunks):
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                p.requires_grad_(".less." in name)
        layers = [mod for chunk in chunks for mod in chunk.modules()
                  if isinstance(getattr(mod, "self_attention", None), LESSSelfAttention)]
        attach_layer_losses(layers, _take_loss, lambda out: float(out.shape[0] * out.shape[1]))
        return chunks

    def before_step(self, step: int, model_chunks) -> None:
        self.state.take()  # forget what an evaluation pass recorded

    def _mse(self) -> list[float]:
        """Per-layer MSE of the passes since the last call, over every rank (layers live on PP stages; DP
        ranks saw different data)."""
        sums = self.state.take()
        if dist.is_initialized():
            if ps.get_tensor_model_parallel_rank() != 0:
                sums.zero_()  # every TP rank computed the same values
            dist.all_reduce(sums)
        return (sums[:, 0] / sums[:, 1].clamp(min=1)).tolist()

    def after_step(self, step: int, model_chunks) -> dict:
        self.last_mse = self._mse()
        return {"less_mse": sum(self.last_mse) / len(self.last_mse), "less_mse_layers": self.last_mse}

    def evaluation_metrics(self) -> dict:
        self.last_val_mse = self._mse()
        return {"less_mse": sum(self.last_val_mse) / len(self.last_val_mse), "less_mse_layers": self.last_val_mse}

    def checkpoint_metadata(self, model_chunks) -> dict:
        m = self.cfg.method
        meta = {"policy": m.policy, "budget": self.budget, "policy_options": dict(m.policy_options)}
        if getattr(self, "last_val_mse", None):
            meta["val_less_mse_layers"] = self.last_val_mse
        return meta

    def write_artifacts(self, ckpt_dir: str, meta: dict) -> None:
        """The per-layer validation MSE of the last evaluation, as a bar plot."""
        values = meta.get("method_metadata", {}).get("val_less_mse_layers")
        if not values:
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(max(4, 0.5 * len(values) + 2), 3))
        ax.bar(range(len(values)), values)
        ax.set_xlabel("layer")
        ax.set_ylabel("validation MSE (after o_proj)")
        ax.set_title(f"LESS on {self.cfg.method.policy}, budget {self.budget}", fontsize=9)
        fig.tight_layout()
        fig.savefig(os.path.join(ckpt_dir, "less_mse.png"), dpi=110)
        plt.close(fig)


def _take_loss(layer):
    attention = layer.self_attention
    loss, attention.pending_loss = attention.pending_loss, None
    return loss
