"""Prepare a corpus: inputs -> tokenizer (trained or given) -> ``<prefix>.bin/.idx/.json``.

    meta = prepare_corpus(["corpus/", "extra.jsonl"], "data_cache/mine/train", vocab_size=8192)

The tokenizer is saved beside the output as ``<output dir>/tokenizer.model`` (sentencepiece) or
``<output dir>/tokenizer/`` (Hugging Face). A trained tokenizer gets a sidecar
``tokenizer.model.json`` recording what it was trained on. Every step is skipped when its output
exists and was made from the same parameters and inputs (path, size, mtime), unless ``force``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

from dmc_train.data import corpus
from dmc_train.data.indexed import is_up_to_date, read_metadata, write_indexed_dataset
from dmc_train.data.tokenizer import Tokenizer, file_sha256, load_tokenizer, train_sentencepiece
from dmc_train.errors import DataError

DEFAULT_VOCAB_SIZE = 4096
DEFAULT_SEED = 1234
DEFAULT_TOKENIZER_MAX_CHARS = 200_000_000


def train_or_reuse_tokenizer(files: list[corpus.InputFile], model_path: str, *, vocab_size: int, seed: int,
                             max_chars: int = DEFAULT_TOKENIZER_MAX_CHARS, jsonl_key: str = "text",
                             on_bad_line: str = "fail", force: bool = False, overwrite_other: bool = True,
                             log: Callable[[str], None] = print) -> Tokenizer:
    """Train a sentencepiece model on ``files`` into ``model_path`` unless an identical one exists.

    ``overwrite_other=False`` refuses to replace a model trained from different parameters (it may
    belong to other prefixes in the same directory) unless ``force``.
    """
    params = {"vocab_size": vocab_size, "seed": seed, "max_chars": max_chars, "jsonl_key": jsonl_key,
              "inputs": corpus.fingerprint(files)}
    sidecar = model_path + ".json"
    old = _load_json(sidecar) if os.path.isfile(model_path) else None
    if not force and old is not None and old.get("params") == params and old.get("sha256") == file_sha256(model_path):
        log(f"tokenizer: {model_path} is up to date (vocab {vocab_size})")
        return load_tokenizer(model_path)
    if not force and not overwrite_other and os.path.exists(model_path):
        raise DataError(f"{model_path} exists and was made from other inputs or settings: reuse it with "
                        f"--tokenizer {model_path}, choose another output directory, or pass --force to replace it")
    log(f"tokenizer: training a {vocab_size}-token sentencepiece BPE model on {len(files)} file(s) -> {model_path}")
    tok = train_sentencepiece(corpus.iter_documents(files, jsonl_key, on_bad_line), model_path, vocab_size,
                              seed=seed, max_chars=max_chars)
    _write_json(sidecar, {"params": params, "sha256": tok.fingerprint})
    return tok


def install_tokenizer(path: str, out_dir: str, force: bool = False) -> Tokenizer:
    """Load a given tokenizer and save a copy beside the outputs (``tokenizer.model`` or ``tokenizer/``)."""
    tok = load_tokenizer(path)
    dest = os.path.join(out_dir, "tokenizer.model" if tok.kind == "sentencepiece" else "tokenizer")
    if os.path.exists(dest) and not force:
        try:
            same = load_tokenizer(dest).fingerprint == tok.fingerprint
        except DataError:
            same = False
        if not same:
            raise DataError(f"{dest} holds a different tokenizer than {path}: use another output directory, "
                            f"or pass --force to replace it")
    if not os.path.exists(dest) or not os.path.samefile(path, dest):
        tok.save(dest)
    return load_tokenizer(dest)


def prepare_corpus(inputs: list[str], output_prefix: str, *, tokenizer: str | None = None,
                   vocab_size: int = DEFAULT_VOCAB_SIZE, seed: int = DEFAULT_SEED,
                   tokenizer_max_chars: int = DEFAULT_TOKENIZER_MAX_CHARS, jsonl_key: str = "text",
                   fmt: str = "auto", suffixes: tuple[str, ...] = corpus.DEFAULT_SUFFIXES,
                   on_bad_line: str = "fail", workers: int = 1, force: bool = False, progress: bool = True,
                   log: Callable[[str], None] = print) -> dict:
    """Tokenize ``inputs`` (files/dirs) into ``output_prefix``; returns the prefix's metadata."""
    files = corpus.expand_inputs(inputs, fmt, suffixes)
    corpus.check_on_bad_line(on_bad_line)
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    if tokenizer is None:
        tok = train_or_reuse_tokenizer(files, os.path.join(out_dir, "tokenizer.model"), vocab_size=vocab_size,
                                       seed=seed, max_chars=tokenizer_max_chars, jsonl_key=jsonl_key,
                                       on_bad_line=on_bad_line, force=force, overwrite_other=False, log=log)
    else:
        tok = install_tokenizer(tokenizer, out_dir, force=force)
    return build_prefix(files, output_prefix, tok, jsonl_key=jsonl_key, on_bad_line=on_bad_line,
                        workers=workers, force=force, progress=progress, log=log)


def build_prefix(files: list[corpus.InputFile], prefix: str, tok: Tokenizer, *, jsonl_key: str = "text",
                 on_bad_line: str = "fail", workers: int = 1, force: bool = False, progress: bool = True,
                 log: Callable[[str], None] = print) -> dict:
    """``write_indexed_dataset`` unless ``prefix`` is up to date for these inputs and tokenizer."""
    params = {"inputs": corpus.fingerprint(files), "jsonl_key": jsonl_key, "on_bad_line": on_bad_line,
              "tokenizer": tok.fingerprint}
    if not force and is_up_to_date(prefix, params):
        log(f"{prefix}: up to date")
        return read_metadata(prefix)
    meta = write_indexed_dataset(files, prefix, tok, jsonl_key=jsonl_key, on_bad_line=on_bad_line,
                                 workers=workers, progress=progress, params=params)
    log(f"{prefix}: {meta['documents']} documents, {meta['tokens']} tokens ({meta['seconds']:.1f} s)")
    report = corpus.ReadStats(**meta["read"]).report()
    if report:
        log(f"{prefix}: {report}")
    return meta


def _load_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _write_json(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)
