"""Training methods: what a run does to the model beyond plain pre-training (docs/DESIGN.md).

The catalog below maps a method name (``method=<name>``) to its structured config (the ``method``
node, :mod:`dmc_train.methods.configs`) and its implementation (a :class:`~dmc_train.methods.base.Method`
subclass, imported only when a run builds it, so composing and checking a config stays light).
Add a method with :func:`register_method`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from dmc_train.errors import ConfigError
from dmc_train.methods.configs import DMCConfig, FixedPoolingConfig, LESSConfig, NoMethodConfig


@dataclass(frozen=True)
class MethodEntry:
    config: type  # structured config dataclass with a ``check(cfg)`` staticmethod
    implementation: str  # "module:Class" of the Method subclass
    cache: str = "full"  # the inference engine's cache a checkpoint of this method needs (inference/caches)


METHODS: dict[str, MethodEntry] = {}


def register_method(name: str, config: type, implementation: str, cache: str = "full") -> None:
    """Make ``method=<name>`` available: its config node (registered with Hydra by
    :func:`dmc_train.recipes.register_schema`), its ``"module:Class"`` implementation and the inference
    cache its checkpoints need (``full``: every token; ``dmc``: Algorithm 1)."""
    METHODS[name] = MethodEntry(config, implementation, cache)


register_method("none", NoMethodConfig, "dmc_train.methods.base:Method")
register_method("dmc", DMCConfig, "dmc_train.methods.dmc:DMCMethod", cache="dmc")
register_method("fixed_pooling", FixedPoolingConfig, "dmc_train.methods.dmc:FixedPoolingMethod", cache="dmc")
register_method("less", LESSConfig, "dmc_train.methods.less:LESSMethod", cache="less")


def _entry(cfg: Any) -> MethodEntry:
    name = cfg.method.name
    if name not in METHODS:
        raise ConfigError(f"method.name={name!r} is not one of {', '.join(sorted(METHODS))}")
    return METHODS[name]


def validate_method(cfg: Any) -> None:
    """The method's own checks of ``cfg`` (one-line ConfigError)."""
    _entry(cfg).config.check(cfg)


def build_method(cfg: Any):
    """The :class:`~dmc_train.methods.base.Method` of ``cfg.method.name`` (needs the process groups)."""
    module, cls = _entry(cfg).implementation.split(":")
    return getattr(importlib.import_module(module), cls)(cfg)
