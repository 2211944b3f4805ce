"""Compose a run's config from the recipe tree: the schema, the method group, recipes, overrides.

    cfg = load_config(["+recipe=dmc_tiny", "method.target_cr=4"])
    layout = validate(cfg, world_size=2)

The recipe tree (``config.yaml``, ``model/``, ``recipe/``, ``hydra/``) is found by
:func:`recipes_dir` (checkout, installed wheel, or ``$DMC_TRAIN_RECIPES``). ``launch/pretrain.py``
composes the same config with ``@hydra.main(config_path=recipes_dir())``.
"""

from __future__ import annotations

import os
from typing import Any

from dmc_train import config as config_mod
from dmc_train.methods import METHODS, validate_method

RECIPES_ENV = "DMC_TRAIN_RECIPES"  # explicit override of the recipe tree (a directory with config.yaml)
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# An installed wheel: the checkout's recipes/ is package data at dmc_train/_recipes (pyproject.toml).
PACKAGED_RECIPES = os.path.join(_PACKAGE_DIR, "_recipes")
# A source checkout (also what an editable install imports): recipes/ next to dmc_train/.
CHECKOUT_RECIPES = os.path.join(os.path.dirname(_PACKAGE_DIR), "recipes")


def recipes_dir() -> str:
    """The absolute path of the recipe tree every config is composed from.

    Resolution, first match wins:

    1. ``$DMC_TRAIN_RECIPES`` when set and non-empty: that directory (relative to the current
       directory), which must contain ``config.yaml`` - else a one-line ConfigError, never a fallback.
    2. The tree that belongs to the imported ``dmc_train`` code: ``<dmc_train>/_recipes`` in an
       installed wheel (package data), else ``<dmc_train>/../recipes`` in a source checkout or an
       editable install (``pip install -e .``). Both are fixed paths relative to this file; nothing
       depends on the current directory or ``sys.path``.

    Raises :class:`~dmc_train.errors.ConfigError` naming the paths tried when there is none.
    """
    from dmc_train.errors import ConfigError

    override = os.environ.get(RECIPES_ENV)
    if override:
        path = os.path.abspath(override)
        if not os.path.isfile(os.path.join(path, "config.yaml")):
            raise ConfigError(f"{RECIPES_ENV}={override}: no config.yaml in {path}; point it at a recipe tree "
                              f"(a copy of the repository's recipes/) or unset it")
        return path
    for path in (PACKAGED_RECIPES, CHECKOUT_RECIPES):
        if os.path.isfile(os.path.join(path, "config.yaml")):
            return path
    raise ConfigError(f"no recipe tree found: neither {PACKAGED_RECIPES} (installed package) nor {CHECKOUT_RECIPES} "
                      f"(source checkout) holds config.yaml; reinstall dmc_train or set {RECIPES_ENV}")


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
