"""The checkpoints directory of a run: names, completeness, pointer files, ``meta.json``, retention.

Layout of ``<run_dir>/checkpoints/`` (written by :mod:`~dmc_train.training.checkpoint_save`)::

    iter_0000100/          a complete checkpoint: its files + meta.json (the completeness marker)
    iter_0000200.tmp/      a write in progress (or one that crashed): never read
    latest                 pointer file: the name of the newest complete checkpoint (replaced atomically)
    best                   pointer file: the best validated checkpoint (checkpoint.keep_best)
    iter_0000300.damaged-20250101-120000/   set aside: names with a dot are never read, resumed or pruned

Everything here reads, names, renames or deletes directories; nothing builds a model or touches megatron,
so the modules beside the checkpoint writer (``base_reference``, ``best_checkpoint``) use it without
importing the writer.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from typing import Any, Optional

from omegaconf import OmegaConf

from dmc_train.config import kv_groups
from dmc_train.errors import CheckpointError

LATEST = "latest"
META = "meta.json"
MODEL_SHAPE_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                      "num_query_groups", "vocab_size", "tie_embeddings")
# The value of a shape field that a config or a record written before the field existed lacks.
MODEL_SHAPE_DEFAULTS = {"tie_embeddings": False}
# What meta.json must hold to be used: top-level keys and the keys read inside them.
_REQUIRED_META = {"step": (), "layout": ("tensor", "pipeline", "distributed_optimizer"), "config": ("model",)}


def checkpoint_root(cfg: Any) -> str:
    return os.path.join(cfg.run_dir, "checkpoints")


def iter_name(step: int) -> str:
    return f"iter_{step:07d}"


def read_latest(root: str) -> Optional[str]:
    """The checkpoint ``root/latest`` names, or None if there is no pointer. A pointer that is not the
    name of a complete checkpoint in ``root`` (unreadable, empty, a path outside ``root``, an incomplete or
    missing directory) raises CheckpointError naming the newest complete checkpoint to use instead."""
    path = os.path.join(root, LATEST)
    if not os.path.exists(path):
        return None
    name = pointer_target(root)
    if name is None:
        newest = newest_complete(root)
        fix = (f"resume from the newest complete checkpoint with checkpoint.resume={newest}" if newest
               else "no complete checkpoint exists; delete it to start over")
        raise CheckpointError(f"checkpoint pointer {path} is invalid (it does not name a complete checkpoint in "
                              f"{root}); {fix}")
    return os.path.join(root, name)


def pointer_target(root: str) -> Optional[str]:
    """The name in ``root/latest`` if it is a complete checkpoint directly inside ``root``, else None."""
    name = pointer_name(root)
    if name is None or os.path.basename(name) != name or not _is_complete(root, name):
        return None
    return name


def _is_complete(root: str, name: str) -> bool:
    return name.startswith("iter_") and "." not in name and os.path.isfile(os.path.join(root, name, META))


_ITER = re.compile(r"iter_(\d+)")


def step_of(name: str) -> Optional[int]:
    """The step of a checkpoint directory name ``iter_N`` (None for any other name, e.g. ``iter_N.tmp``)."""
    m = _ITER.fullmatch(name)
    return int(m.group(1)) if m else None


def damaged_checkpoints(root: str) -> list[tuple[str, str]]:
    """``(name, what is wrong)`` of each ``iter_N`` directory in ``root`` that is not complete, oldest first.
    A save renames a directory to ``iter_N`` only once its ``meta.json`` is written, so such a directory
    was damaged afterwards (a file deleted or lost); its other files may still be intact."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in sorted(os.listdir(root)):
        if step_of(name) is not None and os.path.isdir(os.path.join(root, name)) and not _is_complete(root, name):
            found.append((name, f"its {META} is missing"))
    return found


def set_aside(root: str, name: str, why: str) -> str:
    """Rename ``root/name`` to ``root/<name>.<why>-<time>`` (never read, resumed from or pruned); return the
    new name."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    new, n = f"{name}.{why}-{stamp}", 1
    while os.path.exists(os.path.join(root, new)):
        n += 1
        new = f"{name}.{why}-{stamp}-{n}"
    os.rename(os.path.join(root, name), os.path.join(root, new))
    return new


def replace_dir(tmp: str, final: str) -> None:
    """Rename the complete directory ``tmp`` to ``final``; an existing ``final`` (a re-saved step, an
    overwritten output) is moved aside first and removed only once the new one is in place."""
    if os.path.exists(final):
        shutil.rmtree(final + ".old", ignore_errors=True)
        os.rename(final, final + ".old")
    os.rename(tmp, final)
    shutil.rmtree(final + ".old", ignore_errors=True)


def prune(root: str, keep_last: int, saved_step: int, keep: set = frozenset()) -> None:
    """``checkpoint.keep_last``: delete all but the newest ``keep_last`` complete checkpoints up to
    ``saved_step`` (the one just saved). Newer ones (kept by a run resumed from an older checkpoint), the
    names in ``keep`` (the best one), ``*.tmp`` writes and directories set aside (``*.damaged-*``,
    ``*.replaced-*``) are never deleted."""
    if keep_last <= 0:
        return
    complete = [n for n in complete_checkpoints(root) if step_of(n) is not None and step_of(n) <= saved_step]
    for name in sorted(complete, key=step_of)[:-keep_last]:
        if name not in keep:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def complete_checkpoints(root: str) -> list[str]:
    """Names of the complete checkpoints (``iter_N`` with ``meta.json``; not ``*.tmp``) in ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    return sorted(d for d in os.listdir(root) if _is_complete(root, d))


