"""Weights-only checkpoints written and read tensor by tensor, without building the model.

    save_weights_streaming(cfg, tensor_of, out, extra_meta)        # the files save_weights writes
    CheckpointTensors(ckpt, checkpoint_config(ckpt)).read(names)   # some full TP=1 tensors back

What a checkpoint of ours stores (megatron ``dist_checkpointing``, ``torch_dist`` backend): GLOBAL
tensors, whatever the layout that saved them. The keys are megatron's ``sharded_state_dict`` keys: a
layer's parameters are stacked over the layers under one key without the layer number
(``decoder.layers.self_attention.linear_qkv.weight [num_layers, rows, hidden]``, layer ``i`` at offset
``i`` of the first axis, ``i`` the global 0-based layer number at any PP/VPP), the norms under the names
of the fused modules (``input_layernorm`` -> ``self_attention.linear_qkv.layer_norm_weight``), fc1 as
two chunks (gate rows, then up rows), the other tensors whole; ``_extra_state`` entries are pickled
objects (``<key>/shard_<i>_<layers>``). A save at TP=2 or PP=2 writes the same keys and global shapes,
only cut into other chunks; the loader reassembles any chunking.

Where that layout comes from: megatron itself. The model is built on the ``meta`` device (no memory),
its ``sharded_state_dict()`` is preprocessed and translated exactly as megatron's ``torch_dist`` save
does, and torch.distributed.checkpoint's ``FileSystemWriter`` writes the items through a planner whose
``resolve_data`` produces each chunk's tensor only when the writer asks for it (one thread: in plan
order, one at a time). ``common.pt`` and ``metadata.json`` come from megatron's own functions. So the
files equal those :func:`~dmc_train.training.checkpoint_save.save_weights` writes for a TP=1 model with
the same weights (same keys, chunks, dtypes and bytes; tested). Memory: the tensor being converted,
plus what the writer keeps: ``FileSystemWriter`` holds a reference to the last chunk it wrote of every
key until the file is closed (a layer's chunks, the embedding and the output layer), not the model.
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Callable, Optional

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
from megatron.core.dist_checkpointing.serialization import (
    get_default_save_common_strategy,
    get_default_save_sharded_strategy,
)
from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.planner import WriteItemType

from dmc_train.distributed import barrier, world_size
from dmc_train.errors import CheckpointError, ConfigError, UserError
from dmc_train.models.llama import build_model
from dmc_train.training.checkpoint_dirs import find_checkpoint, read_meta
from dmc_train.training.checkpoint_errors import READ_ERRORS, error_cause
from dmc_train.training.checkpoint_save import publish_weights

__all__ = ["meta_model", "save_weights_streaming", "CheckpointTensors", "checkpoint_config"]

#: ``tensor_of(global megatron name, full TP=1 shape) -> tensor``: the full TP=1 tensor of one parameter
#: (any dtype; it is cast to the checkpoint's). Global names are ``GPTModel`` state-dict names with the
#: global 0-based layer number (``decoder.layers.7.mlp.linear_fc1.weight``).
TensorFn = Callable[[str, tuple[int, ...]], torch.Tensor]


def meta_model(cfg: Any) -> torch.nn.Module:
    """The TP=1 PP=1 ``GPTModel`` of ``cfg`` on the ``meta`` device (shapes and dtypes only, no memory).
    Needs megatron's parallel state at TP=1 PP=1 (``distributed.initialize(1, 1, None, seed)``)."""
    if world_size() != 1 or cfg.parallel.tensor != 1 or cfg.parallel.pipeline != 1:
        raise ConfigError("a streamed weights-only checkpoint is written in one process at TP=1 PP=1")
    with torch.device("meta"):
        (chunk,) = build_model(cfg)
    return chunk


def _sources(sharded: dict) -> dict[tuple[str, tuple[int, ...]], tuple[str, tuple[slice, ...], torch.dtype]]:
    """``(key, global offset of the chunk) -> (global megatron name, slices of the full TP=1 tensor, dtype)``
    for every tensor chunk of a TP=1 PP=1 chunk's factory-applied sharded state dict (names are global
    at PP=1; fc1's factory became a gate and an up ShardedTensor)."""
    out = {}
    for name, value in sharded.items():
        for sh in nested_values(value) if isinstance(value, (dict, list)) else [value]:
            if isinstance(sh, ShardedTensor):
                offsets = sh.global_offset[sh.prepend_axis_num:]
                slices = tuple(slice(o, o + n) for o, n in zip(offsets, sh.local_shape))
                out[(sh.key, tuple(sh.global_offset))] = (name, slices, sh.dtype)
    return out


