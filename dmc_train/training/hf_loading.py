"""Hugging Face Llama weights straight into this rank's megatron-core chunks (any TP/PP/VPP layout).

    weights = HFWeights("llama-2-7b-hf")          # lazy: safetensors (single or sharded) or .bin (+ index)
    load_hf_into_model("llama-2-7b-hf", chunks, cfg)

Used by ``checkpoint.init_from=<HF dir>`` in the trainer and by the importer
(:mod:`dmc_train.conversion.hf_import`). It lives in ``training/`` rather than ``conversion/`` because the
trainer (layer 8) may not import ``conversion/`` (layer 9).

Memory: one parameter at a time. For each local parameter the full (TP=1) tensor is built from the
Hugging Face tensor(s) (safetensors ``safe_open`` / ``torch.load(mmap=True)`` read only that tensor),
this rank's shard is copied into the parameter, and the full tensor is dropped. Peak: the model shard
plus one full tensor (two for the fused QKV / fc1 while they are merged).

Tensor-parallel rules (checked against megatron's own resharding in ``tests/conversion``):

- column parallel, split dim 0 into TP contiguous chunks: ``linear_qkv`` (whole query groups per rank,
  as the fused layout is ordered by group), ``output_layer``, ``embedding.word_embeddings`` (vocab parallel)
- row parallel, split dim 1: ``linear_proj``, ``linear_fc2``
- ``linear_fc1``: rank r holds ``cat([gate_r, up_r])``, gate and up chunked separately
- norms: replicated
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Callable, Iterator

import torch
from megatron.core import parallel_state

from dmc_train.config import kv_groups
from dmc_train.errors import CheckpointError, ConfigError
from dmc_train.models.hf_config import model_config_from_hf, rope_scaling_fields
from dmc_train.models.llama_weights import hf_names, merge_fc1, merge_qkv

SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
BIN, BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
_SKIP = re.compile(r"(^|\.)_extra_state$")
_COLUMN = ("self_attention.linear_qkv.weight", "output_layer.weight", "embedding.word_embeddings.weight")
_ROW = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
SHAPE_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                "vocab_size", "rotary_base", "norm_epsilon")


def is_hf_dir(path: str) -> bool:
    """A Hugging Face model directory (``config.json``), not one of our checkpoints (``meta.json``)."""
    return (os.path.isfile(os.path.join(path, "config.json"))
            and not os.path.exists(os.path.join(path, "meta.json")))


def read_hf_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"{hf_dir} is not a Hugging Face model directory (no config.json)")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} cannot be read ({str(e).splitlines()[0]}); re-download the model") from None


def check_hf_model_shape(hf_dir: str, cfg: Any) -> None:
    """One-line ConfigError if ``hf_dir``'s config.json is not a Llama the project can load
    (:func:`~dmc_train.models.hf_config.model_config_from_hf`) or not of ``cfg.model``'s shape."""
    theirs = model_config_from_hf(read_hf_config(hf_dir))
    theirs["num_query_groups"] = theirs["num_query_groups"] or theirs["num_attention_heads"]
    ours = {k: cfg.model.get(k) for k in SHAPE_FIELDS}
    ours["num_query_groups"] = kv_groups(cfg.model)
    diffs = [f"{k}: config.json {theirs[k]} vs config {ours[k]}" for k in SHAPE_FIELDS
             if float(theirs[k]) != float(ours[k])]
    if theirs["rope_scaling"] != rope_scaling_fields(cfg.model):
        diffs.append(f"rope_scaling: config.json {theirs['rope_scaling']} vs config {rope_scaling_fields(cfg.model)}")
    if theirs["tie_embeddings"] != bool(cfg.model.get("tie_embeddings", False)):
        diffs.append(f"tie_embeddings: config.json {theirs['tie_embeddings']} vs config "
                     f"{bool(cfg.model.get('tie_embeddings', False))}")
    if diffs:
        raise ConfigError(f"checkpoint.init_from={hf_dir} has a different model shape ({'; '.join(diffs)}); "
                          f"use the matching model config (checkpoints_tools/import_hf.py writes one)")


