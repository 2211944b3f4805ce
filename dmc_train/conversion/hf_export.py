"""Export a checkpoint of ours to a Hugging Face ``LlamaForCausalLM`` directory, verified before it is published.

    export_hf("runs/base_tiny", "hf/base_tiny")                    # fp32, the run's latest checkpoint
    export_hf(ckpt, "hf/base_tiny_bf16", dtype="bfloat16", max_shard_size="2GB", overwrite=True)

Steps (each a function a DMC export reuses, see :func:`export`):

1. :func:`write_model_dir` writes ``config.json``, sharded ``model-0000i-of-0000n.safetensors`` +
   ``model.safetensors.index.json`` (tensor by tensor, one shard in memory at a time), the
   ``generation_config.json`` and the tokenizer files of the checkpoint's ``data.tokenizer``
   (:mod:`dmc_train.conversion.hf_tokenizer`).
2. :func:`verify` reloads the directory with a loader callable (``LlamaForCausalLM.from_pretrained``,
   offline) and compares its logits on a fixed prompt with ``dmc_train.training.forward.logits``.
3. :func:`export` writes ``manifest.json`` and renames ``<out>.tmp`` to ``<out>``; on any failure the
   temporary directory is removed, so nothing that looks valid is left.

A DMC checkpoint reuses all of it and adds only files and config fields
(:func:`write_dmc_model_dir`: the self-contained modeling file of :mod:`dmc_train.conversion.hf_dmc`,
a model card and the ``dmc_*`` fields) and is verified through ``trust_remote_code``
(:func:`load_dmc_llama`): the exported model's no-cache forward is DMC's teacher-forced attention, so
its logits must equal ours. Fixed Memory Pooling and checkpoints still in DMC's zero-out stage are
refused (one line).

Tolerance: the one every conversion uses (:func:`~dmc_train.conversion.check_logits`,
:data:`~dmc_train.conversion.LOGIT_TOLERANCE`): max |diff| / max(1, max |our logit|) at most 1e-5 (fp32),
5e-2 (bf16), 1e-2 (fp16). The reloaded model runs in fp32 whatever the file dtype, so the difference
measures only the rounding of the stored weights; a wrong mapping (a swapped head, a transposed
tensor) moves logits by their own scale and fails these bounds.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from importlib import metadata as importlib_metadata
from typing import Any, Callable, Iterator, Optional

import torch

from dmc_train.config import kv_groups
from dmc_train.conversion import check_logits, check_output, load_llama, verification_tokens
from dmc_train.conversion.hf_tokenizer import write_tokenizer
from dmc_train.distributed import read_launch_env
from dmc_train.errors import CheckpointError, ConfigError
from dmc_train.models.hf_config import hf_config_from_model
from dmc_train.models.llama_weights import megatron_to_hf
from dmc_train.training.checkpoint_dirs import find_checkpoint, read_meta, replace_dir
from dmc_train.units import parse_size

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DMC_METHODS = ("dmc", "fixed_pooling")
DEFAULT_SHARD_SIZE = "5GB"
INDEX = "model.safetensors.index.json"
MANIFEST = "manifest.json"


# ----------------------------------------------------------------------------------------------
# Small checks
# ----------------------------------------------------------------------------------------------
# The project's precision names (train.precision, the importer's --dtype) are accepted too.
PRECISION_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def dtype_name(dtype: str) -> str:
    """``fp32``/``bf16``/``fp16`` or ``float32``/``bfloat16``/``float16`` -> the torch/HF name."""
    name = PRECISION_NAMES.get(dtype, dtype)
    if name not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not supported; use one of {', '.join(PRECISION_NAMES)} "
                          f"(or {', '.join(DTYPES)})")
    return name


def check_dtype(dtype: str) -> torch.dtype:
    return DTYPES[dtype_name(dtype)]


def checkpoint_method(meta: dict) -> str:
    return ((meta.get("config") or {}).get("method") or {}).get("name") or meta.get("method") or "none"


# ----------------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------------
def hf_tensors(chunk: torch.nn.Module, num_heads: int, num_groups: int, dtype: torch.dtype,
               skip: tuple[str, ...] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, tensor)`` of a TP=1 PP=1 model chunk, one megatron tensor at a time (q/k/v and
    gate/up are split from the fused tensors), cast to ``dtype``, contiguous, owning their storage.
    HF names in ``skip`` are left out (``lm_head.weight`` of a tied export)."""
    for name, value in chunk.state_dict().items():
        if not isinstance(value, torch.Tensor):
            continue
        for hf, part in megatron_to_hf({name: value.detach()}, num_heads, num_groups).items():
            if hf not in skip:
                yield hf, part.to(dtype=dtype, copy=True).contiguous()


