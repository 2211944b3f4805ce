"""The best validated checkpoint of a run (``checkpoint.keep_best=true``).

Each checkpoint saved at a step with an evaluation records it in ``meta.json``::

    "validation": {"metric": "val_less_mse", "value": 0.0123}

The metric is the one the method names (``Method.best_metric``: ``val_loss`` by default, LESS's mean
per-layer validation MSE ``val_less_mse``); lower is better. After each save, ``checkpoints/best`` (a pointer
file beside ``latest``) names the complete checkpoint with the lowest value (the earliest on a tie), and
``checkpoint.keep_last`` never prunes it. Anything that takes a checkpoint path takes the pointer:
``launch/generate.py --checkpoint runs/x/checkpoints/best``, ``checkpoint.resume=runs/x/checkpoints/best``.
"""

from __future__ import annotations

import json
import math
import os
from typing import Optional

from dmc_train.training.checkpoint_dirs import complete_checkpoints, step_of, write_pointer

BEST = "best"


def validation_record(metric: str, step: int, validated: Optional[tuple[int, dict]]) -> Optional[dict]:
    """What ``meta.json`` records for a checkpoint of ``step``: ``metric``'s value from the evaluation
    ``validated = (its step, {name: value})`` when that evaluation ran at ``step`` (else None: the
    weights saved are not the ones validated)."""
    if validated is None or validated[0] != step or metric not in validated[1]:
        return None
    value = float(validated[1][metric])
    return {"metric": metric, "value": value} if math.isfinite(value) else None


def choose_best(root: str, names: list[str]) -> Optional[str]:
    """The checkpoint among ``names`` (complete checkpoints in ``root``, oldest first) with the lowest recorded
    validation value of the metric the newest validated one names; None when none is validated."""
    records = []
    for name in names:
        try:
            with open(os.path.join(root, name, "meta.json")) as f:
                record = json.load(f).get("validation")
        except (OSError, ValueError, AttributeError):
            continue  # unreadable: never chosen (read_meta reports it when it is used)
        if isinstance(record, dict) and isinstance(record.get("value"), (int, float)):
            records.append((name, record["metric"], record["value"]))
    if not records:
        return None
    metric = records[-1][1]
    same = [(value, i, name) for i, (name, m, value) in enumerate(records) if m == metric]
    return min(same)[2]


def update_best(root: str, saved_step: int) -> Optional[str]:
    """Rank 0, after a save: point ``root/best`` at the complete checkpoint up to ``saved_step`` with the lowest
    validation value (:func:`choose_best`); return its name (None: no checkpoint was validated)."""
    names = [n for n in complete_checkpoints(root) if step_of(n) is not None and step_of(n) <= saved_step]
    best = choose_best(root, names)
    if best is not None:
        write_pointer(root, BEST, best)
    return best
