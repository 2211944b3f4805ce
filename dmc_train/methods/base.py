"""The method interface: how DMC, GQA up-training, LESS ... extend training without editing the loop.

A method may (1) rewrite the layer spec before the model is built, (2) add loss terms computed from
the model chunk after its forward, (3) act before/after each optimizer step (schedules), (4) add
metrics to the progress line and ``metrics.jsonl``, and (5) store its own state and metadata in
checkpoints.
"""

from __future__ import annotations

from typing import Any

import torch


class Method:
    """Plain pre-training / continued pre-training: changes nothing."""

    name = "none"

    def __init__(self, cfg: Any):
        self.cfg = cfg

    def layer_spec(self, spec):
        """Return the (possibly rewritten) transformer layer spec."""
        return spec

    def loss_terms(self, model_chunk: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Extra per-token-normalised loss terms for the micro-batch just run through ``model_chunk``.

        Called on the last pipeline stage after the forward; each term is weighted by the micro-batch's
        tokens and added to the LM loss. A term may be a detached value (reported only) when its
        gradient reaches the parameters another way (DMC injects it in the layers of every stage).
        """
        return {}

    def attach(self, trainer) -> None:
        """Called once the trainer has built (and possibly loaded) the model, optimizer and scheduler."""

    def before_step(self, step: int, model_chunks: list[torch.nn.Module]) -> None:
        """Called before the forward/backward of optimizer step ``step`` (0-based)."""

    def after_step(self, step: int, model_chunks: list[torch.nn.Module]) -> dict[str, float]:
        """Called after the optimizer step; returns metrics to log."""
        return {}

    def evaluation_metrics(self) -> dict:
        """After an evaluation pass (collective): facts about it, e.g. the achieved compression."""
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


_REGISTRY: dict[str, type[Method]] = {"none": Method}


def register(cls: type[Method]) -> type[Method]:
    _REGISTRY[cls.name] = cls
    return cls


def build_method(cfg: Any) -> Method:
    from dmc_train.errors import ConfigError
    from dmc_train.methods import dmc  # noqa: F401  (registers dmc, fixed_pooling)

    name = cfg.method.name
    if name not in _REGISTRY:
        raise ConfigError(f"method.name={name!r} is not one of {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name](cfg)