def write_shards(tensors: Iterator[tuple[str, torch.Tensor]], directory: str, max_shard_size: int) -> dict:
    """Write ``tensors`` into safetensors shards of at most ``max_shard_size`` bytes (a bigger tensor
    gets a shard of its own) and ``model.safetensors.index.json``; returns the index dict."""
    from safetensors.torch import save_file

    names: list[list[str]] = []
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush():
        if shard:
            save_file(shard, os.path.join(directory, f"shard-{len(names):05d}.tmp"), metadata={"format": "pt"})
            names.append(list(shard))
            shard.clear()

    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > max_shard_size:
            flush()
            size = 0
        shard[name] = tensor
        size += nbytes
        total += nbytes
    flush()
    weight_map = {}
    for i, shard_names in enumerate(names):
        final = f"model-{i + 1:05d}-of-{len(names):05d}.safetensors"
        os.replace(os.path.join(directory, f"shard-{i:05d}.tmp"), os.path.join(directory, final))
        weight_map.update({n: final for n in shard_names})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(os.path.join(directory, INDEX), index)
    return index


# ----------------------------------------------------------------------------------------------
# The directory, verification, publication
# ----------------------------------------------------------------------------------------------
def tied_embeddings(chunk: torch.nn.Module, model: Any) -> bool:
    """True when the model ties its embeddings (``model.tie_embeddings``: one matrix) or its input embedding
    and output layer are bitwise equal; then the export ties them (HF ``tie_word_embeddings``)."""
    if model.get("tie_embeddings", False):
        return True
    sd = chunk.state_dict()
    emb, out = sd.get("embedding.word_embeddings.weight"), sd.get("output_layer.weight")
    return emb is not None and out is not None and emb.shape == out.shape and torch.equal(emb, out)