class HFWeights:
    """Lazy, read-only access to the tensors of a Hugging Face model directory, by HF name.

    Formats: ``model.safetensors``, sharded safetensors with ``model.safetensors.index.json``,
    ``pytorch_model.bin`` and sharded ``.bin`` with ``pytorch_model.bin.index.json`` (memory-mapped,
    ``weights_only``). Every shard is opened (headers validated) up front, so a missing or truncated
    shard fails before any weight is copied. :meth:`get` returns the stored tensor (its stored dtype).

    No shard stays open: :meth:`get` opens the shard, takes the one tensor and lets the handle go. A
    handle maps its whole file, and every page read through it stays in the process's resident set
    until the handle is closed, so holding the handles would make reading all tensors cost the whole
    model in RSS. This way only the tensors the caller still holds are resident.
    """

    def __init__(self, hf_dir: str):
        self.dir = hf_dir
        if not os.path.isdir(hf_dir):
            raise CheckpointError(f"Hugging Face model directory {hf_dir} does not exist")
        self._where: dict[str, str] = {}  # tensor name -> shard file name
        for index, single in ((SAFETENSORS_INDEX, SAFETENSORS), (BIN_INDEX, BIN)):
            if os.path.isfile(os.path.join(hf_dir, index)):
                self._where = self._read_index(index)
                break
            if os.path.isfile(os.path.join(hf_dir, single)):
                self._where = {name: single for name in self._open(single).keys()}
                break
        else:
            raise CheckpointError(f"{hf_dir} holds no weights ({SAFETENSORS}, {SAFETENSORS_INDEX}, {BIN} or "
                                  f"{BIN_INDEX}); download the model's weight files too")
        for shard in sorted(set(self._where.values())):
            keys = set(self._open(shard).keys())
            listed = [n for n, s in self._where.items() if s == shard and n not in keys]
            if listed:
                raise CheckpointError(f"shard {os.path.join(hf_dir, shard)} lacks {listed[0]} that the index lists; "
                                      f"the download is incomplete or the index is stale")

    def _read_index(self, index: str) -> dict[str, str]:
        path = os.path.join(self.dir, index)
        try:
            with open(path) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{path} is not a valid weight index ({type(e).__name__}); re-download it") from None
        return dict(weight_map)

    def _open(self, shard: str):
        path = os.path.join(self.dir, shard)
        if not os.path.isfile(path):
            raise CheckpointError(f"weight shard {path} is missing; download it (the index lists it)")
        try:
            if shard.endswith(".safetensors"):
                from safetensors import safe_open

                handle = safe_open(path, framework="pt")
            else:
                handle = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                if not isinstance(handle, dict):
                    raise TypeError(f"a {type(handle).__name__}, not a state dict")
        except CheckpointError:
            raise
        except Exception as e:  # safetensors/pickle/zip raise many types for a truncated or corrupt file
            msg = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
            raise CheckpointError(f"weight shard {path} cannot be read ({msg}); it is truncated or corrupt - "
                                  f"re-download it") from None
        return handle

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise CheckpointError(f"{self.dir} has no tensor {name}; it is not a complete Llama checkpoint")
        handle = self._open(self._where[name])
        try:
            return handle.get_tensor(name) if hasattr(handle, "get_tensor") else handle[name]
        except Exception as e:
            raise CheckpointError(f"tensor {name} of {os.path.join(self.dir, self._where[name])} cannot be read "
                                  f"({str(e).splitlines()[0][:160]}); the shard is truncated or corrupt") from None


# ----------------------------------------------------------------------------------------------
# Loading into megatron chunks
# ----------------------------------------------------------------------------------------------
def local_parameters(chunk: torch.nn.Module) -> Iterator[tuple[str, str, torch.nn.Parameter]]:
    """``(local name, global TP=1 name, parameter)`` of one chunk: the layers' local index is replaced
    by their global 0-based number (megatron's ``layer_number`` is global and 1-based)."""
    layers = chunk.decoder.layers
    for name, param in chunk.named_parameters():
        if _SKIP.search(name):
            continue
        m = re.match(r"decoder\.layers\.(\d+)\.", name)
        global_name = name
        if m is not None:
            global_name = f"decoder.layers.{layers[int(m.group(1))].layer_number - 1}.{name[m.end():]}"
        yield name, global_name, param


