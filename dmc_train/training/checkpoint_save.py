"""Writing checkpoints atomically: a training checkpoint ``iter_N`` and a weights-only one.

A save writes into ``iter_N.tmp``, then rank 0 writes ``meta.json``, renames the directory to ``iter_N``
and only then replaces ``latest``; a crash at any point leaves the previous ``latest`` complete and
loadable. ``meta.json`` is the completeness marker (the layout: :mod:`checkpoint_dirs`; what is stored:
:mod:`checkpoint_state`).

A run never deletes or overwrites a checkpoint directory it did not write: an ``iter_N`` without
``meta.json`` that the run would otherwise save over is set aside when the run starts
(:mod:`checkpoint_resume`), a complete ``iter_N`` of an earlier run is renamed ``iter_N.replaced-<time>``
before the run saves step N, and ``checkpoint.keep_last`` prunes only complete checkpoints up to the one
just saved (:func:`~dmc_train.training.checkpoint_dirs.prune`; ``checkpoint.keep_best``:
:mod:`best_checkpoint`). A method that freezes the base (LESS) stores only its own parameters and a
reference to the base (:mod:`base_reference`).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from typing import Any, Optional

from megatron.core import dist_checkpointing, parallel_state
from omegaconf import OmegaConf

from dmc_train.distributed import barrier, first_message, is_rank0, world_size
from dmc_train.errors import CheckpointError
from dmc_train.training import base_reference
from dmc_train.training.best_checkpoint import update_best
from dmc_train.training.checkpoint_dirs import (
    LATEST,
    META,
    checkpoint_root,
    iter_name,
    newest_complete,
    pointer_target,
    prune,
    replace_dir,
    set_aside,
    write_pointer,
)
from dmc_train.training.checkpoint_errors import READ_ERRORS, causes, error_cause
from dmc_train.training.checkpoint_state import model_key, sharded_state

_WRITTEN: set[str] = set()  # the checkpoint directories this process saved (rank 0): its own to replace


def save_checkpoint(cfg: Any, model, optimizer, scheduler, method, step: int, consumed: int,
                    extra_meta: Optional[dict] = None, base: Optional[dict] = None) -> str:
    """Write ``iter_<step>`` atomically and point ``latest`` at it; keep the newest ``keep_last`` (and, with
    ``checkpoint.keep_best``, the best validated one, named by ``best``).

    ``base``: the base a frozen-base method's run started from (:mod:`~dmc_train.training.base_reference`):
    only the method's own parameters (``method.added_parameter``) are written, and ``meta.json`` records
    the base."""
    root = checkpoint_root(cfg)
    final = os.path.join(root, iter_name(step))
    tmp = final + ".tmp"
    if base is not None:
        extra_meta = {**(extra_meta or {}), "base": base_reference.record(base, final)}
    state = sharded_state(model, optimizer, scheduler, method, step, consumed, False,
                          keep=method.added_parameter if base is not None else None)
    try:
        _write_sharded(state, tmp)
        if is_rank0():
            meta = _meta(cfg, step, consumed, cfg.parallel.distributed_optimizer, extra_meta)
            method.write_artifacts(tmp, meta)
            if os.path.exists(final) and final not in _WRITTEN:  # another run's (e.g. one resumed from older)
                aside = set_aside(root, os.path.basename(final), "replaced")
                print(f"checkpoint {os.path.basename(final)} of an earlier run is kept as checkpoints/{aside}; "
                      f"this run saves its own step {step}", flush=True)
            _publish(cfg, tmp, final, meta)
            _WRITTEN.add(final)
            write_pointer(root, LATEST, os.path.basename(final))
            best = update_best(root, step) if cfg.checkpoint.keep_best else None
            prune(root, cfg.checkpoint.keep_last, step, keep={best})
        failure = None
    except READ_ERRORS as e:
        failure = _save_failure(root, final, e, state)
    failure = first_message(failure)  # also the barrier: every rank fails (or succeeds) together
    if failure is not None:
        raise CheckpointError(failure)
    return final


def save_weights(cfg: Any, model_chunks: list, out: str, extra_meta: Optional[dict] = None) -> str:
    """Write a weights-only checkpoint of unwrapped chunks to the directory ``out`` (loadable with
    ``checkpoint.init_from=<out>`` at any TP/PP layout). Written under ``out.tmp`` and renamed, so an
    existing ``out`` is replaced only by a complete checkpoint."""
    out = os.path.abspath(out)
    tmp = out + ".tmp"
    _write_sharded({model_key(i, len(model_chunks)): c.sharded_state_dict() for i, c in enumerate(model_chunks)},
                   tmp)
    if is_rank0():
        publish_weights(cfg, tmp, out, extra_meta)
    barrier()
    return out


def publish_weights(cfg: Any, tmp: str, out: str, extra_meta: Optional[dict] = None) -> None:
    """Rank 0: complete the weights-only checkpoint written into ``tmp`` and rename it to ``out``."""
    _publish(cfg, tmp, out, _meta(cfg, 0, 0, False, {"weights_only": True, **(extra_meta or {})}))


def _write_sharded(state: dict, tmp: str) -> None:
    """All ranks: ``dist_checkpointing.save`` into a fresh directory ``tmp`` (a crashed write's is removed)."""
    if is_rank0():
        os.makedirs(os.path.dirname(tmp), exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier()
    dist_checkpointing.save(state, tmp)
    barrier()


def _meta(cfg: Any, step: int, consumed: int, distributed_optimizer: bool, extra_meta: Optional[dict]) -> dict:
    """The ``meta.json`` of a new checkpoint: step, data position, layout, method, ``extra_meta``, config."""
    return {
        "step": step,
        "consumed_samples": consumed,
        "layout": {"tensor": cfg.parallel.tensor, "pipeline": cfg.parallel.pipeline,
                   "virtual_pipeline": cfg.parallel.virtual_pipeline,
                   "distributed_optimizer": distributed_optimizer, "world_size": world_size()},
        "method": cfg.method.name,
        **(extra_meta or {}),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }


def _publish(cfg: Any, tmp: str, final: str, meta: dict) -> None:
    """Rank 0: complete ``tmp`` (config.yaml, then meta.json, the completeness marker) and rename it
    to ``final``, replacing an existing ``final`` only once the new one is complete."""
    OmegaConf.save(cfg, os.path.join(tmp, "config.yaml"), resolve=True)
    with open(os.path.join(tmp, META), "w") as f:
        json.dump(meta, f, indent=1)
    replace_dir(tmp, final)


def _save_failure(root: str, final: str, error: BaseException, state: dict) -> str:
    """Remove the partial write of ``final`` and describe the failure in one line (the space needed when
    the disk or quota is full)."""
    tmp = final + ".tmp"
    if is_rank0():
        shutil.rmtree(tmp, ignore_errors=True)
        if os.path.exists(os.path.join(root, LATEST + ".tmp")):
            os.remove(os.path.join(root, LATEST + ".tmp"))
    pointer = pointer_target(root)
    kept = (f"checkpoints/{LATEST} still names {pointer}, so checkpoint.resume=auto continues from there" if pointer
            else "no earlier checkpoint exists")
    found = causes(error)
    text = " ".join(str(e) for e in found)

    def hit(errnos, messages):
        return any(isinstance(e, OSError) and e.errno in errnos for e in found) or any(m in text for m in messages)

    previous = newest_complete(root)
    need = _dir_bytes(previous) if previous else _state_bytes(state)
    free = shutil.disk_usage(root).free
    short_write = "unexpected pos" in text  # torch's report of a write cut short (full disk or file size limit)
    if hit((errno.ENOSPC, errno.EDQUOT), ("No space left", "Disk quota exceeded")) or (short_write and free < need):
        return (f"no space left writing checkpoint {final}: it needs about {need / 2**20:.1f} MiB and "
                f"{free / 2**20:.1f} MiB are free on {root}; free space, raise the quota or lower "
                f"checkpoint.keep_last; the partial write was removed and {kept}")
    if hit((errno.EFBIG,), ("File too large",)) or short_write:
        return (f"a file size limit or quota stopped writing checkpoint {final} (it needs about {need / 2**20:.1f} "
                f"MiB in all): raise the limit (ulimit -f) or the quota; the partial write was removed and {kept}")
    return f"checkpoint {final} could not be written ({error_cause(error)}); the partial write was removed and {kept}"


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _state_bytes(state: dict) -> int:
    """About the bytes of a whole checkpoint: this rank's main replicas times the model-parallel size."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica

    local = sum(v.data.numel() * v.data.element_size() for v in nested_values(state)
                if isinstance(v, ShardedTensor) and v.data is not None and is_main_replica(v.replica_id))
    return local * parallel_state.get_tensor_model_parallel_world_size() * (
        parallel_state.get_pipeline_model_parallel_world_size())
