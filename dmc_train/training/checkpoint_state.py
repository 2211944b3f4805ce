"""What a training checkpoint holds, as megatron ``dist_checkpointing`` sharded state.

Model weights (reshardable to any TP/PP layout), optimizer state, LR scheduler, step, consumed samples,
Adam's update count, RNG states (restored only for the same layout) and the method's state. Optimizer
state reshards with the standard (non-distributed) optimizer; the distributed optimizer's
``dp_reshardable`` format only changes DP size (:func:`~dmc_train.training.checkpoint_resume.resolve_resume`
refuses a TP/PP change with it). A method that freezes the base (LESS) stores only its own parameters
(``keep``; :mod:`~dmc_train.training.base_reference`).
"""

from __future__ import annotations

import random
from typing import Callable, Optional

import numpy as np
import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from dmc_train import distributed

DISTOPT_FORMAT = "dp_reshardable"


def model_key(i: int, n: int) -> str:
    """The state-dict key of model chunk ``i`` of ``n`` (one per virtual pipeline stage)."""
    return "model" if n == 1 else f"model{i}"


def sharded_state(model, optimizer, scheduler, method, step, consumed, is_loading,
                  with_optimizer=True, with_rng=True, keep: Optional[Callable[[str], bool]] = None) -> dict:
    """The sharded state of a training checkpoint; ``keep``: only these model parameters (a frozen-base
    method's own, :mod:`~dmc_train.training.base_reference`), and the optimizer state of those."""
    sd: dict = {}
    for i, chunk in enumerate(model):
        sd[model_key(i, len(model))] = {k: v for k, v in chunk.module.sharded_state_dict().items()
                                        if keep is None or keep(k)}
    if with_optimizer:
        model_sd = {k: v for k, v in sd.items()}
        kwargs = {"metadata": {"distrib_optim_sharding_type": DISTOPT_FORMAT}} if uses_distopt(model) else {}
        sd["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, **kwargs)
        sd["scheduler"] = scheduler.state_dict()
        sd["method"] = method.state_dict()
    if with_rng:
        sd["rng_state"] = _rng_state()
    sd["step"] = step
    sd["consumed_samples"] = consumed
    sd["adam_step"] = _adam_step(optimizer) if with_optimizer else None
    return sd


def uses_distopt(model) -> bool:
    return model[0].ddp_config.use_distributed_optimizer


def _rng_state() -> ShardedObject:
    kind = distributed.device().type
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if kind == "cuda" else None,
        # megatron's tracker holds the generator states of the device trained on (the CPU generator's without
        # a GPU: the compatibility layer); they only restore on the same kind of device
        "tracker_device": kind,
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


def set_rng_state(state: dict) -> Optional[str]:
    """Restore the RNG states ``sharded_state`` saved (python, numpy, torch, CUDA, megatron's tracker). The GPU's
    and the tracker's are restored only on the kind of device they were saved on; returns a note saying so
    otherwise (a GPU checkpoint resumed on CPU or the reverse: the training's own randomness continues, as DMC's
    noise is seeded by its coordinates and the data order by the step), else None."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    saved_on = state.get("tracker_device", "cpu")  # checkpoints from before GPUs ran were written on CPU
    here = distributed.device().type
    if saved_on != here:
        return (f"the checkpoint was written on {saved_on.upper()} and resumes on {here.upper()}: weights, optimizer "
                f"and data position are restored, the {saved_on.upper()} generators' states are not")
    if state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    return None


def _inner_optimizers(optimizer) -> list:
    return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]


def _adam_step(optimizer) -> int:
    """Adam's update count (bias correction); it differs from the train step after skipped updates."""
    for opt in _inner_optimizers(optimizer):
        for state in opt.state.values():
            if "step" in state:
                return int(state["step"])
    return 0


def set_adam_step(optimizer, step: int) -> None:
    """megatron's distributed optimizer (dp_reshardable) does not restore Adam's step counter."""
    for opt in _inner_optimizers(optimizer):
        for state in opt.state.values():
            if "step" in state:
                state["step"] = torch.full_like(torch.as_tensor(state["step"]), step)


def materialise_distopt_state(optimizer) -> None:
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
