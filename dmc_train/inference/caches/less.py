"""The LESS cache: any eviction policy's fixed budget plus a constant-size low-rank state per row that
holds every pair the policy evicts (Dong et al., 2024; the math is :mod:`kernels.less`).

It is an :class:`~dmc_train.inference.caches.evicting.EvictingCache` (same budget, victims, in-place
writes, page reservation) whose evicted pairs are folded into the state the step they are evicted,
before the new token overwrites them (:meth:`absorb`):

    H += phi_k(k)^T v,   z += phi_k(k)          per (sequence, layer, KV head) row

and whose attention adds the state to the kept entries' softmax attention (Eq. 3, combined in log space
with the paged attention's log-sum-exp): each query head reads its KV head's state through its own
``phi_q``. The prompt is prefilled with full attention as usual; the pairs the prompt's compression drops
enter the state at once. State per row: ``H [rank, d_v]`` and ``z [rank]`` fp32, beside the policy's.

The kernels' weights come from a LESS checkpoint (:class:`LESSWeights`, LESS's method hook, loaded with the model).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

from dmc_train.errors import InferenceError
from dmc_train.inference.caches.evicting import EvictingCache
from dmc_train.inference.method import InferenceMethod
from dmc_train.policies import Budget
from kernels.less import eviction_masks, less_attention, less_combine, phi_k, phi_q


@dataclass
class LESSWeights(InferenceMethod):
    """LESS's method hook: what a LESS checkpoint adds at inference, the policy it was trained with (``policy``,
    ``budget`` in entries, ``options``) and per layer the kernels' tensors (``layers[i]``: ``q1 [H, d, hidden]``, ...,
    ``d2 [H_kv, rank]``, the names of :class:`~dmc_train.models.less.kernels.LESSKernels`); its cache is ``less``."""

    policy: str
    budget: int
    options: dict = field(default_factory=dict)
    layers: list = field(default_factory=list)
    cache = "less"

    def to(self, device: torch.device) -> "LESSWeights":
        """These weights with the kernels' tensors on ``device``."""
        layers = [{name: t.to(device) for name, t in layer.items()} for layer in self.layers]
        return LESSWeights(self.policy, self.budget, self.options, layers)

    @property
    def rank(self) -> int:
        return self.layers[0]["q2"].shape[-1]

    @classmethod
    def from_saved(cls, saved: Any, state: dict[str, torch.Tensor], shape: Any) -> "LESSWeights":
        """Take the kernels out of a full (TP=1) megatron state dict (``decoder.layers.<i>.self_attention.less.<name>``,
        removed from ``state``); the policy from the saved run's ``method`` config node, its budget in entries for
        the context it was trained on (``train.seq_length``)."""
        pattern = re.compile(r"decoder\.layers\.(\d+)\.self_attention\.less\.(\w+)$")
        layers: dict[int, dict[str, torch.Tensor]] = {}
        for name in [n for n in state if pattern.search(n)]:
            layer, key = pattern.search(name).groups()
            layers.setdefault(int(layer), {})[key] = state.pop(name).float()
        method = saved.cfg.method
        budget = Budget.of(method.budget).entries(saved.cfg.train.seq_length)
        return cls(method.policy, budget, dict(method.policy_options), [layers[i] for i in sorted(layers)])

    def attention_with_evicted(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               evicted_at: torch.Tensor, scale: float) -> torch.Tensor:
        """The LESS cache's parallel form of ``layer``: ``q [b, H, n, d]``, ``k, v [b, H_kv, n, d]`` attended under
        a policy that evicted entry j at ``evicted_at [b, H_kv, n]`` (:class:`~dmc_train.policies.parallel.PolicyRun`),
        the evicted pairs in the state (:func:`kernels.less.less_attention`) -> ``[b, H, n, d_v]``."""
        w = self.layers[layer]
        return less_attention(q, k, v, *eviction_masks(evicted_at), phi_q(q, w), phi_k(k, w), scale)

    def check_tensor_parallel(self) -> None:
        raise InferenceError("a LESS checkpoint cannot run tensor-parallel; use tensor_parallel=1")


class LESSCache(EvictingCache):
    """An eviction policy plus LESS's state (module docstring)."""

    wants_evicted = True

    def __init__(self, pool, num_layers, num_kv_heads, scale, scorer, budget, context, weights: LESSWeights):
        super().__init__(pool, num_layers, num_kv_heads, scale, scorer, budget, context)
        self.weights, self.name = weights, "less"
        rows, dv = pool.block_table.shape[0], pool.v_pages.shape[-1]
        self._H = torch.zeros(rows, weights.rank, dv, device=self.device)
        self._z = torch.zeros(rows, weights.rank, device=self.device)

    H = property(lambda self: self._current("_H"), doc="``[rows, rank, d_v]`` fp32: each row's absorbed pairs")
    z = property(lambda self: self._current("_z"), doc="``[rows, rank]`` fp32: their normaliser")

    def add(self, seq_id: int, max_new_tokens: int = 0) -> None:
        super().add(seq_id, max_new_tokens)
        rows = self.rows[seq_id].flatten()
        self._H[rows], self._z[rows] = 0, 0

    def state_bytes(self, seq_id: int) -> int:
        return super().state_bytes(seq_id) + (self._H[0].nbytes + self._z[0].nbytes) * self.rows[seq_id].numel()

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        return {**super()._state_tensors(), "H": self._H, "z": self._z}

    def absorb(self, layer, state, where, k, v) -> None:
        """The evicted ``k [b, H_kv, m, d]``, ``v [b, H_kv, m, d_v]``: into ``H`` and ``z`` of rows ``where`` of
        ``state`` (:meth:`EvictingCache.absorb`)."""
        features = phi_k(k, self.weights.layers[layer])  # [b, H_kv, m, rank]
        H = (features.transpose(2, 3) @ v.float()).flatten(0, 1)  # [b H_kv, rank, d_v]
        z = features.sum(2).flatten(0, 1)
        if where is None:
            state["H"] += H
            state["z"] += z
        else:
            state["H"][where] += H
            state["z"][where] += z

    def attend(self, step, layer, q, scores, append):
        """:meth:`EvictingCache.attend` plus the row's state, combined with the kept entries' attention by its
        log-sum-exps (module docstring)."""
        g = q.shape[1] // self.num_kv_heads
        out, *extra = self.attend_planned(step, layer, q, append, scores=scores, return_lse=True)
        lse = extra[-1]  # [b * H_kv, G]
        w = self.weights.layers[layer]
        features = phi_q(q[:, :, None], w)[:, :, 0].reshape(-1, g, self.weights.rank)
        lin_num = features @ step.state["H"][layer]  # [b * H_kv, G, d_v]
        lin_den = (features * step.state["z"][layer][:, None]).sum(-1)
        out = less_combine(out.float(), lse, lin_num, lin_den).to(q.dtype)
        return out, (extra[0] if scores is not None else None)
