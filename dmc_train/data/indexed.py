"""Tokenize a corpus into a megatron-core indexed dataset: ``<prefix>.bin``, ``<prefix>.idx``, ``<prefix>.json``.

``.bin``/``.idx`` are megatron-core's format (``IndexedDatasetBuilder``): one sequence per input
document, in input order, each ending with the tokenizer's EOS id; dtype uint16 when the vocabulary
has fewer than 65,500 tokens, else int32. ``<prefix>.json`` is our metadata, written last::

    {"format": "dmc_train.indexed/1", "documents": int, "tokens": int (EOS included),
     "vocab_size": int, "eos_id": int, "bos_id": int|null, "pad_id": int|null, "dtype": "uint16",
     "tokenizer": {"kind": str, "path": str, "fingerprint": sha256}, "read": {counters of skipped
     and repaired input, see corpus.ReadStats}, "params": {what the output was made from},
     "bin_bytes": int, "idx_bytes": int, "seconds": float}

Outputs are written under temporary names and renamed at the end (the old ``.json`` is removed
first), so an interrupted run never leaves a half-written file under the final names, and a prefix
counts as complete only when its ``.json`` exists and matches the ``.bin``/``.idx`` sizes.

Workers (``multiprocessing`` spawn context) parse and tokenize batches; results are consumed in
input order, so the bytes written do not depend on the number of workers.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time

import numpy as np

from dmc_train.data import corpus
from dmc_train.data.tokenizer import Tokenizer, load_tokenizer
from dmc_train.errors import DataError

FORMAT = "dmc_train.indexed/1"

_worker_tokenizer: Tokenizer | None = None


def metadata_path(prefix: str) -> str:
    return prefix + ".json"


def read_metadata(prefix: str) -> dict | None:
    """The prefix's metadata if the prefix is complete (``.json`` present and matching), else None."""
    try:
        with open(metadata_path(prefix)) as f:
            meta = json.load(f)
        if meta.get("format") != FORMAT:
            return None
        for ext in ("bin", "idx"):
            if os.path.getsize(f"{prefix}.{ext}") != meta[f"{ext}_bytes"]:
                return None
        return meta
    except (OSError, ValueError, KeyError):
        return None


def is_up_to_date(prefix: str, params: dict) -> bool:
    meta = read_metadata(prefix)
    return meta is not None and meta.get("params") == json.loads(json.dumps(params))


def read_tokens(prefix: str) -> np.ndarray:
    """The whole token stream of a prefix (documents concatenated, EOS included), memory-mapped."""
    meta = read_metadata(prefix)
    if meta is not None:
        dtype = np.dtype(meta["dtype"])
    else:  # a prefix made by another tool: megatron's index header knows the dtype
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        dtype = IndexedDataset(prefix).index.dtype
    return np.memmap(prefix + ".bin", dtype=dtype, mode="r")


def _init_worker(tokenizer_path: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = load_tokenizer(tokenizer_path)


def _encode_batch(args: tuple) -> tuple:
    batch, jsonl_key = args
    docs, stats, bad = corpus.parse_batch(batch, jsonl_key)
    eos = _worker_tokenizer.eos_id
    arrays = [np.asarray(_worker_tokenizer.encode(d) + [eos], dtype=np.int32) for d in docs]
    return arrays, stats, bad, batch.nbytes


def _encoded(files, tokenizer_path: str, jsonl_key: str, workers: int):
    work = ((b, jsonl_key) for b in corpus.batches(files))
    if workers <= 1:
        _init_worker(tokenizer_path)
        yield from map(_encode_batch, work)
        return
    ctx = multiprocessing.get_context("spawn")  # fork after torch/megatron imports can deadlock
    with ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer_path,)) as pool:
        yield from pool.imap(_encode_batch, work, chunksize=1)


def write_indexed_dataset(files: list[corpus.InputFile], prefix: str, tokenizer: Tokenizer, *,
                          jsonl_key: str = "text", on_bad_line: str = "fail", workers: int = 1,
                          progress: bool = True, params: dict | None = None, desc: str = "") -> dict:
    """Tokenize ``files`` into ``prefix``; returns the metadata written to ``<prefix>.json``."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from tqdm import tqdm

    corpus.check_on_bad_line(on_bad_line)
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    tmp = f".tmp-{os.getpid()}"
    bin_tmp, idx_tmp, json_tmp = prefix + ".bin" + tmp, prefix + ".idx" + tmp, prefix + ".json" + tmp
    stats, n_tokens, t0 = corpus.ReadStats(), 0, time.time()
    bar = tqdm(total=sum(f.size for f in files), unit="B", unit_scale=True, desc=desc or os.path.basename(prefix),
               disable=not progress, file=sys.stderr, mininterval=0.5, dynamic_ncols=True)
    encoded, builder = _encoded(files, tokenizer.path, jsonl_key, workers), None
    try:
        builder = IndexedDatasetBuilder(bin_tmp, dtype=dtype)
        for arrays, batch_stats, bad, nbytes in encoded:
            corpus.check_bad_lines(bad, on_bad_line)
            for a in arrays:
                builder.add_document(a, [a.size])
                n_tokens += a.size
            stats.merge(batch_stats)
            elapsed = max(time.time() - t0, 1e-9)
            bar.set_postfix_str(f"docs={stats.documents} {stats.documents / elapsed:.0f} docs/s "
                                f"{n_tokens / elapsed:.0f} tok/s", refresh=False)
            bar.update(nbytes)
        builder.finalize(idx_tmp)
        bar.close()
        if stats.documents == 0:
            raise DataError(f"no documents in the input for {prefix} (all files empty or skipped: {stats.report()})")
        meta = {
            "format": FORMAT, "documents": stats.documents, "tokens": int(n_tokens),
            "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id, "bos_id": tokenizer.bos_id,
            "pad_id": tokenizer.pad_id, "dtype": np.dtype(dtype).name,
            "tokenizer": {"kind": tokenizer.kind, "path": os.path.abspath(tokenizer.path),
                          "fingerprint": tokenizer.fingerprint},
            "read": stats.as_dict(), "params": params or {},
            "bin_bytes": os.path.getsize(bin_tmp), "idx_bytes": os.path.getsize(idx_tmp),
            "seconds": round(time.time() - t0, 3),
        }
        with open(json_tmp, "w") as f:
            json.dump(meta, f, indent=1)
        if os.path.exists(metadata_path(prefix)):
            os.remove(metadata_path(prefix))
        os.replace(bin_tmp, prefix + ".bin")
        os.replace(idx_tmp, prefix + ".idx")
        os.replace(json_tmp, metadata_path(prefix))
        return meta
    finally:
        encoded.close()  # stops the worker pool
        bar.close()
        if builder is not None:
            builder.data_file.close()
        for p in (bin_tmp, idx_tmp, json_tmp):
            if os.path.exists(p):
                os.remove(p)
