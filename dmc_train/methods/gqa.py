"""GQA up-training (Ainslie et al. 2023, docs/METHODS.md#gqa-up-training): MHA -> G query groups by averaging K/V heads.

Converting to fewer groups keeps every query head in place and replaces the key (value) heads of
each new group by the mean of the old ones it merges (query head ``j`` belongs to group
``j // (heads/groups)``; the fused QKV layout is decoded by :mod:`dmc_train.models.llama_weights`).
Compression of the KV cache = heads / groups.
"""

from __future__ import annotations

import torch

from dmc_train.errors import ConfigError
from dmc_train.models.llama_weights import merge_qkv, split_qkv


def check_groups(num_heads: int, groups_from: int, groups_to: int, tensor_parallel: int = 1) -> None:
    """One-line ConfigError unless ``groups_to`` divides the heads and the current groups (and TP)."""
    if groups_to < 1 or num_heads % groups_to:
        raise ConfigError(f"GQA groups={groups_to} must divide the number of attention heads ({num_heads})")
    if groups_from % groups_to:
        raise ConfigError(f"GQA groups={groups_to} must divide the model's current number of KV heads "
                          f"({groups_from}): each new group averages whole old groups")
    if tensor_parallel > 1 and groups_to % tensor_parallel:
        raise ConfigError(f"GQA groups={groups_to} must be divisible by parallel.tensor={tensor_parallel}")


def convert_qkv_weight(weight: torch.Tensor, num_heads: int, groups_from: int, groups_to: int) -> torch.Tensor:
    """``linear_qkv.weight [groups_from * (heads/groups_from + 2) * d, hidden]`` (full, TP=1) ->
    the same for ``groups_to`` groups, K/V heads averaged within each new group."""
    check_groups(num_heads, groups_from, groups_to)
    q, k, v = split_qkv(weight, num_heads, groups_from)
    merge = groups_from // groups_to

    def mean(x: torch.Tensor) -> torch.Tensor:  # consecutive old groups form a new one
        return x.reshape(groups_to, merge, *x.shape[1:]).mean(dim=1, dtype=torch.float64).to(weight.dtype)

    return merge_qkv(q, mean(k), mean(v))
