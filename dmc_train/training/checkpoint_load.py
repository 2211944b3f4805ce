"""Reading checkpoints into built models: a training checkpoint on resume, or the weights only.

Both read at any TP/PP layout (megatron ``dist_checkpointing`` reshards the model weights). A
checkpoint of a frozen-base method (LESS) holds only the method's parameters: its base is loaded first
(:mod:`base_reference`), then the checkpoint's own tensors over it. A truncated or corrupt checkpoint
is one CheckpointError naming the checkpoint to use instead.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from megatron.core import dist_checkpointing

from dmc_train import distributed
from dmc_train.distributed import world_size
from dmc_train.errors import CheckpointError
from dmc_train.training import base_reference, hf_loading
from dmc_train.training.checkpoint_dirs import check_model_shape, find_checkpoint, other_checkpoint, read_meta
from dmc_train.training.checkpoint_errors import READ_ERRORS, error_cause
from dmc_train.training.checkpoint_state import (
    materialise_distopt_state,
    model_key,
    set_adam_step,
    set_rng_state,
    sharded_state,
    uses_distopt,
)


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
    if full and uses_distopt(model):
        materialise_distopt_state(optimizer)
    held = _load_base(ckpt, meta, [chunk.module for chunk in model], cfg)
    request = sharded_state(model, optimizer, scheduler, method, 0, 0, True, with_optimizer=full,
                            with_rng=full and same_world, keep=None if held is None else held.__contains__)
    state = _load(request, ckpt)
    for i, chunk in enumerate(model):
        missing, unexpected = chunk.module.load_state_dict(state[model_key(i, len(model))], strict=held is None)
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
        set_adam_step(optimizer, state["adam_step"])
    scheduler.load_state_dict(state["scheduler"])
    method.load_state_dict(state.get("method", {}))
    if "rng_state" in state:
        note = set_rng_state(state["rng_state"])
        if note and distributed.is_rank0():
            print(f"note: {note}", flush=True)
    return int(state["step"]), int(state["consumed_samples"])


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

    request = {model_key(i, len(model_chunks)): {k: v for k, v in c.sharded_state_dict().items() if wanted(k)}
               for i, c in enumerate(model_chunks)}
    state = _load(request, ckpt) if any(request.values()) else request  # all it holds is skipped
    for i, chunk in enumerate(model_chunks):
        missing, unexpected = chunk.load_state_dict(state[model_key(i, len(model_chunks))], strict=False)
        if unexpected or [k for k in missing if wanted(k)]:
            raise CheckpointError(f"checkpoint {ckpt} does not fit the model: missing "
                                  f"{[k for k in missing if wanted(k)][:3]}, unexpected {unexpected[:3]}")
    return meta


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
