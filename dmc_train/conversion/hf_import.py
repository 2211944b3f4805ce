"""Import a Hugging Face ``LlamaForCausalLM`` directory as a weights-only checkpoint of this project.

    import_hf("llama-2-7b-hf", "runs/inits/llama2_7b")     # one process, TP=1
    python launch/pretrain.py ... checkpoint.init_from=runs/inits/llama2_7b   # any TP/PP layout

What :func:`import_hf` does, in order (nothing is left at ``out`` unless every step passed):

1. ``config.json`` -> the ``model`` node (:func:`~dmc_train.models.hf_config.model_config_from_hf`
   refuses what the project's Llama cannot represent); every weight shard is opened (headers checked).
2. The tokenizer (``tokenizer.model`` and/or ``tokenizer.json`` + its config files) is copied and
   loaded; a vocabulary larger than the model's ``vocab_size`` is refused.
3. Our model (TP=1) is filled parameter by parameter (:func:`load_hf_into_model`, every tensor's
   shape checked) and saved with ``save_weights`` to ``<out>.importing``; ``meta.json`` records
   ``hf_source``, ``hf_config``, ``tie_word_embeddings`` and ``tokenizer``, and the saved config's
   ``data.tokenizer`` points at ``<out>/tokenizer``.
4. Reference logits of the Hugging Face model (transformers, fp32) on a fixed prompt, then the saved
   checkpoint is reloaded (``load_model``) and its logits compared (fp32: 1e-4). One model is in
   memory at a time. Only then is ``<out>.importing`` renamed to ``out``.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch
from omegaconf import OmegaConf

from dmc_train import distributed
from dmc_train.config import kv_groups
from dmc_train.conversion import check_output, load_llama, verification_tokens
from dmc_train.data.tokenizer import load_tokenizer
from dmc_train.errors import CheckpointError, ConfigError, DataError
from dmc_train.models.hf_config import model_config_from_hf
from dmc_train.models.llama import build_model
from dmc_train.recipes import load_config
from dmc_train.training.checkpointing import replace_dir, save_weights
from dmc_train.training.forward import logits
from dmc_train.training.hf_loading import HFWeights, load_hf_into_model, read_hf_config
from dmc_train.training.model_loading import load_model

__all__ = ["import_hf", "hf_run_config", "TOKENIZER_FILES", "TOLERANCE"]

TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2, "fp16": 1e-2}  # max |ours - HF| / max(1, max |HF|), logits


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
    """Copy the tokenizer files of ``hf_dir`` into ``dest``; return the path ``data.tokenizer`` takes
    relative to ``dest``'s parent (``tokenizer`` for a HF tokenizer directory, ``tokenizer/tokenizer.model``
    for a sentencepiece model alone), or None if there is no tokenizer."""
    present = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(hf_dir, f))]
    if not present:
        return None
    os.makedirs(dest)
    for name in present:
        shutil.copy2(os.path.join(hf_dir, name), os.path.join(dest, name))
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


def _remove(*paths: str) -> None:
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)


def import_hf(hf_dir: str, out: str, overwrite: bool = False, dtype: str = "fp32") -> str:
    """Import the Hugging Face Llama directory ``hf_dir`` into the weights-only checkpoint ``out``
    (loadable at any layout with ``checkpoint.init_from``). One process; returns ``out``."""
    hf_dir, out = os.path.abspath(hf_dir), os.path.abspath(out)
    hf = read_hf_config(hf_dir)
    check_output(out, overwrite, hf_dir)
    cfg = hf_run_config(hf, dtype)
    HFWeights(hf_dir)  # every shard opened: a missing or truncated one fails before any work
    staging, tok_tmp = out + ".importing", out + ".tokenizer.tmp"
    _remove(staging, staging + ".tmp", tok_tmp)
    try:
        tok_rel = _copy_tokenizer(hf_dir, tok_tmp, cfg.model.vocab_size)
        cfg.data.tokenizer = os.path.join(out, tok_rel) if tok_rel else None
        distributed.initialize(1, 1, None, cfg.train.seed)
        chunks = build_model(cfg)
        load_hf_into_model(hf_dir, chunks, cfg)
        tied = bool(hf.get("tie_word_embeddings", False))
        save_weights(cfg, chunks, staging, {"hf_source": hf_dir, "hf_config": hf, "tie_word_embeddings": tied,
                                            "tokenizer": cfg.data.tokenizer})
        del chunks
        if tok_rel:
            os.rename(tok_tmp, os.path.join(staging, "tokenizer"))

        # One model in memory at a time: ours is freed before the HF reference is built, and the
        # reference before ours is reloaded.
        tokens = verification_tokens(cfg.model.vocab_size, cfg.model.max_position_embeddings)
        reference = _hf_logits(hf_dir, tokens)
        loaded = load_model(staging)
        ours = logits(loaded.model, tokens).float()
        del loaded
        err = (ours - reference).abs().max().item() / max(1.0, reference.abs().max().item())
        if not err <= TOLERANCE[dtype]:
            raise CheckpointError(f"the imported model's logits differ from the Hugging Face model's by {err:.2e} "
                                  f"(relative, tolerance {TOLERANCE[dtype]:.0e}); {hf_dir} is not a standard Llama "
                                  f"checkpoint - nothing was written")
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
            f"{kv_groups(m)} KV groups, vocab {m.vocab_size}, "
            f"{cfg.train.precision}; tokenizer {cfg.data.tokenizer}")
