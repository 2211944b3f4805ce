"""Training methods: what a run does to the model beyond plain pre-training (docs/DESIGN.md).

The catalog below maps a method name (``method=<name>``) to its structured config (the ``method``
node, :mod:`dmc_train.methods.configs`) and its implementation (a :class:`~dmc_train.methods.base.Method`
subclass, imported only when a run builds it, so composing and checking a config stays light) and its
inference hook (an :class:`~dmc_train.inference.method.InferenceMethod` subclass, imported only when the
inference model loads a checkpoint). Add a method with :func:`register_method`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from dmc_train.errors import ConfigError
from dmc_train.methods.configs import DMCConfig, FixedPoolingConfig, LESSConfig, NoMethodConfig

PLAIN_INFERENCE = "dmc_train.inference.method:InferenceMethod"


@dataclass(frozen=True)
class MethodEntry:
    config: type  # structured config dataclass with a ``check(cfg)`` staticmethod
    implementation: str  # "module:Class" of the Method subclass
    inference: str = PLAIN_INFERENCE  # "module:Class" of the InferenceMethod subclass: its checkpoints at inference


METHODS: dict[str, MethodEntry] = {}


def register_method(name: str, config: type, implementation: str, inference: str = PLAIN_INFERENCE) -> None:
    """Make ``method=<name>`` available: its config node (registered with Hydra by
    :func:`dmc_train.recipes.register_schema`), its ``"module:Class"`` implementation and the ``"module:Class"``
    of the hook its checkpoints give the inference model (the cache they need, their decisions, their own
    weights: :mod:`dmc_train.inference.method`; default the plain model's)."""
    METHODS[name] = MethodEntry(config, implementation, inference)


register_method("none", NoMethodConfig, "dmc_train.methods.base:Method")
register_method("dmc", DMCConfig, "dmc_train.methods.dmc:DMCMethod", "dmc_train.inference.dmc_decisions:DMCInference")
register_method("fixed_pooling", FixedPoolingConfig, "dmc_train.methods.dmc:FixedPoolingMethod",
                "dmc_train.inference.dmc_decisions:DMCInference")
register_method("less", LESSConfig, "dmc_train.methods.less:LESSMethod", "dmc_train.inference.caches.less:LESSWeights")


def _entry(cfg: Any) -> MethodEntry:
    name = cfg.method.name
    if name not in METHODS:
        raise ConfigError(f"method.name={name!r} is not one of {', '.join(sorted(METHODS))}")
    return METHODS[name]


def validate_method(cfg: Any) -> None:
    """The method's own checks of ``cfg`` (one-line ConfigError)."""
    _entry(cfg).config.check(cfg)


def _load(path: str) -> type:
    module, cls = path.split(":")
    return getattr(importlib.import_module(module), cls)


def build_method(cfg: Any):
    """The :class:`~dmc_train.methods.base.Method` of ``cfg.method.name`` (needs the process groups)."""
    return _load(_entry(cfg).implementation)(cfg)


def inference_hook(cfg: Any) -> type:
    """The :class:`~dmc_train.inference.method.InferenceMethod` subclass of ``cfg.method.name``: its
    ``from_saved(saved, state, shape)`` gives a checkpoint's hook."""
    return _load(_entry(cfg).inference)
