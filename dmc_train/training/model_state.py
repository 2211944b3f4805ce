"""A checkpoint's model weights as one full (TP=1) state dict, read straight from its files in one
process: no model is built, no process group is started and no environment variable is set.

    state, saved = read_model_state("runs/dmc_tiny_cr2.0")   # {GPTModel state-dict name: tensor}, SavedRun
    saved.cfg, saved.checkpoint, saved.meta                    # the saved config (at TP=1 PP=1), path, meta.json

The inference model (``inference/model.py``) loads this way, so an engine in a process leaves that
process as it found it (a child ``launch/generate.py`` or a later ``torchrun`` picks its own port).
``training.model_loading.load_model`` still builds the megatron model, for the training forward.

What the files hold (megatron ``dist_checkpointing``, ``torch_dist`` backend; see
:mod:`~dmc_train.training.streaming_checkpoint`): GLOBAL tensors under megatron's sharded keys, whatever
TP/PP layout saved them. A layer's tensor is stacked over the layers under one key without the layer
number (axis 0 = the global layer number): ``decoder.layers.mlp.linear_fc2.weight [layers, hidden, ffn]``.
The layer norms are stored under the names of the fused modules; our layer spec's
``sharded_state_dict_keys_map`` (``input_layernorm.`` -> ``self_attention.linear_qkv.layer_norm_``) gives
them back their state-dict names. Optimizer state, RNG state and ``_extra_state`` objects are not read.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dmc_train.errors import CheckpointError
from dmc_train.models.llama import llama_layer_spec
from dmc_train.recipes import validate
from dmc_train.training.base_reference import base_state
from dmc_train.training.checkpoint_dirs import check_model_shape, find_checkpoint, read_meta
from dmc_train.training.checkpoint_errors import READ_ERRORS, error_cause
from dmc_train.training.model_loading import config_from_checkpoint

__all__ = ["SavedRun", "read_model_state"]

#: first component of the sharded keys of a GPTModel's tensors (the rest: optimizer, rng_state, ...)
_MODEL_PREFIXES = ("embedding", "decoder", "output_layer")
_LAYERS = "decoder.layers."


@dataclass(frozen=True)
class SavedRun:
    """What a checkpoint says about itself: its config (TP=1 PP=1), its directory and ``meta.json``."""

    cfg: Any
    checkpoint: str
    meta: dict


def read_model_state(checkpoint: str) -> tuple[dict[str, torch.Tensor], SavedRun]:
    """``(state, saved)``: every model tensor of ``checkpoint`` (a checkpoint, checkpoints root or run
    directory) in ``GPTModel`` state-dict names with global layer numbers, full TP=1 shapes and the
    dtypes it was saved in; ``saved`` its config at TP=1 PP=1, checked like ``load_model``'s."""
    ckpt = find_checkpoint(checkpoint)
    meta = read_meta(ckpt)
    cfg = config_from_checkpoint(meta, ["parallel.tensor=1", "parallel.pipeline=1", "parallel.virtual_pipeline=null"])
    validate(cfg, 1)
    check_model_shape(ckpt, meta, cfg)
    reader = FileSystemReader(ckpt)
    try:
        stored = reader.read_metadata().state_dict_metadata
        keys = {k: v for k, v in stored.items()
                if isinstance(v, TensorStorageMetadata) and k.split(".")[0] in _MODEL_PREFIXES}
        sharded = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in keys.items()}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp_load(sharded, storage_reader=reader, no_dist=True)
    except READ_ERRORS as e:
        raise CheckpointError(f"checkpoint {ckpt} could not be read ({error_cause(e)}); it is truncated or "
                              f"corrupt") from None
    state = _state_dict_names(sharded)
    if meta.get("base"):  # a frozen-base method's checkpoint (LESS): its own tensors over its base's
        state = {**base_state(ckpt, meta, lambda path: read_model_state(path)[0]), **state}
    return state, SavedRun(cfg, ckpt, meta)


def _state_dict_names(sharded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Sharded keys -> state-dict names: a stacked layer tensor ``[layers, ...]`` becomes one tensor per
    layer, ``decoder.layers.<i>.<name>``, with the fused-module names of the norms undone."""
    renames = {fused: name for name, fused in llama_layer_spec().submodules.sharded_state_dict_keys_map.items()}
    state = {}
    for key, value in sharded.items():
        if not key.startswith(_LAYERS):
            state[key] = value
            continue
        name = key[len(_LAYERS):]
        for fused, plain in renames.items():
            if name.startswith(fused):
                name = plain + name[len(fused):]
        for i, layer in enumerate(value.unbind(0)):
            state[f"{_LAYERS}{i}.{name}"] = layer
    return state
