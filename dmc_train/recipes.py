"""Compose a run's config from the recipe tree: the schema, the method group, recipes, overrides.

    cfg = load_config(["+recipe=dmc_tiny", "method.target_cr=4"])
    layout = validate(cfg, world_size=2)

The recipe tree (``config.yaml``, ``model/``, ``recipe/``, ``hydra/``) is found by
:func:`recipes_dir`. ``launch/pretrain.py`` composes the same config with ``@hydra.main``.
"""

from __future__ import annotations

import os
from typing import Any

from dmc_train import config as config_mod
from dmc_train.methods import METHODS, validate_method

RECIPES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes")


def recipes_dir() -> str:
    return RECIPES_DIR


def register_schema() -> None:
    """Register the typed schema (``schema``) and one node per method (group ``method``) with Hydra."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(name="schema", node=config_mod.Config)
    for name, entry in METHODS.items():
        store.store(group="method", name=name, node=entry.config)


def load_config(overrides: list[str], config_name: str = "config") -> Any:
    """Compose ``<recipes>/<config_name>.yaml`` with Hydra overrides (``+recipe=tiny_pretrain``, ``a.b=1``).

    The programmatic twin of ``launch/pretrain.py``'s command line, for tests, tools and benchmarks.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_schema()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=recipes_dir(), version_base=None):
        return compose(config_name=config_name, overrides=list(overrides))


def validate(cfg: Any, world_size: int) -> config_mod.ParallelLayout:
    """Check the whole config (schema values and the method's node); raise a one-line ConfigError."""
    layout = config_mod.validate(cfg, world_size)
    validate_method(cfg)
    return layout
