"""Import a Hugging Face ``LlamaForCausalLM`` directory as a weights-only checkpoint of this project.

    import_hf("llama-2-7b-hf", "runs/inits/llama2_7b")     # one process
    python launch/pretrain.py ... checkpoint.init_from=runs/inits/llama2_7b   # any TP/PP layout

What :func:`import_hf` does, in order (nothing is left at ``out`` unless every step passed):

1. ``config.json`` -> the ``model`` node (:mod:`~dmc_train.conversion.hf_checks`: every shape key present, no
   weights of a layer it does not list; :func:`~dmc_train.models.hf_config.model_config_from_hf` refuses what
   the project's Llama cannot represent); every weight shard is opened (headers checked).
2. The tokenizer (``tokenizer.model`` and/or ``tokenizer.json`` + its config files) is copied and
   loaded; a vocabulary larger than the model's ``vocab_size`` is refused.
3. The checkpoint is written to ``<out>.importing`` tensor by tensor, without building the model
   (:func:`~dmc_train.training.streaming_checkpoint.save_weights_streaming`): each megatron tensor is
   made from its Hugging Face tensor(s) (:func:`~dmc_train.training.hf_loading.full_tensor`: q/k/v merged
   by query group, fc1 = [gate; up], every shape checked), written and dropped. The files are those a
   TP=1 model saved with ``save_weights`` would have; ``meta.json`` records ``hf_source``, ``hf_config``,
   ``tie_word_embeddings`` and ``tokenizer``, and the saved config's ``data.tokenizer`` points at
   ``<out>/tokenizer``.
4. :func:`verify_import`: logits on a fixed prompt from the Hugging Face tensors and from the tensors
   read back from ``<out>.importing``, compared under :data:`~dmc_train.conversion.LOGIT_TOLERANCE`.
   By default (``verify="streaming"``) both come from the plain-torch layer-by-layer forward
   (:func:`~dmc_train.models.llama_reference.streaming_logits`): the reference reads the Hugging Face
   tensors by their own names and rotates with transformers' own RoPE frequencies for ``config.json``
   (:func:`~dmc_train.conversion.hf_rope_inv_freq`: a RoPE setting read differently shows), ours reads
   the checkpoint's fused tensors and splits them back
   (:func:`~dmc_train.models.llama_weights.megatron_to_hf`), so a layout error or a corrupt written
   tensor shows, and neither model is ever whole in memory. ``verify="full"`` instead compares
   transformers' ``LlamaForCausalLM`` with our megatron model reloaded by ``load_model`` (one model
   in memory at a time; fine for small models). Only then is ``<out>.importing`` renamed to ``out``.

Memory: the largest tensor (two for a fused one while it is merged) or one layer, plus the start-up
of torch and megatron; ``benchmarks/convert.py`` measures it.
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Callable

import torch
from omegaconf import OmegaConf

from dmc_train import distributed
from dmc_train.config import kv_groups
from dmc_train.conversion import check_logits, check_output, hf_rope_inv_freq, load_llama, verification_tokens
from dmc_train.conversion.gguf_import import gguf_to_hf, is_gguf
from dmc_train.conversion.hf_checks import check_hf_config, check_layers
from dmc_train.conversion.hf_tokenizer import copy_hf_tokenizer_files, hf_tokenizer_files
from dmc_train.data.tokenizer import load_tokenizer
from dmc_train.errors import ConfigError, DataError
from dmc_train.models.hf_config import model_config_from_hf
from dmc_train.models.llama_reference import streaming_logits
from dmc_train.models.llama_weights import megatron_name, megatron_to_hf
from dmc_train.recipes import load_config
from dmc_train.training.checkpoint_dirs import replace_dir
from dmc_train.training.forward import logits
from dmc_train.training.hf_loading import HFWeights, full_tensor, read_hf_config
from dmc_train.training.model_loading import load_model
from dmc_train.training.streaming_checkpoint import CheckpointTensors, checkpoint_config, save_weights_streaming

__all__ = ["import_hf", "verify_import", "hf_run_config", "hf_fetch", "checkpoint_fetch", "VERIFY"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
VERIFY = ("streaming", "full")


def hf_run_config(hf: dict, dtype: str = "fp32", tokenizer: str | None = None) -> Any:
    """A complete run config (TP=1, method none) whose ``model`` node is the Hugging Face model's."""
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype} is not one of {', '.join(DTYPES)}")
    cfg = load_config(["+recipe=tiny_pretrain", "method=none", f"train.precision={dtype}"])
    cfg.model = OmegaConf.merge(cfg.model, model_config_from_hf(hf))
    cfg.run_name = "hf_import"
    cfg.data.tokenizer = tokenizer
    cfg.train.seq_length = min(cfg.train.seq_length, cfg.model.max_position_embeddings)
    return cfg


