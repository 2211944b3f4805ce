"""Training datasets from indexed-dataset prefixes, built with megatron-core's GPT dataset machinery.

    train_ds, valid_ds, test_ds = build_gpt_datasets(
        ["data_cache/shakespeare/train"], valid_prefixes=["data_cache/shakespeare/valid"],
        test_prefixes=["data_cache/shakespeare/test"], seq_length=256, seed=1234,
        num_samples=(train_samples, valid_samples, None), tokenizer="data_cache/shakespeare/tokenizer.model",
        model_vocab_size=cfg.model.vocab_size)
    sample = train_ds[i]  # tokens, labels, position_ids: int64 [seq_length]; loss_mask: float32 [seq_length]

Either one blend split by documents with ``split`` ("969,30,1": train/valid/test weights), or
separate ``valid_prefixes``/``test_prefixes`` (then ``prefixes`` is the train blend and ``split`` is
ignored). ``weights`` blend the train prefixes (megatron ``BlendedDataset``); they need a train
sample count. ``num_samples`` entries may be None (= one epoch of that split). A split that is not
requested (0 samples, split weight 0, or no prefixes) comes back as None. ``tokenizer`` (a ``Tokenizer`` or a path)
defaults to the one recorded in the first prefix's ``.json``.

Samples are contiguous windows of ``seq_length + 1`` tokens over the documents (each ending with
EOS) in a seeded shuffled order; ``labels`` are ``tokens`` shifted by one. Sample ``i`` depends
only on the data, ``seed``, ``seq_length`` and ``num_samples``, so every rank sees the same samples.

Megatron caches its index arrays (``.npy``) under ``cache_dir`` (default: ``index_cache/`` beside
the first train prefix), in a subdirectory keyed by the prefixes' paths, sizes and mtimes, so
re-prepared data never reuses stale indices. Under ``torch.distributed`` every rank must call
``build_gpt_datasets`` (rank 0 builds the cache, the others read it after a barrier); the cache
directory must be shared by all ranks.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from typing import Any
from unittest import mock

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.tokenizers import MegatronTokenizerBase

from dmc_train.data.indexed import read_metadata
from dmc_train.data.tokenizer import Tokenizer, load_tokenizer
from dmc_train.errors import DataError, MissingPrefixError

SAMPLE_KEYS = ("tokens", "labels", "loss_mask", "position_ids")
SPLIT_NAMES = ("train", "valid", "test")


def check_vocab_fits(tokenizer_vocab: int, model_vocab: int) -> None:
    """The model's embedding must have a row for every token id the tokenizer can produce."""
    if tokenizer_vocab > model_vocab:
        raise DataError(f"the tokenizer has {tokenizer_vocab} tokens but the model's vocab_size is {model_vocab}: "
                        f"set model.vocab_size >= {tokenizer_vocab}")


def check_prefixes(prefixes: list[str]) -> None:
    """Every prefix has its ``.bin`` and ``.idx`` (one line naming the first missing one otherwise)."""
    for p in prefixes:
        missing = [ext for ext in (".bin", ".idx") if not os.path.isfile(p + ext)]
        if missing:
            raise MissingPrefixError(f"dataset prefix {p} not found (no {' / '.join(p + e for e in missing)}): "
                                     f"create it with `{_prepare_hint(p)}`")


def _prepare_hint(prefix: str) -> str:
    parent = os.path.basename(os.path.dirname(os.path.abspath(prefix)))
    if parent == "shakespeare" and os.path.basename(prefix) in SPLIT_NAMES:
        return "python launch/prepare_data.py"
    return f"python launch/prepare_data.py INPUTS... --output-prefix {prefix}"


def check_prefix_tokenizer(prefixes: list[str], tokenizer: Tokenizer) -> None:
    """Prefixes prepared by dmc_train (with a ``.json``) must have been tokenized by ``tokenizer``."""
    for p in prefixes:
        meta = read_metadata(p)
        if meta is not None and meta["tokenizer"]["fingerprint"] != tokenizer.fingerprint:
            raise DataError(f"{p} was tokenized with {meta['tokenizer']['path']}, not with {tokenizer.path} "
                            f"(different tokenizer): use that tokenizer or re-run launch/prepare_data.py")


