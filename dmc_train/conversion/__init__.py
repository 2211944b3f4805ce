"""Checkpoint conversions behind ``checkpoints_tools/``: GQA, Hugging Face import/export, resharding."""

from __future__ import annotations

import os
from typing import Optional

import torch

from dmc_train.errors import ConfigError


def check_output(out: str, overwrite: bool, src: Optional[str] = None) -> None:
    """One-line ConfigError when ``out`` is (or contains) the input ``src``, or exists without ``overwrite``."""
    out = os.path.abspath(out)
    if src is not None and (out == os.path.abspath(src) or os.path.abspath(src).startswith(out + os.sep)):
        raise ConfigError(f"--output {out} is or contains the input {src}; choose a new directory")
    if os.path.exists(out) and not overwrite:
        raise ConfigError(f"--output {out} exists; choose another directory or pass --overwrite")


def verification_tokens(vocab_size: int, max_positions: int) -> torch.Tensor:
    """The fixed prompt ``[2, s]`` (s = min(32, max positions)) every conversion compares logits on."""
    s = min(32, max_positions)
    return (torch.arange(2 * s).reshape(2, s) * 7919 + 13) % vocab_size


def load_llama(directory: str) -> torch.nn.Module:
    """A ``LlamaForCausalLM`` directory in transformers: offline, fp32, eval mode, no progress bar."""
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return LlamaForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32).eval()