def _partition_dim(name: str) -> int | None:
    if name.endswith(_COLUMN) or name.endswith("mlp.linear_fc1.weight"):
        return 0
    if name.endswith(_ROW):
        return 1
    return None


def tp_shard(name: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s tensor-parallel shard of the full (TP=1) megatron tensor ``name``."""
    if tp == 1:
        return full
    if name.endswith("mlp.linear_fc1.weight"):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]])
    dim = _partition_dim(name)
    return full if dim is None else full.chunk(tp, dim=dim)[rank]


def _full_shape(name: str, local: torch.Size, tp: int) -> tuple[int, ...]:
    shape = list(local)
    dim = _partition_dim(name)
    if dim is not None:
        shape[dim] *= tp
    return tuple(shape)


def _check(hf_dir: str, names: tuple[str, ...], tensors: list[torch.Tensor], want: list[tuple[int, ...]]) -> None:
    for n, t, w in zip(names, tensors, want):
        if tuple(t.shape) != tuple(w):
            raise CheckpointError(f"{hf_dir}: tensor {n} has shape {tuple(t.shape)} but the model config needs "
                                  f"{tuple(w)}; the config.json and the weights (or the run's model config) differ")


def full_tensor(weights: HFWeights, global_name: str, full_shape: tuple[int, ...], cfg: Any,
                tied: bool) -> torch.Tensor:
    """The full (TP=1) megatron tensor ``global_name`` built from the Hugging Face tensor(s), shape-checked."""
    m = cfg.model
    heads, groups = m.num_attention_heads, kv_groups(m)
    names = hf_names(global_name)
    if names == ("lm_head.weight",) and "lm_head.weight" not in weights and tied:
        names = ("model.embed_tokens.weight",)  # tied embeddings: the output layer is the embedding
    parts = [weights.get(n) for n in names]
    hidden = full_shape[-1]
    if global_name.endswith("linear_qkv.weight"):
        d = full_shape[0] // (heads + 2 * groups)
        _check(weights.dir, names, parts, [(heads * d, hidden), (groups * d, hidden), (groups * d, hidden)])
        q, k, v = parts
        return merge_qkv(q.reshape(heads, d, hidden), k.reshape(groups, d, hidden), v.reshape(groups, d, hidden))
    if global_name.endswith("linear_fc1.weight"):
        _check(weights.dir, names, parts, [(full_shape[0] // 2, hidden)] * 2)
        return merge_fc1(*parts)
    _check(weights.dir, names, parts, [full_shape])
    return parts[0]


@torch.no_grad()
def load_hf_into_model(hf_dir: str, chunks: list, cfg: Any,
                       skip: Callable[[str], bool] = lambda name: False) -> dict:
    """Fill this rank's unwrapped chunks (``GPTModel``, any TP/PP/VPP layout) with the weights of the
    Hugging Face Llama directory ``hf_dir``, one parameter at a time; returns its config.json dict.

    Every parameter of the chunks is written but those ``skip(name)`` names (a method's own, e.g. LESS's
    kernels, which a Llama does not have); a missing tensor or a shape that does not fit the model
    config is a one-line CheckpointError naming the tensor.
    """
    hf = read_hf_config(hf_dir)
    weights = HFWeights(hf_dir)
    tied = bool(hf.get("tie_word_embeddings", False))
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    for chunk in chunks:
        for _, global_name, param in local_parameters(chunk):
            if skip(global_name):
                continue
            full = full_tensor(weights, global_name, _full_shape(global_name, param.shape, tp), cfg, tied)
            param.copy_(tp_shard(global_name, full, tp, rank).to(param.dtype))
            del full
    return hf
