"""Eviction and selection policies: one scorer per file, one registry (docs/METHODS.md, "Eviction and
selection policies"; how to add one: docs/DESIGN.md, "Adding a cache policy").

:data:`POLICIES` maps each scorer's ``name`` to its class; every list of policies in the project (the
commands' help, the engine's caches, the study's cells and their labels) is read from it.

A scorer runs in two forms that keep the same entries: the engine's fixed-budget cache
(``dmc_train/inference/caches/evicting.py``) and the parallel form for whole sequences
(:func:`dmc_train.policies.parallel.run_policy`: teacher-forced evaluation, LESS training).
"""

from __future__ import annotations

from typing import Any

from dmc_train.errors import ConfigError
from dmc_train.policies.base import Entries, PolicyConfig, Scorer, Step, make_config
from dmc_train.policies.budget import Budget
from dmc_train.policies.h2o import H2O
from dmc_train.policies.keyformer import Keyformer
from dmc_train.policies.knorm import Knorm
from dmc_train.policies.lsh_e import LSHE
from dmc_train.policies.streaming_llm import StreamingLLM
from dmc_train.policies.tova import TOVA

POLICIES: dict[str, type[Scorer]] = {s.name: s for s in (H2O, TOVA, StreamingLLM, Keyformer, LSHE, Knorm)}


def policy_config(name: str, options: dict[str, Any]) -> PolicyConfig:
    """The options of policy ``name`` checked by the one schema (:func:`~dmc_train.policies.base.make_config`:
    known name, type, range); one-line :class:`ConfigError` for a bad name or option. Every way to a policy
    goes through here: the engine's ``Engine(..., **options)`` and ``--policy-option``, the evaluation's
    ``eval.options`` and LESS's ``method.policy_options`` (checked with the config, before a run starts)."""
    if name not in POLICIES:
        raise ConfigError(f"unknown policy {name!r}; the policies are {', '.join(POLICIES)}")
    return make_config(POLICIES[name].Config, options, name)


def build_scorer(name: str, options: dict[str, Any], head_dim: int, group: int, scale: float) -> Scorer:
    """The scorer ``name`` with its options (:func:`policy_config`)."""
    cfg = policy_config(name, options)  # first: an unknown name is a ConfigError
    return POLICIES[name](cfg, head_dim, group, scale)


__all__ = ["POLICIES", "Budget", "Entries", "PolicyConfig", "Scorer", "Step", "build_scorer", "policy_config"]
