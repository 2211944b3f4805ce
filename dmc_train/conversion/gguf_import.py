"""A GGUF file (llama.cpp's format) of a Llama -> a Hugging Face ``LlamaForCausalLM`` directory (safetensors).

    gguf_to_hf("SmolLM2-135M-Instruct.Q4_1.gguf", "hf/smollm2", dtype="fp32")

The file is read by transformers (``from_pretrained(gguf_file=...)``, which reads Llama GGUF files with the
``gguf`` package): its ``config.json`` fields come from the GGUF metadata (``llama.*``), its tokenizer from
``tokenizer.ggml.*`` (with ``tokenizer.chat_template`` as ``chat_template.jinja``), and llama.cpp's row
order of the q/k projections is undone. transformers refuses to ``save_pretrained`` a model loaded from
GGUF ("quantized with gguf and is not serializable"), so its dequantised state dict is loaded into a plain
``LlamaForCausalLM`` of the same config, which saves like any model.

**Dequantisation** (``gguf.quants.dequantize``, numpy, to fp32): every quantised tensor is stored in blocks
of 32 weights (256 for the K-quants) sharing an fp16 scale; Q8_0 stores ``w = d * q`` with ``q`` int8,
Q4_1 ``w = d * q + m`` with ``q`` in 0..15 and an fp16 minimum ``m``, Q4_0 ``w = d * (q - 8)``; the
K-quants add per-sub-block scales. The result is fp32 (each block's formula evaluated once); norms and other
F32 / F16 / BF16 tensors are read as stored. ``dtype="bf16"`` then rounds every weight to bf16 (a second
rounding on top of the quantisation); ``fp32`` (the default) keeps the dequantised values exactly.

Before anything is written the file is checked (one line each, :func:`check_gguf`): architecture ``llama``,
every tensor of a type ``gguf`` can dequantise, no RoPE-scaling factors (``rope_freqs.weight``, which
transformers does not read), and a tokenizer when one is required. The directory is written to
``<out>.tmp``, its logits on the fixed prompt are compared with those of transformers' own GGUF-loaded model
(:data:`~dmc_train.conversion.LOGIT_TOLERANCE` for ``dtype``), and only then renamed to ``out``.
Memory: the dequantised model once in fp32 (the saved copy holds transformers' own tensors; bf16 adds a bf16 copy).
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import torch

from dmc_train.conversion import check_logits, check_output, load_llama, verification_tokens
from dmc_train.errors import CheckpointError, ConfigError
from dmc_train.training.checkpoint_dirs import replace_dir

__all__ = ["is_gguf", "check_gguf", "gguf_to_hf", "GGUF_DTYPES"]

GGUF_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def is_gguf(path: str) -> bool:
    """True for a file named ``*.gguf`` (a GGUF input rather than a Hugging Face directory)."""
    return path.endswith(".gguf") and not os.path.isdir(path)


def _field(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def check_gguf(path: str, require_tokenizer: bool = False) -> dict:
    """Check the GGUF file ``path`` can become a Llama of this project (module docstring); returns
    ``{"architecture", "name", "tensor_types": {type name: count}, "tensors"}``; a one-line CheckpointError
    otherwise."""
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    if not os.path.isfile(path):
        raise CheckpointError(f"{path} does not exist; pass a .gguf file or a Hugging Face model directory")
    try:
        reader = GGUFReader(path)
    except Exception as e:  # gguf raises ValueError, struct errors, ... for a file that is not GGUF
        raise CheckpointError(f"{path} cannot be read as a GGUF file ({type(e).__name__}: "
                              f"{(str(e).splitlines() or [''])[0][:160]}); the file is damaged or not GGUF") from None
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise CheckpointError(f"{path} is a GGUF of architecture {arch!r}; only 'llama' (LlamaForCausalLM) models "
                              f"can be imported")
    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    for name in types:
        qtype = GGMLQuantizationType[name]
        _, block_bytes = GGML_QUANT_SIZES[qtype]
        try:  # one block of zeros: what gguf can dequantise at all
            dequantize(np.zeros(block_bytes, dtype=np.uint8), qtype)
        except NotImplementedError:
            raise CheckpointError(f"{path} holds {types[name]} tensors quantised as {name}, which the gguf package "
                                  f"cannot dequantise; use a file quantised as Q8_0, Q4_0, Q4_1 or a K-quant, "
                                  f"or the original Hugging Face directory") from None
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise CheckpointError(f"{path} carries RoPE scaling factors (rope_freqs.weight, e.g. Llama 3.1), which "
                              f"transformers' GGUF reader ignores; import the original Hugging Face directory")
    if require_tokenizer and _field(reader, "tokenizer.ggml.tokens") is None:
        raise CheckpointError(f"{path} holds no tokenizer (no tokenizer.ggml.tokens); use a GGUF file that "
                              f"includes its tokenizer, as llama.cpp's converter writes it")
    return {"architecture": arch, "name": _field(reader, "general.name"), "tensor_types": types,
            "tensors": len(reader.tensors)}


def _gguf_model(path: str) -> torch.nn.Module:
    """transformers' ``LlamaForCausalLM`` of the GGUF file, dequantised, fp32, eval mode."""
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        return LlamaForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                local_files_only=True, dtype=torch.float32).eval()
    except Exception as e:  # transformers raises many types for a file it cannot load
        raise CheckpointError(f"transformers cannot load {path} ({type(e).__name__}: "
                              f"{(str(e).splitlines() or [''])[0][:200]}); nothing was written") from None


def _plain_copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A ``LlamaForCausalLM`` of ``model``'s config holding its weights (cast to ``dtype``), without the GGUF
    quantisation record, so ``save_pretrained`` writes it."""
    from transformers import LlamaForCausalLM

    config = model.config
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    config.dtype = dtype
    with torch.device("meta"):
        plain = LlamaForCausalLM(config)
    state = {k: v.to(dtype) for k, v in model.state_dict().items()}
    plain.load_state_dict(state, strict=False, assign=True)
    plain.tie_weights()  # a tied model's lm_head is its embedding (GGUF stores it once)
    return plain.eval()


def gguf_to_hf(path: str, out: str, dtype: str = "fp32", overwrite: bool = False) -> dict:
    """Convert the Llama GGUF file ``path`` into the Hugging Face directory ``out`` (module docstring);
    returns ``{"gguf": check_gguf's facts, "verification": check_logits' numbers}``."""
    if dtype not in GGUF_DTYPES:
        raise ConfigError(f"--dtype {dtype} is not one of {', '.join(GGUF_DTYPES)} for a GGUF conversion")
    path, out = os.path.abspath(path), os.path.abspath(out)
    facts = check_gguf(path, require_tokenizer=True)
    check_output(out, overwrite, path)
    from transformers import AutoTokenizer

    staging = out + ".tmp"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        model = _gguf_model(path)
        tokens = verification_tokens(model.config.vocab_size, model.config.max_position_embeddings)
        with torch.no_grad():
            reference = model(input_ids=tokens).logits.float()
        _plain_copy(model, GGUF_DTYPES[dtype]).save_pretrained(staging)
        del model
        tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                  local_files_only=True)
        tokenizer.save_pretrained(staging)
        reloaded = load_llama(staging)
        with torch.no_grad():
            ours = reloaded(input_ids=tokens).logits.float()
        del reloaded
        verification = check_logits(ours, reference, dtype, f"the Hugging Face directory converted from {path} "
                                    f"differs from transformers' loading of the file")
        replace_dir(staging, out)  # --overwrite: the old one goes only now that the new one is complete
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return {"gguf": facts, "verification": verification}
