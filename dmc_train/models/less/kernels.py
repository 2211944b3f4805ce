"""LESS's learned kernels phi_q and phi_k, one small MLP per head, with the weights of all heads batched.

Per query head (``phi_q``) and per KV head (``phi_k``), with ``s`` = GELU, hidden width ``hidden``
and rank ``rank`` (:class:`~dmc_train.models.less_settings.LESSSettings`, 512 and 8 by default), the authors' form:

    phi_q(q) = | s( s(q W_q1 + b_q1) W_q2 + b_q2 ) |
    phi_k(k) = | k~ + (k~ W_int) * D2 |,   k~ = |D1| * s( s(k W_k1 + b_k1) W_k2 + b_k2 )

``D1`` and ``D2`` (``[heads, rank]``) start at ``init_scale``, so the state starts near zero
and the sparse policy alone is the warm start; dropout ``dropout`` after the first layer while
training; Xavier-uniform weights, zero biases. The absolute values keep ``phi_q(q) phi_k(k) >= 0``. The math is
:func:`kernels.less.phi_q` / :func:`kernels.less.phi_k` (the inference cache runs the same functions).

GQA: ``phi_q`` has one MLP per query head, ``phi_k`` one per KV head, and the state ``(H, z)`` lives
per KV head (fed by ``phi_k``, read by each of its G query heads through their own ``phi_q``). Under
tensor parallelism a rank holds the kernels of its own heads (``heads`` / ``kv_heads`` are the
partition's counts), like the attention weights they belong to.

Layouts: ``q [b, heads, n, d]`` -> ``[b, heads, n, rank]``; ``k [b, kv_heads, n, d]`` -> ``[b, kv_heads, n, rank]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from dmc_train.models.less_settings import LESSSettings
from kernels import less


@dataclass(frozen=True)
class KernelShape:
    """Sizes of one layer's kernels. ``heads`` / ``kv_heads``: this rank's (tensor-parallel partition);
    ``head_offset`` / ``kv_head_offset``: the global index of its first; ``total_heads`` / ``total_kv_heads``:
    the layer's. ``settings``: the kernels' width, rank, dropout and initial scale. ``seed``: the initial weights
    of every head are drawn from it alone, so every parallel layout starts from the same kernels."""

    heads: int
    kv_heads: int
    head_dim: int
    settings: LESSSettings = LESSSettings()
    head_offset: int = 0
    kv_head_offset: int = 0
    total_heads: int = 0  # 0: = heads (no tensor parallelism)
    total_kv_heads: int = 0
    seed: int = 0


def _weight(gen: torch.Generator, total: int, first: int, count: int, fan_in: int, fan_out: int):
    """Xavier-uniform ``[count, fan_in, fan_out]`` for heads ``first .. first + count`` of ``total`` (drawn for all)."""
    bound = (6.0 / (fan_in + fan_out)) ** 0.5
    w = (torch.rand(total, fan_in, fan_out, generator=gen) * 2 - 1) * bound
    return torch.nn.Parameter(w[first: first + count].clone())


class LESSKernels(torch.nn.Module):
    """phi_q and phi_k of one layer (module docstring)."""

    def __init__(self, shape: KernelShape):
        super().__init__()
        self.shape = shape
        s, k = shape, shape.settings
        gen = torch.Generator().manual_seed(s.seed)
        q_heads = (s.total_heads or s.heads, s.head_offset, s.heads)
        kv_heads = (s.total_kv_heads or s.kv_heads, s.kv_head_offset, s.kv_heads)
        self.q1, self.q2 = _weight(gen, *q_heads, s.head_dim, k.hidden), _weight(gen, *q_heads, k.hidden, k.rank)
        self.q1_bias = torch.nn.Parameter(torch.zeros(s.heads, k.hidden))
        self.q2_bias = torch.nn.Parameter(torch.zeros(s.heads, k.rank))
        self.k1, self.k2 = _weight(gen, *kv_heads, s.head_dim, k.hidden), _weight(gen, *kv_heads, k.hidden, k.rank)
        self.k1_bias = torch.nn.Parameter(torch.zeros(s.kv_heads, k.hidden))
        self.k2_bias = torch.nn.Parameter(torch.zeros(s.kv_heads, k.rank))
        self.k_int = _weight(gen, *kv_heads, k.rank, k.rank)
        self.d1 = torch.nn.Parameter(torch.full((s.kv_heads, k.rank), k.init_scale))
        self.d2 = torch.nn.Parameter(torch.full((s.kv_heads, k.rank), k.init_scale))
        for p in self.parameters():  # split by heads over tensor-parallel ranks (grad norm, checkpoints)
            set_tensor_model_parallel_attributes(p, True, 0, 1)

    def phi_q(self, q: torch.Tensor) -> torch.Tensor:
        return less.phi_q(q, dict(self.named_parameters()), self.shape.settings.dropout, self.training)

    def phi_k(self, k: torch.Tensor) -> torch.Tensor:
        return less.phi_k(k, dict(self.named_parameters()), self.shape.settings.dropout, self.training)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        """Every tensor is split by heads (dim 0) over the tensor-parallel ranks, like the heads themselves."""
        state = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, {name: 0 for name in state}, sharded_offsets)