class MegatronTokenizerAdapter(MegatronTokenizerBase):
    """What megatron's GPTDataset reads from a tokenizer: ``vocab_size``, ``eod``, ``pad`` (optional),
    ``eos`` and ``unique_identifiers`` (part of the index-cache key)."""

    def __init__(self, tokenizer: Tokenizer):
        super().__init__(tokenizer.path, {})
        self.tokenizer = tokenizer
        self.unique_identifiers = OrderedDict(
            [("class", "dmc_train"), ("kind", tokenizer.kind), ("fingerprint", tokenizer.fingerprint)])

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def vocab(self):
        raise NotImplementedError("not needed for pre-tokenized datasets")

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError("not needed for pre-tokenized datasets")

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def eod(self) -> int:
        return self.tokenizer.eos_id

    @property
    def eos(self) -> int:
        return self.tokenizer.eos_id

    @property
    def pad(self) -> int:
        if self.tokenizer.pad_id is None:  # megatron then uses -1, an id that never occurs
            raise AttributeError("tokenizer has no pad token")
        return self.tokenizer.pad_id


class GPTSamples(torch.utils.data.Dataset):
    """A megatron GPT/Blended dataset, returning only ``SAMPLE_KEYS`` (megatron's own is ``.inner``)."""

    def __init__(self, inner):
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> dict:
        sample = self.inner[int(i)]
        return {k: sample[k] for k in SAMPLE_KEYS}


def build_gpt_datasets(prefixes: list[str], *, seq_length: int, seed: int,
                       num_samples: tuple[int | None, int | None, int | None],
                       tokenizer: Tokenizer | str | None = None, weights: list[float] | None = None,
                       split: str = "969,30,1", valid_prefixes: list[str] | None = None,
                       test_prefixes: list[str] | None = None,
                       cache_dir: str | None = None, model_vocab_size: int | None = None,
                       ) -> tuple[GPTSamples | None, GPTSamples | None, GPTSamples | None]:
    """(train, valid, test) datasets; see the module docstring. Checks run before anything is built."""
    valid_prefixes, test_prefixes = list(valid_prefixes or []), list(test_prefixes or [])
    per_split = bool(valid_prefixes or test_prefixes)
    if not prefixes:
        raise DataError("no train dataset prefixes given (data.prefixes)")
    if weights is not None and len(weights) != len(prefixes):
        raise DataError(f"{len(weights)} weights for {len(prefixes)} prefixes: give one weight per prefix")
    if weights is not None and (any(w < 0 for w in weights) or sum(weights) <= 0):
        raise DataError(f"blend weights must be >= 0 with a positive sum (got {weights})")
    if len(num_samples) != 3 or all(n == 0 for n in num_samples):
        raise DataError(f"num_samples must be (train, valid, test), not all 0 (got {num_samples})")
    if weights is not None and len(prefixes) == 1:
        weights = None  # a blend of one
    if weights is not None and num_samples[0] is None:
        raise DataError("blend weights need a number of train samples (num_samples[0] is None)")
    all_prefixes = [os.path.abspath(p) for p in prefixes + valid_prefixes + test_prefixes]
    check_prefixes(prefixes + valid_prefixes + test_prefixes)
    tok = _resolve_tokenizer(tokenizer, prefixes[0])
    if model_vocab_size is not None:
        check_vocab_fits(tok.vocab_size, model_vocab_size)
    check_prefix_tokenizer(all_prefixes, tok)
    for p in all_prefixes:  # megatron builds samples from a corpus shorter than one sequence without a word
        index = IndexedDataset(p)  # kept alive while its memory-mapped lengths are read
        tokens = int(index.sequence_lengths.sum())
        if tokens <= seq_length:
            raise DataError(f"{p} holds {tokens} tokens, fewer than one training sequence (train.seq_length + 1 = "
                            f"{seq_length + 1}); prepare more text or lower train.seq_length")

    abs_train = [os.path.abspath(p) for p in prefixes]
    blend = (abs_train, list(map(float, weights)) if weights is not None else None)
    if per_split:
        blends = [blend] + [([os.path.abspath(p) for p in ps], None) if ps else None
                            for ps in (valid_prefixes, test_prefixes)]
        blends = [None if want == 0 else b for b, want in zip(blends, num_samples, strict=True)]
        for name, b in zip(SPLIT_NAMES, blends, strict=True):
            for p in (b[0] if b else []):
                if _num_documents(p) == 0:
                    raise DataError(f"{name} prefix {p} has no documents")
    else:
        _check_split_nonempty(abs_train, split, num_samples)

    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length,
        blend=None if per_split else blend, blend_per_split=blends if per_split else None,
        split=None if per_split else split,
        path_to_cache=_cache_dir(all_prefixes, cache_dir), tokenizer=MegatronTokenizerAdapter(tok),
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False, mid_level_dataset_surplus=0.005)
    if not per_split:  # splits asked for 0 samples are not built (an empty one would hang megatron)
        config.split_matrix = [None if want == 0 else bounds
                               for bounds, want in zip(config.split_matrix, num_samples, strict=True)]
    builder = BlendedMegatronDatasetBuilder(GPTDataset, list(num_samples), lambda: True, config)
    if torch.distributed.is_initialized():
        built = builder.build()
    else:
        # megatron-core 0.16.1's BlendedDataset calls torch.distributed.get_rank() on a cache miss
        # without checking is_initialized() (GPTDataset does check): answer 0 while building.
        with mock.patch.object(torch.distributed, "get_rank", lambda group=None: 0):
            built = builder.build()
    return tuple(GPTSamples(d) if d is not None else None for d in built)


