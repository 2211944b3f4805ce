"""Tensor-parallel inference: each rank holds its heads' and its MLP part's slices of the HF-named weights.

Sharded as in training (megatron-core's column/row parallel layers): rank r of ``tp`` keeps query heads
``[r H/tp, (r+1) H/tp)``, the KV heads of their groups ``[r H_kv/tp, (r+1) H_kv/tp)`` (rows of q/k/v_proj,
columns of o_proj), and rows ``[r F/tp, (r+1) F/tp)`` of gate/up_proj (columns of down_proj). Embeddings,
norms and lm_head are replicated. The model all-reduces the output projection and the MLP down projection
(:class:`~dmc_train.inference.model.LlamaForInference`, ``group``), so every rank gets the same logits;
each rank's cache holds the rows of its own KV heads in its own pool.

    torchrun --nproc_per_node=2 launch/generate.py --checkpoint CKPT --tensor-parallel 2 --prompt "To be"
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from dmc_train import distributed
from dmc_train.errors import InferenceError

# caches whose state is per (sequence, layer, KV head) row and that the TP tests cover; the eviction policies,
# LESS and LightCache are refused (some aggregate scores over a layer's heads)
TP_CACHES = ("full", "dmc")


def check(shape, tp: int, method) -> None:
    """One-line errors for a model of ``shape`` with the method hook ``method`` (an
    :class:`~dmc_train.inference.method.InferenceMethod`) that cannot be split ``tp`` ways."""
    if tp < 1:
        raise InferenceError(f"tensor_parallel={tp} must be >= 1")
    if tp == 1:
        return
    for what, n in (("query heads", shape.num_heads), ("KV heads", shape.num_kv_heads),
                    ("MLP hidden size", shape.ffn_hidden_size)):
        if n % tp:
            raise InferenceError(f"tensor_parallel={tp} does not divide the model's {n} {what}; pick a divisor")
    method.check_tensor_parallel()


def shard_weights(weights: dict[str, torch.Tensor], shape, rank: int, tp: int):
    """Rank ``rank``'s slices of HF-named ``weights`` and its local shape (heads and MLP divided by ``tp``)."""
    d = shape.head_dim
    hq, hk, f = shape.num_heads // tp, shape.num_kv_heads // tp, shape.ffn_hidden_size // tp
    rows = {"q_proj": hq * d, "k_proj": hk * d, "v_proj": hk * d, "gate_proj": f, "up_proj": f}
    cols = {"o_proj": hq * d, "down_proj": f}
    local = {}
    for name, t in weights.items():
        kind = name.split(".")[-2] if name.endswith("_proj.weight") else None
        if kind in rows:
            local[name] = t[rank * rows[kind]: (rank + 1) * rows[kind]]
        elif kind in cols:
            local[name] = t[:, rank * cols[kind]: (rank + 1) * cols[kind]]
        else:
            local[name] = t
    return local, dataclasses.replace(shape, num_heads=hq, num_kv_heads=hk, ffn_hidden_size=f, kv_channels=d)


def start(tp: int) -> tuple[int, Optional[object]]:
    """``(rank, group)`` for ``tp`` ranks: ``(0, None)`` at tp=1 (nothing started, no environment read or
    changed); else the gloo group of the torchrun processes (one per rank)."""
    if tp == 1:
        return 0, None
    env = distributed.read_launch_env()
    if env.launcher != "torchrun" or env.world_size != tp:
        raise InferenceError(f"tensor_parallel={tp} needs {tp} processes, one per rank, and this is "
                             f"{'a single process' if env.world_size == 1 else f'{env.world_size} processes'}: "
                             f"run torchrun --nproc_per_node={tp} launch/generate.py ... --tensor-parallel {tp}")
    return env.rank, distributed.init_gloo_group(env)
