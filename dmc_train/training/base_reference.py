"""Checkpoints of a method that freezes the base model (LESS): its own parameters plus a reference to the base.

A method whose ``prepare_model`` freezes every base parameter says so (``Method.frozen_base``) and names the
parameters it adds (``Method.added_parameter``). A run of such a method started from a base
(``checkpoint.init_from``: a checkpoint of this project or a Hugging Face Llama directory) saves only those
parameters and their optimizer state; ``meta.json`` records the base under ``base``::

    "base": {"kind": "checkpoint",                                  # or "hf"
             "path": "/abs/runs/base_tiny/checkpoints/iter_0000600",  # the resolved checkpoint, never a run dir
             "relative": "../../../base_tiny/checkpoints/iter_0000600",  # the same, from this checkpoint
             "step": 600, "consumed_samples": 4800,                  # null for a Hugging Face base
             "model": {"num_layers": 4, "hidden_size": 256, ...}}    # the shape signature

Every reader of such a checkpoint (``checkpoint_load``'s resume and ``load_weights``: evaluation, export,
resharding; :func:`base_state` for ``model_state``'s file reader: inference) loads the base's weights first,
then the checkpoint's own tensors over them (:func:`held_names`). The base is looked for at ``path``, then at
``relative`` (a run tree moved as a whole), and must match the recorded step and shape (:func:`resolve`);
``checkpoints_tools/set_base.py`` records a base's new place (:func:`set_base`).

A run resumed from a checkpoint that holds the whole model (no ``base``: a run without ``init_from``, or
one saved before this format) keeps saving the whole model: no base is known to hold the same weights.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Optional

from omegaconf import OmegaConf

from dmc_train.config import kv_groups
from dmc_train.errors import CheckpointError
from dmc_train.training import hf_loading
from dmc_train.training.checkpoint_dirs import (
    META,
    MODEL_SHAPE_DEFAULTS,
    MODEL_SHAPE_FIELDS,
    complete_checkpoints,
    find_checkpoint,
    read_meta,
)


def _fix(ckpt: str) -> str:
    """The command that records where the base is now, for the run of ``ckpt`` (all its checkpoints)."""
    parent = os.path.dirname(os.path.abspath(ckpt))
    target = os.path.dirname(parent) if os.path.basename(parent) == "checkpoints" else ckpt
    return f"python checkpoints_tools/set_base.py --input {target} --base <where the base is now>"


def _signature(model: Any) -> dict:
    """The shape fields of a model node (``num_query_groups`` resolved: null means MHA)."""
    return {k: (kv_groups(model) if k == "num_query_groups" else model.get(k, MODEL_SHAPE_DEFAULTS.get(k)))
            for k in MODEL_SHAPE_FIELDS}


def describe(path: str, cfg: Any) -> dict:
    """The reference to the base at ``path`` (``checkpoint.init_from``: a checkpoint, run directory,
    checkpoints root or Hugging Face directory). A checkpoint that itself references a base (a frozen-base
    run's) names that base instead, so references never chain."""
    if hf_loading.is_hf_dir(path):
        hf_loading.check_hf_model_shape(path, cfg)
        return {"kind": "hf", "path": os.path.abspath(path), "step": None, "consumed_samples": None,
                "model": _signature(cfg.model)}
    ckpt = os.path.abspath(find_checkpoint(path))
    meta = read_meta(ckpt)
    if meta.get("base"):
        inner = resolve(ckpt, meta)
        return {**meta["base"], "path": inner}
    return {"kind": "checkpoint", "path": ckpt, "step": meta["step"], "consumed_samples": meta.get("consumed_samples"),
            "model": _signature(OmegaConf.create(meta["config"]["model"]))}


def for_run(cfg: Any, method: Any, resume: Optional[tuple[str, dict]]) -> Optional[dict]:
    """The base a run of ``method`` references in its checkpoints, or None (it saves the whole model): the
    resumed checkpoint's base (checked to be there), else ``checkpoint.init_from``."""
    if not method.frozen_base:
        return None
    if resume is not None:
        ckpt, meta = resume
        return {**meta["base"], "path": resolve(ckpt, meta)} if meta.get("base") else None
    return describe(cfg.checkpoint.init_from, cfg) if cfg.checkpoint.init_from else None


def record(base: dict, ckpt: str) -> dict:
    """``base`` as ``meta.json`` of the checkpoint directory ``ckpt`` records it (with the relative path)."""
    return {**base, "relative": os.path.relpath(base["path"], ckpt)}


def resolve(ckpt: str, meta: dict) -> str:
    """The path of the base that checkpoint ``ckpt`` references, checked against the recorded step and shape;
    one-line CheckpointError when it is missing or another model."""
    base = meta["base"]
    method = meta.get("method", "method")
    candidates = [base["path"]]
    if base.get("relative"):
        candidates.append(os.path.normpath(os.path.join(ckpt, base["relative"])))
    found = next((c for c in candidates if os.path.isdir(c)), None)
    if found is None:
        step = f" (step {base['step']})" if base.get("step") is not None else ""
        raise CheckpointError(f"checkpoint {ckpt} holds only the parameters of method {method}, and its base "
                              f"{base['path']}{step} is missing; put the base back there or record where it is now: "
                              + _fix(ckpt))
    check(ckpt, base, found)
    return found


def check(ckpt: str, base: dict, path: str) -> None:
    """CheckpointError unless ``path`` holds the base ``base`` describes (kind, shape, step)."""
    method_only = f"checkpoint {ckpt} holds only parameters trained on the base {base['path']}"
    if base["kind"] == "hf":
        if not hf_loading.is_hf_dir(path):
            raise CheckpointError(f"{method_only} (a Hugging Face directory); {path} is not one; "
                                  + _fix(ckpt))
        have = _signature(_hf_model(path))
        step = None
    else:
        if not os.path.isfile(os.path.join(path, META)):
            raise CheckpointError(f"{method_only}; {path} is not a complete checkpoint of this project (no {META}); "
                                  + _fix(ckpt))
        meta = read_meta(path)
        if meta.get("base"):
            raise CheckpointError(f"{method_only}; {path} holds only a method's parameters itself, not a base; "
                                  + _fix(ckpt))
        have = _signature(OmegaConf.create(meta["config"]["model"]))
        step = (meta["step"], meta.get("consumed_samples"))
    recorded = {k: base["model"].get(k, MODEL_SHAPE_DEFAULTS.get(k)) for k in MODEL_SHAPE_FIELDS}
    diffs = [f"{k} {recorded[k]} vs {have[k]}" for k in MODEL_SHAPE_FIELDS if recorded[k] != have[k]]
    if diffs:
        raise CheckpointError(f"{method_only}, and {path} is another model ({'; '.join(diffs)}): its parameters only "
                              f"run on that base; " + _fix(ckpt))
    if step is not None and step != (base["step"], base.get("consumed_samples")):
        raise CheckpointError(f"{method_only} at step {base['step']} ({base.get('consumed_samples')} samples), and "
                              f"{path} is step {step[0]} ({step[1]} samples): another state of the base; " + _fix(ckpt))


def _hf_model(path: str) -> Any:
    from dmc_train.models.hf_config import model_config_from_hf

    return OmegaConf.create(model_config_from_hf(hf_loading.read_hf_config(path)))


def saved_keys(ckpt: str) -> set[str]:
    """The global keys of the tensors and objects in the dist checkpoint ``ckpt`` (``/shard_...`` suffixes
    of sharded objects dropped)."""
    from torch.distributed.checkpoint import FileSystemReader

    return {k.split("/shard_")[0] for k in FileSystemReader(ckpt).read_metadata().state_dict_metadata}


def held_names(ckpt: str, chunks: list) -> set[str]:
    """The state-dict names of ``chunks`` (unwrapped) whose tensors the checkpoint ``ckpt`` holds itself."""
    keys = saved_keys(ckpt)
    return {name for chunk in chunks for name, v in chunk.sharded_state_dict().items()
            if getattr(v, "key", None) in keys}


def base_state(ckpt: str, meta: dict, read_checkpoint: Callable[[str], dict]) -> dict:
    """The full (TP=1) state dict of the base that checkpoint ``ckpt`` references, in ``GPTModel`` names, read
    from its files without building a model: ``read_checkpoint(path)`` reads a checkpoint of this project, a
    Hugging Face base is converted. A file reader lays the checkpoint's own tensors over it."""
    path = resolve(ckpt, meta)
    if meta["base"]["kind"] != "hf":
        return read_checkpoint(path)
    from dmc_train.models.llama_weights import hf_to_megatron

    model = _hf_model(path)
    weights = hf_loading.HFWeights(path)
    return hf_to_megatron({name: weights.get(name) for name in weights.names()}, model.num_attention_heads,
                          kv_groups(model))


def set_base(src: str, new_base: str) -> list[str]:
    """Record ``new_base`` as the base of checkpoint ``src`` (or of every complete checkpoint of a run
    directory / checkpoints root that references a base), after checking that it is the base each was
    trained on (nothing is changed otherwise); each ``meta.json`` is replaced atomically. Returns the
    checkpoints changed."""
    roots = [r for r in (src, os.path.join(src, "checkpoints")) if os.path.isdir(r) and complete_checkpoints(r)]
    ckpts = ([os.path.join(roots[0], n) for n in complete_checkpoints(roots[0])] if roots
             else [find_checkpoint(src)])
    metas = {os.path.abspath(c): read_meta(c) for c in ckpts}
    metas = {c: m for c, m in metas.items() if m.get("base")}
    if not metas:
        raise CheckpointError(f"{src} holds whole models only: no checkpoint in it references a base")
    target = os.path.abspath(new_base if hf_loading.is_hf_dir(new_base) else find_checkpoint(new_base))
    for ckpt, meta in metas.items():
        check(ckpt, meta["base"], target)
    for ckpt, meta in metas.items():
        meta["base"] = record({**meta["base"], "path": target}, ckpt)
        tmp = os.path.join(ckpt, META + ".tmp")
        with open(tmp, "w") as f:
            json.dump(meta, f, indent=1)
        os.replace(tmp, os.path.join(ckpt, META))
    return list(metas)