def newest_complete(root: str) -> Optional[str]:
    """Path of the newest complete checkpoint in ``root`` found by scanning ``iter_*``, or None."""
    names = complete_checkpoints(root)
    return os.path.join(root, names[-1]) if names else None


def read_meta(ckpt: str) -> dict:
    meta_path = os.path.join(ckpt, META)
    if not os.path.isdir(ckpt):
        raise CheckpointError(f"checkpoint {ckpt} does not exist; check checkpoint.resume or use resume=none")
    if not os.path.exists(meta_path):
        raise CheckpointError(f"checkpoint {ckpt} is incomplete (no {META}): the write was interrupted; "
                              f"{other_checkpoint(ckpt)}")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {ckpt} has a corrupt {META} ({e}); {other_checkpoint(ckpt)}") from None
    missing = _missing_meta(meta)
    if missing:
        raise CheckpointError(f"checkpoint {ckpt} has a corrupt {META} (it lacks {', '.join(missing)}); "
                              f"{other_checkpoint(ckpt)}")
    return meta


def _missing_meta(meta: Any) -> list[str]:
    if not isinstance(meta, dict):
        return ["everything: it is not a JSON object"]
    missing = []
    for key, inner in _REQUIRED_META.items():
        if key not in meta:
            missing.append(key)
        else:
            missing += [f"{key}.{k}" for k in inner if not isinstance(meta[key], dict) or k not in meta[key]]
    return missing


def other_checkpoint(ckpt: str) -> str:
    """The fix for an unusable checkpoint: the newest other complete checkpoint beside it, if there is one."""
    ckpt = os.path.normpath(os.path.abspath(ckpt))
    root = os.path.dirname(ckpt)
    others = [n for n in complete_checkpoints(root) if n != os.path.basename(ckpt)]
    if others:
        return f"resume from the newest other complete checkpoint: checkpoint.resume={os.path.join(root, others[-1])}"
    return "no other complete checkpoint is beside it: use another checkpoint or start over in another run_dir"


def pointer_name(root: str, pointer: str = LATEST) -> Optional[str]:
    """The text of ``root/<pointer>`` (None if unreadable), whatever it names."""
    try:
        with open(os.path.join(root, pointer), "rb") as f:
            return f.read(4096).decode("utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None


def read_pointer(root: str, pointer: str) -> str:
    """The checkpoint the pointer file ``root/<pointer>`` (``latest``, ``best``) names; one-line CheckpointError
    when it names no complete checkpoint in ``root``."""
    name = pointer_name(root, pointer)
    if name is None or os.path.basename(name) != name or not _is_complete(root, name):
        newest = newest_complete(root)
        raise CheckpointError(f"{os.path.join(root, pointer)} does not name a complete checkpoint in {root}; "
                              + (f"use a checkpoint directory, e.g. the newest: {newest}" if newest
                                 else "there is none"))
    return os.path.join(root, name)


def write_pointer(root: str, pointer: str, name: str) -> None:
    """Rank 0: make ``root/<pointer>`` name checkpoint ``name`` (replaced atomically)."""
    tmp = os.path.join(root, pointer + ".tmp")
    with open(tmp, "w") as f:
        f.write(name)
    os.replace(tmp, os.path.join(root, pointer))


def check_model_shape(ckpt: str, meta: dict, cfg: Any) -> None:
    saved = OmegaConf.create(meta["config"]["model"])

    def value(model, key):  # num_query_groups: null means MHA (groups = heads)
        return kv_groups(model) if key == "num_query_groups" else model.get(key, MODEL_SHAPE_DEFAULTS.get(key))

    diffs = [f"{k}: checkpoint {value(saved, k)} vs config {value(cfg.model, k)}"
             for k in MODEL_SHAPE_FIELDS if value(saved, k) != value(cfg.model, k)]
    if diffs:
        raise CheckpointError(f"checkpoint {ckpt} has a different model shape ({'; '.join(diffs)}); "
                              f"use the matching model config or another checkpoint")


def find_checkpoint(path: str) -> str:
    """A checkpoint directory from ``path``: the checkpoint itself, a pointer file (``latest``, ``best``) in a
    checkpoints root, or a checkpoints root / run directory whose ``latest`` names one."""
    if os.path.exists(os.path.join(path, META)):
        return path
    if os.path.isfile(path):
        return read_pointer(os.path.dirname(path) or ".", os.path.basename(path))
    for root in (path, os.path.join(path, "checkpoints")):
        latest = read_latest(root)
        if latest is not None:
            return latest
    return path  # read_meta names what is missing