def _resolve_tokenizer(tokenizer: Tokenizer | str | None, prefix: str) -> Tokenizer:
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    if tokenizer is None:  # the one the prefix was made with
        meta = read_metadata(prefix)
        if meta is None:
            raise DataError(f"no tokenizer given and {prefix}.json (which names it) is missing: set data.tokenizer")
        tokenizer = meta["tokenizer"]["path"]
    return load_tokenizer(tokenizer)


def _num_documents(prefix: str) -> int:
    return len(IndexedDataset(prefix))


def _check_split_nonempty(prefixes: list[str], split: str, num_samples) -> None:
    """megatron loops forever on a requested split with no documents: refuse instead, naming the prefix."""
    try:
        matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    except (AssertionError, ValueError, ZeroDivisionError):
        raise DataError(f"data split must be three non-negative weights like '969,30,1' (got {split!r})") from None
    for p in prefixes:
        n = _num_documents(p)
        for name, bounds, want in zip(SPLIT_NAMES, matrix, num_samples, strict=True):
            if bounds is None or want == 0:
                continue
            if int(round(bounds[1] * n)) - int(round(bounds[0] * n)) == 0:
                raise DataError(f"the {name} part of split '{split}' of {p} has no documents ({n} documents in all): "
                                f"change data.split or give separate valid/test prefixes")


def _cache_dir(prefixes: list[str], cache_dir: str | None) -> str:
    if cache_dir is None:
        cache_dir = os.path.join(os.path.dirname(prefixes[0]), "index_cache")
        parent = os.path.dirname(prefixes[0])
        if not os.access(parent, os.W_OK):
            raise DataError(f"cannot write megatron's index cache beside the data ({parent} is read-only): "
                            f"set data.cache_dir to a writable directory shared by all ranks")
    key = json.dumps([[p, os.path.getsize(p + ".bin"), os.path.getsize(p + ".idx"), os.stat(p + ".idx").st_mtime_ns]
                      for p in prefixes])
    return os.path.join(cache_dir, hashlib.sha256(key.encode()).hexdigest()[:16])


def build_datasets(cfg: Any, num_train_samples: int):
    """(train, valid, test) map-style datasets of dict samples (``tokens``, ``labels``, ``loss_mask``,
    ``position_ids``, each ``[seq_length]``); valid/test hold one epoch, test may be None."""
    if cfg.data.kind == "synthetic":
        from dmc_train.data.synthetic import SyntheticDataset

        held_out = max(cfg.train.eval_iters, 1) * cfg.train.global_batch_size
        return tuple(SyntheticDataset(cfg.model.vocab_size, cfg.train.seq_length, n, cfg.train.seed + k)
                     for k, n in enumerate((num_train_samples, held_out, held_out)))
    d = cfg.data
    return build_gpt_datasets(
        list(d.prefixes), weights=list(d.weights) if d.weights else None, split=d.split,
        valid_prefixes=list(d.valid_prefixes), test_prefixes=list(d.test_prefixes),
        seq_length=cfg.train.seq_length, seed=cfg.train.seed,
        num_samples=(num_train_samples, None, None if d.test_prefixes else 0),
        tokenizer=d.tokenizer, cache_dir=d.cache_dir, model_vocab_size=cfg.model.vocab_size)