def _copy_tokenizer(hf_dir: str, dest: str, vocab_size: int) -> str | None:
    """Copy every tokenizer file of ``hf_dir`` (:func:`~dmc_train.conversion.hf_tokenizer.hf_tokenizer_files`,
    the chat template included) into ``dest``; return the path ``data.tokenizer`` takes relative to ``dest``'s
    parent (``tokenizer`` for a HF tokenizer directory, ``tokenizer/tokenizer.model`` for a sentencepiece model
    alone), or None if there is no tokenizer."""
    if not hf_tokenizer_files(hf_dir):
        return None
    os.makedirs(dest)
    present = copy_hf_tokenizer_files(hf_dir, dest)
    hf_style = any(f != "tokenizer.model" for f in present)
    path = dest if hf_style else os.path.join(dest, "tokenizer.model")
    try:
        tok = load_tokenizer(path)
    except DataError as e:
        raise DataError(f"the tokenizer of {hf_dir} cannot be loaded: {e}") from None
    if tok.vocab_size > vocab_size:
        raise DataError(f"the tokenizer of {hf_dir} has {tok.vocab_size} tokens but the model's vocab_size is "
                        f"{vocab_size}; the tokenizer does not belong to this model")
    return "tokenizer" if hf_style else os.path.join("tokenizer", "tokenizer.model")


@torch.no_grad()
def _hf_logits(hf_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    model = load_llama(hf_dir)
    out = model(input_ids=tokens).logits.float()
    del model
    return out


def hf_fetch(weights: HFWeights, tied: bool) -> Callable[[list[str]], dict[str, torch.Tensor]]:
    """:func:`~dmc_train.models.llama_reference.streaming_logits`'s ``fetch`` over a Hugging Face
    directory (a tied model's ``lm_head.weight`` is its embedding)."""
    def fetch(names: list[str]) -> dict[str, torch.Tensor]:
        return {n: weights.get("model.embed_tokens.weight" if n == "lm_head.weight" and tied and n not in weights
                               else n) for n in names}
    return fetch


def checkpoint_fetch(ckpt: str, cfg: Any) -> Callable[[list[str]], dict[str, torch.Tensor]]:
    """``fetch`` over a checkpoint of ours: the megatron tensors holding the asked Hugging Face names are
    read (:class:`~dmc_train.training.streaming_checkpoint.CheckpointTensors`) and split back into Hugging
    Face tensors (:func:`~dmc_train.models.llama_weights.megatron_to_hf`)."""
    reader = CheckpointTensors(ckpt, cfg)
    heads, groups = cfg.model.num_attention_heads, kv_groups(cfg.model)
    tied = bool(cfg.model.get("tie_embeddings", False))

    def stored(name: str) -> str:  # a tied checkpoint holds the output layer as its embedding
        return "model.embed_tokens.weight" if tied and name == "lm_head.weight" else name

    def fetch(names: list[str]) -> dict[str, torch.Tensor]:
        fused = list(dict.fromkeys(megatron_name(stored(n)) for n in names))
        hf = megatron_to_hf(reader.read(fused), heads, groups)
        return {n: hf[stored(n)] for n in names}
    return fetch


def verify_import(hf_dir: str, ckpt: str, dtype: str = "fp32", verify: str = "streaming") -> dict:
    """Compare the logits of the imported checkpoint ``ckpt`` with those of ``hf_dir`` on the fixed prompt
    (module docstring, step 4); returns :func:`~dmc_train.conversion.check_logits`' numbers, one-line
    CheckpointError when over the tolerance. One process, distributed state at TP=1 PP=1."""
    if verify not in VERIFY:
        raise ConfigError(f"verify={verify!r} is not one of {', '.join(VERIFY)}")
    cfg = checkpoint_config(ckpt)
    tokens = verification_tokens(cfg.model.vocab_size, cfg.model.max_position_embeddings)
    if verify == "streaming":
        hf = read_hf_config(hf_dir)
        reference = streaming_logits(hf_fetch(HFWeights(hf_dir), bool(hf.get("tie_word_embeddings", False))),
                                     cfg.model, tokens, inv_freq=hf_rope_inv_freq(hf_dir))
        ours = streaming_logits(checkpoint_fetch(ckpt, cfg), cfg.model, tokens)
    else:  # one model in memory at a time: the HF reference is freed before ours is loaded
        reference = _hf_logits(hf_dir, tokens)
        loaded = load_model(ckpt)
        ours = logits(loaded.model, tokens).float()
        del loaded
    return check_logits(ours, reference, dtype, "the imported model's logits differ from the Hugging Face model's",
                        f"{hf_dir} is not a standard Llama checkpoint or what was written is corrupt - nothing "
                        f"was written")


def _remove(*paths: str) -> None:
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)