def write_model_dir(loaded: Any, directory: str, dtype: str = "float32",
                    max_shard_size: int | str = DEFAULT_SHARD_SIZE,
                    finish_config: Optional[Callable[[str, dict], dict]] = None) -> dict:
    """Write the weights, ``config.json``, ``generation_config.json`` and tokenizer of ``loaded``
    (a :class:`~dmc_train.training.model_loading.LoadedModel` at TP=1 PP=1) into ``directory``.

    ``finish_config(directory, config) -> config`` may add files and return the final ``config.json``
    dict before it is written (a DMC export: ``lambda d, c: write_dmc_files(d, c, settings)`` adds the
    modeling file, ``model_type``, ``auto_map`` and the DMC fields).
    Returns ``{"config": <config.json dict>, "tokenizer": <write_tokenizer facts>, "index": ...}``.
    """
    torch_dtype = check_dtype(dtype)
    if len(loaded.model) != 1:
        raise ConfigError("export needs the model at TP=1 PP=1 without virtual stages (one chunk)")
    chunk, m = loaded.model[0], loaded.cfg.model
    heads = m.num_attention_heads
    groups = kv_groups(m)
    tie = tied_embeddings(chunk, m)
    tok = write_tokenizer(loaded.cfg.data.tokenizer, directory, m.max_position_embeddings)
    config = hf_config_from_model(m, tie_word_embeddings=tie, dtype=dtype)
    special = {k: tok[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if tok.get(k) is not None}
    config.update(special)
    index = write_shards(hf_tensors(chunk, heads, groups, torch_dtype, skip=("lm_head.weight",) if tie else ()),
                         directory, parse_size(max_shard_size, "--max-shard-size"))
    if finish_config is not None:
        config = finish_config(directory, config)
    _write_json(os.path.join(directory, "config.json"), config)
    _write_json(os.path.join(directory, "generation_config.json"), {"_from_model_config": True, **special})
    return {"config": config, "tokenizer": tok, "index": index}


def verify(loaded: Any, directory: str, dtype: str, loader: Callable[[str], torch.nn.Module] = load_llama) -> dict:
    """Reload ``directory`` with ``loader`` and compare its logits with our model's on the fixed
    prompt; returns :func:`~dmc_train.conversion.check_logits`' numbers (``max_abs_logit_diff``,
    ``relative_error``, ``tolerance``), one-line CheckpointError when over the tolerance for ``dtype``."""
    from dmc_train.training.forward import logits

    m = loaded.cfg.model
    tokens = verification_tokens(m.vocab_size, m.max_position_embeddings)
    ours = logits(loaded.model, tokens).float()
    try:
        hf_model = loader(directory)
        with torch.no_grad():
            theirs = hf_model(input_ids=tokens, use_cache=False).logits.float()
    except Exception as e:  # transformers raises many types for a directory it cannot use
        raise CheckpointError(f"the exported directory does not load in transformers ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200] if str(e) else ''}); nothing was written") from None
    return check_logits(theirs, ours, dtype, f"exported {dtype} model's logits differ from the checkpoint's",
                        "nothing was written - report this as a bug")


def export(loaded: Any, out: str, *, overwrite: bool = False, dtype: str = "float32",
           max_shard_size: int | str = DEFAULT_SHARD_SIZE,
           write: Callable[..., dict] = write_model_dir,
           loader: Callable[[str], torch.nn.Module] = load_llama,
           extra_manifest: Optional[dict] = None) -> str:
    """Write ``loaded`` into ``<out>.tmp`` with ``write(loaded, tmp, dtype, max_shard_size)``, verify it
    with ``loader``, add ``manifest.json`` and rename to ``out``. The DMC export passes its own
    ``write`` (``write_model_dir`` + its modeling file and config fields) and ``loader``
    (``trust_remote_code``); everything else is shared. Returns ``out`` (absolute)."""
    out = os.path.abspath(out)
    check_output(out, overwrite, loaded.checkpoint)
    dtype = dtype_name(dtype)
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        written = write(loaded, tmp, dtype, max_shard_size)
        check = verify(loaded, tmp, dtype, loader)
        _write_json(os.path.join(tmp, MANIFEST), manifest(loaded, dtype, check, written, extra_manifest))
        replace_dir(tmp, out)  # overwrite: the old export goes only once the new one is complete
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def manifest(loaded: Any, dtype: str, check: dict, written: dict, extra: Optional[dict] = None) -> dict:
    meta = loaded.meta
    try:
        version = importlib_metadata.version("dmc_train")
    except importlib_metadata.PackageNotFoundError:
        version = None
    return {
        "source_checkpoint": os.path.abspath(loaded.checkpoint),
        "step": meta.get("step"),
        "method": checkpoint_method(meta),
        "method_metadata": meta.get("method_metadata", {}),
        "dmc_train_version": version,
        "dtype": dtype,
        "tie_word_embeddings": written["config"].get("tie_word_embeddings", False),
        "tokenizer": written["tokenizer"],
        "verification": {**check, "prompt_shape": list(verification_tokens(loaded.cfg.model.vocab_size,
                                                                  loaded.cfg.model.max_position_embeddings).shape)},
        **(extra or {}),
    }


def export_hf(checkpoint: str, out: str, overwrite: bool = False, dtype: str = "float32",
              max_shard_size: int | str = DEFAULT_SHARD_SIZE) -> str:
    """Export ``checkpoint`` (a checkpoint, checkpoints root or run directory, any saved layout) to a
    verified ``LlamaForCausalLM`` directory ``out``; runs in one process. Returns ``out``."""
    from dmc_train.training.model_loading import load_model

    dtype = dtype_name(dtype)
    parse_size(max_shard_size, "--max-shard-size")
    if read_launch_env().world_size > 1:
        raise ConfigError("the Hugging Face export runs in one process; start it with python, not torchrun")
    ckpt = find_checkpoint(checkpoint)
    check_output(out, overwrite, ckpt)
    meta = read_meta(ckpt)
    if checkpoint_method(meta) == "less":
        base = (meta.get("base") or {}).get("path")
        raise ConfigError(f"checkpoint {ckpt} is a LESS model: its kernels have no Hugging Face form yet; run it "
                          f"with launch/generate.py --checkpoint {checkpoint}"
                          + (f", or export its base {base}" if base else ""))
    if checkpoint_method(meta) in DMC_METHODS:
        from dmc_train.conversion.hf_dmc import dmc_settings_from_method

        m = meta["config"]["model"]
        settings = dmc_settings_from_method(meta["config"]["method"], m["hidden_size"] // m["num_attention_heads"],
                                            step=meta.get("step"))  # refuses fixed pooling, zero-out stage
        return export(load_model(ckpt), out, overwrite=overwrite, dtype=dtype, max_shard_size=max_shard_size,
                      write=functools.partial(write_dmc_model_dir, settings=settings), loader=load_dmc_llama,
                      extra_manifest={"dmc": settings})
    return export(load_model(ckpt), out, overwrite=overwrite, dtype=dtype, max_shard_size=max_shard_size)


def write_dmc_model_dir(loaded: Any, directory: str, dtype: str, max_shard_size: int | str, settings: dict) -> dict:
    """:func:`write_model_dir` plus the DMC modeling file, model card and ``dmc_*`` config fields."""
    from dmc_train.conversion.hf_dmc import write_dmc_files

    return write_model_dir(loaded, directory, dtype, max_shard_size,
                           finish_config=lambda d, c: write_dmc_files(d, c, settings))


def load_dmc_llama(directory: str) -> torch.nn.Module:
    """The DMC loader: the exported modeling file through ``trust_remote_code``, offline, fp32, eval mode."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True, local_files_only=True,
                                                dtype=torch.float32).eval()


def _write_json(path: str, value: Any) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=2)
        f.write("\n")
