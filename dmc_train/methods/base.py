"""The method interface: how DMC, GQA up-training, LESS ... extend training without editing the loop.

The trainer calls a method at these points (in order):

1. ``attention()`` - before the model is built: the ``self_attention`` spec of the method's
   attention variant (from :mod:`dmc_train.models`), or None for the stock Llama attention.
2. ``prepare_model(chunks)`` - after the model is built (and before megatron DDP and the optimizer,
   which only see parameters that require grad): freeze weights, add trainable modules.
3. ``attach(trainer)`` - once model, optimizer and scheduler exist and a checkpoint is loaded.
4. every step: ``before_step``; forward/backward with the loss ``lm_loss_weight * LM loss +
   sum(loss_terms)``; optimizer step; ``after_step`` (metrics). The learning rate of step ``s`` is the
   scheduler's times ``lr_factor(s)``; the scheduler is the only writer of the optimizer's LR.
5. after an evaluation pass: ``evaluation_metrics()``; at each save: ``state_dict``,
   ``checkpoint_metadata``, ``write_artifacts``.

Each method also has a structured config (the ``method`` node, :mod:`dmc_train.methods.configs`)
and an entry in the catalog (:mod:`dmc_train.methods`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from megatron.core.transformer.spec_utils import ModuleSpec


class Method:
    """Plain pre-training / continued pre-training: changes nothing."""

    lm_loss_weight: float = 1.0  # weight of the LM loss in the objective (0: pure distillation)
    # prepare_model freezes every base parameter: a run started from a base saves only the parameters
    # added_parameter names, plus a reference to the base (dmc_train/training/base_reference.py)
    frozen_base: bool = False
    # the validation metric checkpoint.keep_best minimises: "val_loss" (LM) or "val_<name>" of evaluation_metrics()
    best_metric: str = "val_loss"

    def __init__(self, cfg: Any):
        self.cfg = cfg

    def attention(self) -> Optional[ModuleSpec]:
        """The ``self_attention`` spec of this method's attention variant; None = stock attention."""
        return None

    def prepare_model(self, chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
        """Runs between model build and DDP/optimizer; returns the chunks to train."""
        return chunks

    def added_parameter(self, name: str) -> bool:
        """True for the parameters this method adds to the model (not in a base checkpoint or a Hugging Face
        Llama: ``checkpoint.init_from`` leaves them as built)."""
        return False

    def attach(self, trainer) -> None:
        """Called once the trainer has built (and possibly loaded) the model, optimizer and scheduler."""

    def lr_factor(self, step: int) -> float:
        """Multiplier of the scheduler's learning rate for optimizer step ``step`` (0-based)."""
        return 1.0

    def loss_terms(self, model_chunk: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Extra per-token-normalised loss terms for the micro-batch just run through ``model_chunk``.

        Called on the last pipeline stage after the forward; each term is weighted by the micro-batch's
        tokens and added to the loss. A term may be a detached value (reported only) when its
        gradient reaches the parameters another way (DMC injects it in the layers of every stage).
        """
        return {}

    def before_step(self, step: int, model_chunks: list[torch.nn.Module]) -> None:
        """Called before the forward/backward of optimizer step ``step`` (0-based)."""

    def after_step(self, step: int, model_chunks: list[torch.nn.Module]) -> dict[str, Any]:
        """Called after the optimizer step; returns metrics to log (progress line and metrics.jsonl)."""
        return {}

    def evaluation_metrics(self) -> dict[str, Any]:
        """After an evaluation pass (collective): facts about it, e.g. ``{"achieved_cr": 2.1}``.
        The loop logs each as ``val_<name>``; evaluation reports them per split."""
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def checkpoint_metadata(self, model_chunks: list[torch.nn.Module]) -> dict:
        """JSON-serialisable facts recorded beside each checkpoint (e.g. achieved compression)."""
        return {}

    def write_artifacts(self, ckpt_dir: str, meta: dict) -> None:
        """Rank 0: extra files (plots) written into a checkpoint before it is made visible."""
