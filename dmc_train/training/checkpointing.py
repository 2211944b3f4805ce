"""Atomic, reshardable checkpoints with megatron ``dist_checkpointing``.

Layout of ``<run_dir>/checkpoints/`` (names, pointers and ``meta.json``: :mod:`checkpoint_dirs`)::

    iter_0000100/          a complete checkpoint: dist_checkpointing files + meta.json + config.yaml
    iter_0000200.tmp/      a write in progress (or one that crashed): never read
    latest                 the name of the newest complete checkpoint (replaced atomically)
    best                   the best validated checkpoint (``checkpoint.keep_best``, :mod:`best_checkpoint`)
    iter_0000300.damaged-20250101-120000/   set aside by a run: it had lost its meta.json
    iter_0000400.replaced-20250101-120000/  set aside by a run that saved the same step again

A save writes into ``iter_N.tmp``, then rank 0 writes ``meta.json``, renames the directory to
``iter_N`` and only then replaces ``latest``; a crash at any point leaves the previous ``latest``
complete and loadable. ``meta.json`` is the completeness marker.

A run never deletes or overwrites a checkpoint directory it did not write: an ``iter_N`` without
``meta.json`` (damaged after it was written: a save renames only complete directories) that the run
would otherwise save over is renamed ``iter_N.damaged-<time>`` when the run starts, a complete
``iter_N`` of an earlier run is renamed ``iter_N.replaced-<time>`` before the run saves step N, and
``checkpoint.keep_last`` prunes only complete checkpoints up to the one just saved. Names with a dot
are never read, resumed from or pruned.

What is stored: model weights (reshardable to any TP/PP layout), optimizer state, LR scheduler,
step, consumed samples, RNG states (restored only for the same layout), method state, the
resolved config. Optimizer state reshards with the standard (non-distributed) optimizer; the
distributed optimizer's ``dp_reshardable`` format only changes DP size, so a TP/PP change with it
is refused with a message offering ``checkpoint.load_optimizer=false`` (weights only). A method that
freezes the base (LESS) stores only its own parameters and a reference to the base, which every load
reads first (:mod:`base_reference`).
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
from typing import Any, Callable, Optional

import numpy as np
import torch
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from omegaconf import OmegaConf
from torch.distributed.checkpoint.api import CheckpointException

from dmc_train.distributed import barrier, first_message, is_rank0, world_size
from dmc_train.errors import CheckpointError
from dmc_train.training import base_reference, hf_loading
from dmc_train.training.best_checkpoint import update_best
from dmc_train.training.checkpoint_dirs import (  # noqa: F401  (re-exported: the checkpoint API of one module)
    LATEST,
    META,
    MODEL_SHAPE_FIELDS,
    check_model_shape,
    checkpoint_root,
    complete_checkpoints,
    damaged_checkpoints,
    find_checkpoint,
    iter_name,
    newest_complete,
    other_checkpoint,
    pointer_name,
    pointer_target,
    read_latest,
    read_meta,
    read_pointer,
    set_aside,
    step_of,
    write_pointer,
)

# What a truncated or corrupt checkpoint raises: many Exception types from megatron/pickle, and
# torch.distributed.checkpoint's CheckpointException, which derives from BaseException.
READ_ERRORS = (Exception, CheckpointException)
DISTOPT_FORMAT = "dp_reshardable"
_WRITTEN: set[str] = set()  # the checkpoint directories this process saved (rank 0): its own to replace


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


# ----------------------------------------------------------------------------------------------
# State dicts
# ----------------------------------------------------------------------------------------------
def _model_key(i: int, n: int) -> str:
    return "model" if n == 1 else f"model{i}"


def _rng_state() -> ShardedObject:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    ps = parallel_state
    return ShardedObject(
        "rng_state", state,
        (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size(),
         ps.get_data_parallel_world_size()),
        (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
         ps.get_data_parallel_rank()),
        replica_id=0)


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _sharded_state(model, optimizer, scheduler, method, step, consumed, is_loading,
                   with_optimizer=True, with_rng=True, keep: Optional[Callable[[str], bool]] = None) -> dict:
    """The sharded state of a training checkpoint; ``keep``: only these model parameters (a frozen-base
    method's own, :mod:`~dmc_train.training.base_reference`), and the optimizer state of those."""
    sd: dict = {}
    for i, chunk in enumerate(model):
        sd[_model_key(i, len(model))] = {k: v for k, v in chunk.module.sharded_state_dict().items()
                                         if keep is None or keep(k)}
    if with_optimizer:
        model_sd = {k: v for k, v in sd.items()}
        kwargs = {"metadata": {"distrib_optim_sharding_type": DISTOPT_FORMAT}} if _uses_distopt(model) else {}
        sd["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, **kwargs)
        sd["scheduler"] = scheduler.state_dict()
        sd["method"] = method.state_dict()
    if with_rng:
        sd["rng_state"] = _rng_state()
    sd["step"] = step
    sd["consumed_samples"] = consumed
    sd["adam_step"] = _adam_step(optimizer) if with_optimizer else None
    return sd


def _inner_optimizers(optimizer) -> list:
    return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]


def _adam_step(optimizer) -> int:
    """Adam's update count (bias correction); it differs from the train step after skipped updates."""
    for opt in _inner_optimizers(optimizer):
        for state in opt.state.values():
            if "step" in state:
                return int(state["step"])
    return 0


def _set_adam_step(optimizer, step: int) -> None:
    """megatron's distributed optimizer (dp_reshardable) does not restore Adam's step counter."""
    for opt in _inner_optimizers(optimizer):
        for state in opt.state.values():
            if "step" in state:
                state["step"] = torch.full_like(torch.as_tensor(state["step"]), step)


def _uses_distopt(model) -> bool:
    return model[0].ddp_config.use_distributed_optimizer


# ----------------------------------------------------------------------------------------------
# Save
# ----------------------------------------------------------------------------------------------
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
    state = _sharded_state(model, optimizer, scheduler, method, step, consumed, False,
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
            _prune(root, cfg.checkpoint.keep_last, step, keep={best})
        failure = None
    except READ_ERRORS as e:
        failure = _save_failure(root, final, e, state)
    failure = first_message(failure)  # also the barrier: every rank fails (or succeeds) together
    if failure is not None:
        raise CheckpointError(failure)
    return final


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
    causes = _causes(error)
    text = " ".join(str(e) for e in causes)

    def hit(errnos, messages):
        return any(isinstance(e, OSError) and e.errno in errnos for e in causes) or any(m in text for m in messages)

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


def _causes(error: BaseException) -> list[BaseException]:
    """``error``, its cause chain and the per-rank exceptions a CheckpointException wraps."""
    found, todo = [], [error]
    while todo:
        e = todo.pop(0)
        if e is None or any(e is f for f in found):
            continue
        found.append(e)
        todo += [e.__cause__ or e.__context__]
        if isinstance(e, CheckpointException):
            todo += [wrapped for wrapped, _ in e.failures.values()]
    return found


def error_cause(error: BaseException) -> str:
    """The root exception of ``error`` in one short line (a CheckpointException's text holds tracebacks)."""
    inner = [e for e in _causes(error) if not isinstance(e, CheckpointException)] or [error]
    text = " ".join(str(inner[-1]).split()) if not isinstance(inner[-1], CheckpointException) else ""
    return f"{type(inner[-1]).__name__}: {text[:200]}" if text else type(inner[-1]).__name__


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


def replace_dir(tmp: str, final: str) -> None:
    """Rename the complete directory ``tmp`` to ``final``; an existing ``final`` (a re-saved step, an
    overwritten output) is moved aside first and removed only once the new one is in place."""
    if os.path.exists(final):
        shutil.rmtree(final + ".old", ignore_errors=True)
        os.rename(final, final + ".old")
    os.rename(tmp, final)
    shutil.rmtree(final + ".old", ignore_errors=True)


def _prune(root: str, keep_last: int, saved_step: int, keep: set = frozenset()) -> None:
    """Delete all but the newest ``keep_last`` complete checkpoints up to ``saved_step`` (the one just saved).
    Newer ones (kept by a run resumed from an older checkpoint), the names in ``keep`` (the best one),
    ``*.tmp`` writes and directories set aside (``*.damaged-*``, ``*.replaced-*``) are never deleted."""
    if keep_last <= 0:
        return
    complete = [n for n in complete_checkpoints(root) if step_of(n) is not None and step_of(n) <= saved_step]
    for name in sorted(complete, key=step_of)[:-keep_last]:
        if name not in keep:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


# ----------------------------------------------------------------------------------------------
# Load
# ----------------------------------------------------------------------------------------------
def load_checkpoint(cfg: Any, ckpt: str, meta: dict, model, optimizer, scheduler, method) -> tuple[int, int]:
    """Load into already built model/optimizer; returns ``(step, consumed_samples)``.

    With ``checkpoint.load_optimizer=false`` only the weights are loaded and training restarts at step 0.
    """
    saved = meta["layout"]
    same_layout = (saved["tensor"], saved["pipeline"], saved["distributed_optimizer"]) == (
        cfg.parallel.tensor, cfg.parallel.pipeline, cfg.parallel.distributed_optimizer)
    same_world = same_layout and saved.get("world_size") == world_size()
    full = cfg.checkpoint.load_optimizer
    if full and saved["distributed_optimizer"] != cfg.parallel.distributed_optimizer:
        raise CheckpointError(
            f"checkpoint {ckpt} was saved with parallel.distributed_optimizer={saved['distributed_optimizer']}; "
            f"use the same setting or checkpoint.load_optimizer=false to load the weights only")
    if full and _uses_distopt(model):
        _materialise_distopt_state(optimizer)
    held = _load_base(ckpt, meta, [chunk.module for chunk in model], cfg)
    request = _sharded_state(model, optimizer, scheduler, method, 0, 0, True, with_optimizer=full,
                             with_rng=full and same_world, keep=None if held is None else held.__contains__)
    state = _load(request, ckpt)
    for i, chunk in enumerate(model):
        missing, unexpected = chunk.module.load_state_dict(state[_model_key(i, len(model))], strict=held is None)
        if held is not None and (unexpected or held & set(missing)):
            raise CheckpointError(f"checkpoint {ckpt} does not fit the model: missing "
                                  f"{sorted(held & set(missing))[:3]}, unexpected {unexpected[:3]}")
    if not full:
        return 0, 0
    configured = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    with torch.no_grad():  # fp32 main params are views of the (grad-requiring) model params
        optimizer.load_state_dict(state["optimizer"])
    for group, settings in zip(optimizer.param_groups, configured):  # the config's lr, betas, ... apply on resume
        group.update(settings)
    if state.get("adam_step") is not None:
        _set_adam_step(optimizer, state["adam_step"])
    scheduler.load_state_dict(state["scheduler"])
    method.load_state_dict(state.get("method", {}))
    if "rng_state" in state:
        _set_rng_state(state["rng_state"])
    return int(state["step"]), int(state["consumed_samples"])


def _load(request: dict, ckpt: str) -> dict:
    """``dist_checkpointing.load``; a truncated or corrupt checkpoint raises one CheckpointError naming the
    checkpoint to use instead. The index (``.metadata``) is read first: torch would log a traceback for it."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        FileSystemReader(ckpt).read_metadata()
        return dist_checkpointing.load(request, ckpt)
    except READ_ERRORS as e:
        raise CheckpointError(f"checkpoint {ckpt} could not be read ({error_cause(e)}); it is truncated or corrupt - "
                              f"{other_checkpoint(ckpt)}") from None


def _materialise_distopt_state(optimizer) -> None:
    """The distributed optimizer can only describe its state for loading once Adam's state exists
    (megatron asserts on the shared step counter). Take one step with zero gradients at lr 0 so the
    parameters stay unchanged; the loaded state replaces the dummy one."""
    for opt in _inner_optimizers(optimizer):
        if opt.state:
            continue
        saved_lr = [g["lr"] for g in opt.param_groups]
        for g in opt.param_groups:
            g["lr"] = 0.0
            for p in g["params"]:
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad()
        for g, lr in zip(opt.param_groups, saved_lr):
            g["lr"] = lr


def _load_base(ckpt: str, meta: dict, chunks: list, cfg: Any,
               skip: Callable[[str], bool] = lambda name: False) -> Optional[set[str]]:
    """For a checkpoint that holds only a frozen-base method's parameters: load its base into ``chunks`` and
    return the names the checkpoint holds itself; None for a checkpoint that holds the whole model."""
    if not meta.get("base"):
        return None
    path = base_reference.resolve(ckpt, meta)
    held = base_reference.held_names(ckpt, chunks)
    if meta["base"]["kind"] == "hf":
        if cfg is None:
            raise CheckpointError(f"checkpoint {ckpt}: loading its Hugging Face base needs the run's config")
        hf_loading.load_hf_into_model(path, chunks, cfg, skip=lambda name: name in held or skip(name))
    else:
        load_weights(path, chunks, cfg, added=lambda name: name in held or skip(name))
    return held


def load_weights(ckpt: str, model_chunks: list, cfg: Any = None,
                 added: Callable[[str], bool] = lambda name: False) -> dict:
    """Load only the model weights of ``ckpt`` into unwrapped chunks (any TP/PP layout); returns meta.

    ``ckpt`` may also be a run directory or checkpoints root (its ``latest`` is used). With ``cfg``
    the checkpoint's model shape is checked against ``cfg.model`` first. ``added(name)``: parameters a
    method adds to the model (LESS's kernels), which a base checkpoint does not hold: left as built.
    """
    ckpt = find_checkpoint(ckpt)
    meta = read_meta(ckpt)
    if cfg is not None:
        check_model_shape(ckpt, meta, cfg)
    held = _load_base(ckpt, meta, model_chunks, cfg, added)  # a frozen-base method's checkpoint: its base first

    def wanted(name: str) -> bool:
        return not added(name) and (held is None or name in held)

    request = {_model_key(i, len(model_chunks)): {k: v for k, v in c.sharded_state_dict().items() if wanted(k)}
               for i, c in enumerate(model_chunks)}
    state = _load(request, ckpt) if any(request.values()) else request  # all it holds is skipped
    for i, chunk in enumerate(model_chunks):
        missing, unexpected = chunk.load_state_dict(state[_model_key(i, len(model_chunks))], strict=False)
        if unexpected or [k for k in missing if wanted(k)]:
            raise CheckpointError(f"checkpoint {ckpt} does not fit the model: missing "
                                  f"{[k for k in missing if wanted(k)][:3]}, unexpected {unexpected[:3]}")
    return meta


def save_weights(cfg: Any, model_chunks: list, out: str, extra_meta: Optional[dict] = None) -> str:
    """Write a weights-only checkpoint of unwrapped chunks to the directory ``out`` (loadable with
    ``checkpoint.init_from=<out>`` at any TP/PP layout). Written under ``out.tmp`` and renamed, so an
    existing ``out`` is replaced only by a complete checkpoint."""
    out = os.path.abspath(out)
    tmp = out + ".tmp"
    _write_sharded({_model_key(i, len(model_chunks)): c.sharded_state_dict() for i, c in enumerate(model_chunks)},
                   tmp)
    if is_rank0():
        publish_weights(cfg, tmp, out, extra_meta)
    barrier()
    return out


def publish_weights(cfg: Any, tmp: str, out: str, extra_meta: Optional[dict] = None) -> None:
    """Rank 0: complete the weights-only checkpoint written into ``tmp`` and rename it to ``out``."""
    _publish(cfg, tmp, out, _meta(cfg, 0, 0, False, {"weights_only": True, **(extra_meta or {})}))
