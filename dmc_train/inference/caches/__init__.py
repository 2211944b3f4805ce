"""KV caches of the inference engine, one interface (:class:`KVCache`, ``base.py``), one file each.

    full   every token (vanilla; also GQA models, whose rows are their fewer KV heads)
    dmc    Dynamic Memory Compression, Algorithm 1 (DMC and Fixed Memory Pooling checkpoints)

The eviction policies and LESS register theirs in :data:`CACHES` the same way.
"""

from __future__ import annotations

from dmc_train.inference.caches.base import KVCache, TokenInfo
from dmc_train.inference.caches.dmc import DMCCache, teacher_forced_dmc
from dmc_train.inference.caches.full import FullCache, causal_attention

CACHES: dict[str, type[KVCache]] = {"full": FullCache, "dmc": DMCCache}

__all__ = ["CACHES", "DMCCache", "FullCache", "KVCache", "TokenInfo", "causal_attention", "teacher_forced_dmc"]
