"""Checkpoint conversions behind ``checkpoints_tools/``: GQA, Hugging Face import/export, resharding."""

from __future__ import annotations

import os
from typing import Optional

import torch

from dmc_train.errors import CheckpointError, ConfigError

#: The logit check every conversion runs before publishing (import and export): on the fixed prompt of
#: :func:`verification_tokens`, ``max |logits - reference| / max(1, max |reference|)`` must not exceed this,
#: by the dtype the converted weights are stored in. Both sides compute in fp32, so the difference
#: measures the rounding of the stored weights (and, in fp32, of two implementations' summation
#: orders); a mapping error (a head in the wrong group, swapped gate/up) moves logits by their own scale.
LOGIT_TOLERANCE = {"float32": 1e-5, "bfloat16": 5e-2, "float16": 1e-2}
_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


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


def hf_rope_inv_freq(directory: str) -> torch.Tensor:
    """transformers' own RoPE inverse frequencies ``[head_dim / 2]`` for a Llama directory: its reading of
    ``config.json`` (``rope_parameters`` / ``rope_scaling``, ``rope_theta``) and its RoPE functions. The
    import's streaming verification runs the Hugging Face side with these, so a RoPE config the project read
    differently from transformers fails the logit check instead of passing on both sides."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    try:
        config = LlamaConfig.from_pretrained(directory, local_files_only=True)
        return LlamaRotaryEmbedding(config).inv_freq.float()
    except Exception as e:  # transformers raises many types for a config it cannot use
        raise CheckpointError(f"transformers cannot read {directory}/config.json ({type(e).__name__}: "
                              f"{(str(e).splitlines() or [''])[0][:200]}); nothing was written") from None


def check_logits(logits: torch.Tensor, reference: torch.Tensor, dtype: str, failure: str,
                 fix: str = "nothing was written") -> dict:
    """Compare ``logits`` with ``reference`` (same shape) under :data:`LOGIT_TOLERANCE` for ``dtype``
    (``float32``/``bfloat16``/``float16`` or ``fp32``/``bf16``/``fp16``). Returns ``{"max_abs_logit_diff",
    "relative_error", "tolerance"}``; over the tolerance, a one-line CheckpointError that starts with
    ``failure`` (what differs from what), gives the numbers and ends with ``fix``."""
    tol = LOGIT_TOLERANCE[_DTYPE_NAMES.get(dtype, dtype)]
    if logits.shape != reference.shape:
        raise CheckpointError(f"{failure}: logits of shape {tuple(logits.shape)} vs {tuple(reference.shape)}; "
                              f"{fix}")
    diff = float((logits.float() - reference.float()).abs().max())
    relative = diff / max(1.0, float(reference.float().abs().max()))
    if not relative <= tol:  # NaN fails too
        raise CheckpointError(f"{failure} by {relative:.2e} (max |diff| {diff:.3g} / max(1, max |logit|); "
                              f"tolerance {tol:.0e} for {dtype}); {fix}")
    return {"max_abs_logit_diff": diff, "relative_error": relative, "tolerance": tol}