def import_hf(source: str, out: str, overwrite: bool = False, dtype: str = "fp32", verify: str = "streaming",
              hf_output: str | None = None, require_tokenizer: bool = False,
              log: Callable[[str], None] = lambda line: None) -> str:
    """Import the Hugging Face Llama directory (or Llama GGUF file) ``source`` into the weights-only checkpoint
    ``out`` (loadable at any layout with ``checkpoint.init_from``), verified with ``verify`` (``streaming``
    or ``full``, :func:`verify_import`). One process; returns ``out``.

    A ``.gguf`` file is first converted into a Hugging Face directory
    (:func:`~dmc_train.conversion.gguf_import.gguf_to_hf`, bf16 for ``dtype="bf16"``, else fp32) at
    ``<out>.gguf_hf``, imported from there, then renamed to ``hf_output`` (kept) or removed. ``require_tokenizer``:
    a directory without tokenizer files is refused (one line, nothing written). ``log`` gets the verifications'
    numbers."""
    source, out = os.path.abspath(source), os.path.abspath(out)
    if verify not in VERIFY:
        raise ConfigError(f"verify={verify!r} is not one of {', '.join(VERIFY)}")
    if not is_gguf(source):
        return _import_dir(source, out, overwrite, dtype, verify, require_tokenizer, {"hf_source": source}, log)
    check_output(out, overwrite, source)
    hf_output = os.path.abspath(hf_output) if hf_output else None
    if hf_output:
        check_output(hf_output, overwrite, source)
    converted = out + ".gguf_hf"
    try:
        checked = gguf_to_hf(source, converted, dtype="bf16" if dtype == "bf16" else "fp32", overwrite=True)
        log(f"converted {source} ({checked['gguf']['tensor_types']}): logits of the Hugging Face directory vs "
            f"transformers' loading of the GGUF file: {_numbers(checked['verification'])}")
        _import_dir(converted, out, overwrite, dtype, verify, True, {"hf_source": hf_output, "gguf_source": source},
                    log)
        if hf_output:
            replace_dir(converted, hf_output)
    finally:
        _remove(converted)
    return out


def _numbers(checked: dict) -> str:
    return (f"max |diff| {checked['max_abs_logit_diff']:.3g}, relative {checked['relative_error']:.2e} "
            f"(tolerance {checked['tolerance']:.0e})")


def _import_dir(hf_dir: str, out: str, overwrite: bool, dtype: str, verify: str, require_tokenizer: bool,
                sources: dict, log: Callable[[str], None]) -> str:
    """:func:`import_hf` of a Hugging Face directory; ``sources`` go into ``meta.json``."""
    hf = read_hf_config(hf_dir)
    check_hf_config(hf, hf_dir)
    check_output(out, overwrite, hf_dir)
    cfg = hf_run_config(hf, dtype)
    if require_tokenizer and not hf_tokenizer_files(hf_dir):
        raise DataError(f"{hf_dir} has no tokenizer files (tokenizer.json, tokenizer.model, ...); copy the model's "
                        f"tokenizer into it, or use checkpoints_tools/import_hf.py to import the weights alone")
    weights = HFWeights(hf_dir)  # every shard opened: a missing or truncated one fails before any work
    check_layers(weights.names(), hf, hf_dir)
    staging, tok_tmp = out + ".importing", out + ".tokenizer.tmp"
    _remove(staging, staging + ".tmp", tok_tmp)
    try:
        tok_rel = _copy_tokenizer(hf_dir, tok_tmp, cfg.model.vocab_size)
        cfg.data.tokenizer = os.path.join(out, tok_rel) if tok_rel else None
        distributed.initialize(1, 1, None, cfg.train.seed)
        tied = bool(cfg.model.tie_embeddings)
        save_weights_streaming(cfg, lambda name, shape: full_tensor(weights, name, shape, cfg, tied), staging,
                               {**sources, "hf_config": hf, "tie_word_embeddings": tied,
                                "tokenizer": cfg.data.tokenizer})
        if tok_rel:
            os.rename(tok_tmp, os.path.join(staging, "tokenizer"))
        checked = verify_import(hf_dir, staging, dtype, verify)
        log(f"imported: logits of the checkpoint vs the Hugging Face directory ({verify}): {_numbers(checked)}")
        replace_dir(staging, out)  # --overwrite: the old one goes only now that the new one is complete
    except BaseException:
        _remove(staging, staging + ".tmp", tok_tmp)
        raise
    return out


def imported_meta_summary(out: str) -> str:
    """One line describing an imported checkpoint (for the command line)."""
    cfg = OmegaConf.load(os.path.join(out, "config.yaml"))
    m = cfg.model
    return (f"wrote {out}: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads, "
            f"{kv_groups(m)} KV groups, vocab {m.vocab_size}, {'tied' if m.get('tie_embeddings') else 'untied'} "
            f"embeddings, {cfg.train.precision}; tokenizer {cfg.data.tokenizer}")
