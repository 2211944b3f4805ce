"""Unigram baseline: the perplexity any language model should beat.

Token probabilities are the train split's token frequencies with add-one (Laplace) smoothing over the
whole vocabulary, ``p(t) = (count(t) + 1) / (N + V)``; the perplexity of an evaluation stream is
``exp(-mean log p(t))`` over all its tokens, EOS included (the same tokens a model is scored on).
"""

from __future__ import annotations

import math

import numpy as np


def unigram_counts(tokens: np.ndarray, vocab_size: int) -> np.ndarray:
    """``[vocab_size]`` int64 counts; ids outside the vocabulary raise ``ValueError``."""
    tokens = np.asarray(tokens)
    if tokens.size and int(tokens.max()) >= vocab_size:
        raise ValueError(f"token id {int(tokens.max())} is outside the vocabulary of {vocab_size}")
    return np.bincount(tokens.astype(np.int64, copy=False), minlength=vocab_size)


def unigram_perplexity(train_tokens: np.ndarray, eval_tokens: np.ndarray, vocab_size: int) -> float:
    """Perplexity of ``eval_tokens`` under add-one-smoothed unigram frequencies of ``train_tokens``."""
    counts = unigram_counts(train_tokens, vocab_size)
    log_p = np.log(counts + 1.0) - math.log(counts.sum() + vocab_size)
    eval_counts = unigram_counts(eval_tokens, vocab_size)
    n = eval_counts.sum()
    if n == 0:
        raise ValueError("the evaluation stream is empty")
    return float(math.exp(-float(eval_counts @ log_p) / n))


def prefix_unigram_perplexity(train_prefix: str, eval_prefix: str, vocab_size: int | None = None) -> float:
    """``unigram_perplexity`` of two indexed-dataset prefixes (vocab size from their metadata by default)."""
    from dmc_train.data.indexed import read_metadata, read_tokens

    if vocab_size is None:
        meta = read_metadata(train_prefix)
        if meta is None:
            raise ValueError(f"{train_prefix}.json is missing: pass vocab_size")
        vocab_size = meta["vocab_size"]
    return unigram_perplexity(read_tokens(train_prefix), read_tokens(eval_prefix), vocab_size)