class _StreamingPlanner(MCoreSavePlanner):
    """megatron's save planner whose tensor data is produced on demand by ``tensor_of`` (the full TP=1
    tensor of the parameter, kept until another parameter is asked for, so fc1's gate and up chunks
    share one read), sliced to the write item's chunk and cast to its dtype."""

    def __init__(self, sources: dict, shapes: dict[str, tuple[int, ...]], tensor_of: TensorFn):
        super().__init__(dedup_replicated_tensors=False, flatten_state_dict=False)
        self.sources, self.shapes, self.tensor_of = sources, shapes, tensor_of
        self._last: tuple[Optional[str], Optional[torch.Tensor]] = (None, None)
        self.error: Optional[UserError] = None  # torch.distributed.checkpoint wraps what resolve_data raises

    def resolve_data(self, write_item):
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        name, slices, dtype = self.sources[(write_item.index.fqn, tuple(write_item.index.offset))]
        if self._last[0] != name:
            self._last = (None, None)  # drop the previous tensor before reading the next
            try:
                self._last = (name, self.tensor_of(name, self.shapes[name]))
            except UserError as e:
                self.error = e
                raise
        chunk = self._last[1][slices].to(dtype).reshape(write_item.tensor_data.chunk.sizes)
        return chunk.contiguous()


def save_weights_streaming(cfg: Any, tensor_of: TensorFn, out: str, extra_meta: Optional[dict] = None) -> str:
    """Write the weights-only checkpoint ``out`` of the TP=1 model of ``cfg`` whose tensors ``tensor_of``
    gives, one at a time, cast to ``cfg.train.precision``; an error of ``tensor_of`` (a missing tensor,
    a wrong shape) is re-raised as it is, with nothing written. The files are
    those :func:`~dmc_train.training.checkpoint_save.save_weights` writes; as there, everything is written
    under ``out.tmp`` and renamed (``meta.json`` last). One process, distributed state at TP=1 PP=1.
    Returns ``out``."""
    out = os.path.abspath(out)
    tmp = out + ".tmp"
    chunk = meta_model(cfg)
    shapes = {name: tuple(p.shape) for name, p in chunk.state_dict().items() if isinstance(p, torch.Tensor)}
    # megatron's torch_dist save, step by step (serialization.save, TorchDistSaveShardedStrategy.async_save)
    sharded, common = save_preprocess({"model": chunk.sharded_state_dict()}, validate_access_integrity=False)
    flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    get_default_save_common_strategy().save_common(common, tmp)
    planner = _StreamingPlanner(_sources(sharded["model"]), shapes, tensor_of)
    try:
        dcp_save(mcore_to_pyt_state_dict(flat, False), storage_writer=FileSystemWriter(tmp, thread_count=1),
                 planner=planner)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if planner.error is not None:  # the one-line error of tensor_of, not DCP's wrapper around it
            raise planner.error from None
        raise
    strategy = get_default_save_sharded_strategy()
    save_config(CheckpointingConfig(strategy.backend, strategy.version), tmp)
    publish_weights(cfg, tmp, out, extra_meta)
    barrier()
    return out


class CheckpointTensors:
    """Full TP=1 tensors of a checkpoint of ours, read a few at a time with megatron's own loader
    (``dist_checkpointing.load``). A layer's tensor is requested as the one chunk ``[1, *shape]`` at the
    layer's offset of the stacked global tensor (a plain ``ShardedTensor``, as a partial load needs), so
    only the requested tensors are read and held, in the checkpoint's dtype. ``cfg`` is the
    checkpoint's config (:func:`checkpoint_config`). One process, distributed state at TP=1 PP=1."""

    def __init__(self, ckpt: str, cfg: Any):
        self.ckpt = find_checkpoint(ckpt)
        sharded = meta_model(cfg).sharded_state_dict()
        apply_factories(sharded)
        #: global megatron name -> (key, global shape, offset along the layer axis or None, dtype)
        self.entries: dict[str, tuple[str, tuple[int, ...], Optional[int], torch.dtype]] = {}
        for name, value in sharded.items():
            parts = [v for v in (nested_values(value) if isinstance(value, (dict, list)) else [value])
                     if isinstance(v, ShardedTensor)]
            if parts:
                sh = parts[0]
                layer = sh.global_offset[0] if sh.prepend_axis_num else None
                self.entries[name] = (sh.key, tuple(sh.global_shape), layer, sh.dtype)

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """``{global megatron name: full TP=1 tensor}`` for ``names`` (e.g. one layer's parameters)."""
        request = {}
        for name in names:
            if name not in self.entries:
                raise CheckpointError(f"the model of {self.ckpt} has no parameter {name}")
            key, shape, layer, dtype = self.entries[name]
            if layer is None:
                request[name] = ShardedTensor.from_rank_offsets(key, torch.empty(shape, dtype=dtype))
            else:
                request[name] = ShardedTensor.from_rank_offsets(key, torch.empty((1, *shape[1:]), dtype=dtype),
                                                                (0, layer, shape[0]))
        try:
            state = dist_checkpointing.load(request, self.ckpt, validate_access_integrity=False)
        except READ_ERRORS as e:
            raise CheckpointError(f"checkpoint {self.ckpt} could not be read ({error_cause(e)}); it is truncated "
                                  f"or corrupt") from None
        return {name: state[name][0] if self.entries[name][2] is not None else state[name] for name in names}


def checkpoint_config(ckpt: str) -> Any:
    """The config saved with ``ckpt``, at TP=1 PP=1 (what :class:`CheckpointTensors` needs)."""
    from dmc_train.training.model_loading import config_from_checkpoint

    return config_from_checkpoint(read_meta(find_checkpoint(ckpt)), ["parallel.tensor=1", "parallel.pipeline=1",
                                                                     "parallel.virtual_pipeline=null"])
