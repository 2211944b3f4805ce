"""Which checkpoint a run starts from (``checkpoint.resume``), checked before any model is built.

``auto`` resumes from the newest complete checkpoint, ``none`` starts fresh, anything else names a
checkpoint (a directory, a run directory, a pointer file such as ``checkpoints/best``). A damaged
``iter_N`` (its ``meta.json`` lost) that the run would save over is set aside as ``iter_N.damaged-<time>``
when the run starts; one behind the run is left as it is.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

from dmc_train.distributed import is_rank0
from dmc_train.errors import CheckpointError
from dmc_train.training.checkpoint_dirs import (
    LATEST,
    META,
    check_model_shape,
    checkpoint_root,
    damaged_checkpoints,
    find_checkpoint,
    newest_complete,
    pointer_name,
    pointer_target,
    read_meta,
    set_aside,
    step_of,
)


def resolve_resume(cfg: Any, log: Callable[[str], None] = print) -> Optional[tuple[str, dict]]:
    """The checkpoint to start from, with its metadata checked against the config, or None.

    ``auto``: the newest complete ``iter_*``; when ``latest`` does not name it (missing, invalid, or an
    older checkpoint because a save stopped before the pointer was replaced) one ``log`` line says so, so
    a run never trains over its own checkpoints. ``none``: a fresh start, refused if the run directory
    already holds complete checkpoints, as is ``checkpoint.load_optimizer=false`` (it restarts at step 0).
    Optimizer settings that differ from the checkpoint's are applied from the resumed step on (one
    ``log`` line). Runs before any model is built so a mismatch fails fast.
    """
    resume = cfg.checkpoint.resume
    root = checkpoint_root(cfg)
    own = newest_complete(root)
    damaged = damaged_checkpoints(root)
    if resume == "none":
        if own is not None:
            raise CheckpointError(
                f"run_dir {cfg.run_dir} already holds checkpoints (newest {os.path.basename(own)}) that "
                f"checkpoint.resume=none would overwrite; use checkpoint.resume=auto to continue, another "
                f"run_name / run_dir to start over, or delete {root}")
        _set_aside_damaged(root, damaged, None, log)
        return None
    if resume == "auto":
        ckpt = own
        if ckpt is None:
            _set_aside_damaged(root, damaged, None, log)
            return None
        pointer = pointer_target(root)
        named = pointer_name(root)
        if pointer is None and named not in {name for name, _ in damaged}:  # a damaged target is reported below
            log(f"checkpoints/{LATEST} is missing or invalid; resuming from the newest complete checkpoint "
                f"{os.path.basename(ckpt)}")
        elif pointer is not None and pointer != os.path.basename(ckpt):
            log(f"checkpoints/{LATEST} names {pointer}, but {os.path.basename(ckpt)} is newer and complete (a save "
                f"stopped before the pointer was replaced); resuming from {os.path.basename(ckpt)}")
    else:
        ckpt = find_checkpoint(resume)
    if not cfg.checkpoint.load_optimizer and own is not None:
        raise CheckpointError(
            f"checkpoint.load_optimizer=false restarts at step 0 and would overwrite the checkpoints in {root} "
            f"(newest {os.path.basename(own)}); drop it to continue the run, or start a new run from these "
            f"weights with checkpoint.init_from={own} checkpoint.resume=none and another run_name / run_dir")
    meta = read_meta(ckpt)
    check_model_shape(ckpt, meta, cfg)
    saved = meta["layout"]
    changed = (saved["tensor"], saved["pipeline"]) != (cfg.parallel.tensor, cfg.parallel.pipeline)
    if changed and saved["distributed_optimizer"] and cfg.checkpoint.load_optimizer:
        raise CheckpointError(
            f"checkpoint {ckpt} was saved at TP={saved['tensor']} PP={saved['pipeline']} with the distributed "
            f"optimizer, whose state cannot be resharded to TP={cfg.parallel.tensor} PP={cfg.parallel.pipeline}; "
            f"load the weights only with checkpoint.load_optimizer=false checkpoint.resume={ckpt} in another run_dir")
    saved_optim = meta["config"].get("optim", {})
    differ = [f"optim.{k}: {saved_optim.get(k)} -> {v}" for k, v in cfg.optim.items()
              if cfg.checkpoint.load_optimizer and v != saved_optim.get(k, v)]
    if differ:
        log(f"optimizer settings differ from checkpoint {os.path.basename(ckpt)} ({'; '.join(differ)}); the new "
            f"values apply from its step {meta['step']} on")
    start = meta["step"] if cfg.checkpoint.load_optimizer else 0
    _set_aside_damaged(root, damaged, (os.path.basename(ckpt), start), log)
    return ckpt, meta


def _set_aside_damaged(root: str, damaged: list[tuple[str, str]], start: Optional[tuple[str, int]],
                       log: Callable[[str], None]) -> None:
    """Rank 0: rename each damaged ``iter_N`` the run would save over (N after ``start``, the checkpoint and
    step it starts from; None: a fresh start) to ``iter_N.damaged-<time>``, with one ``log`` line each."""
    first = start[1] if start else 0
    for name, problem in damaged:
        if step_of(name) <= first:
            continue  # behind the run: never saved over, left as it is
        if is_rank0():
            aside = set_aside(root, name, "damaged")
            log(f"checkpoint {name} is damaged: {problem} ({os.path.join(root, name, META)}); it is kept as "
                f"checkpoints/{aside} (its other files untouched) and never resumed from; "
                + (f"resuming from {start[0]}, the newest complete checkpoint" if start
                   else "no complete checkpoint is left: starting from step 0"))
