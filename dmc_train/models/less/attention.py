"""LESS as an attention variant of the Llama layer spec, for distillation on the megatron trainer.

``LESSSelfAttention`` (the spec's ``self_attention``) is megatron's ``SelfAttention`` plus this layer's
:class:`~dmc_train.models.less.kernels.LESSKernels` (its partition's heads). Its ``LESSCoreAttention``
(the spec's ``core_attention``) returns the **full** causal attention, so the next layer gets the full
model's hidden state, and beside it computes from the same (detached) q, k, v:

- the policy's parallel form (:func:`dmc_train.policies.parallel.run_policy`): what every query keeps
  and when each entry is evicted, at the budget;
- LESS's attention (:func:`kernels.less.less_attention`) with the evicted pairs in the state;
- the layer's loss: the mean squared difference of the two outputs after the output projection
  (``linear_proj``, all-reduced over tensor parallel ranks), over the positions past the budget.

The loss joins the backward through :class:`LayerLoss` (see :func:`attach_layer_losses`), so each
layer's kernels learn from their own layer only, as in the paper, but all layers in one run.

Layouts follow megatron: ``query [s, b, heads/TP, d]``, ``key/value [s, b, groups/TP, d]``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from megatron.core import parallel_state
from megatron.core.transformer.attention import SelfAttention

from dmc_train import distributed
from dmc_train.models.attention import SDPACoreAttention
from dmc_train.models.less.kernels import KernelShape, LESSKernels
from dmc_train.models.less_settings import LESSSettings
from kernels.less import eviction_masks, less_attention


@dataclass
class LESSState:
    """What every LESS layer of a rank shares with the method: the policy at its budget, the kernels' settings,
    and the per-layer loss sums of the passes since the method last read them.

    ``evictions(q, k, v, layer) -> evicted_at [b, H_kv, n]``: the policy's parallel form (the method
    passes :func:`dmc_train.policies.parallel.run_policy` bound to its scorer; -1 = kept to the end)."""

    evictions: Callable[..., torch.Tensor]
    budget: int
    settings: LESSSettings = LESSSettings()
    num_layers: int = 1
    seed: int = 0  # the kernels of layer l start from seed + l, whatever the parallel layout
    sums: Optional[torch.Tensor] = None  # [num_layers, 2] float64: (MSE sum over micro-batches, micro-batches)

    def record(self, layer: int, mse: torch.Tensor) -> None:
        """Add a layer's MSE (a 0-dim tensor, kept on its device: no host round trip per layer)."""
        if self.sums is None:
            self.sums = torch.zeros(self.num_layers, 2, dtype=torch.float64, device=mse.device)
        self.sums[layer - 1, 0] += mse.detach().double()
        self.sums[layer - 1, 1] += 1

    def take(self) -> torch.Tensor:
        """The sums recorded so far (zeros if none), then forget them."""
        sums = self.sums if self.sums is not None else torch.zeros(self.num_layers, 2, dtype=torch.float64,
                                                                   device=distributed.device())
        self.sums = None
        return sums


class LESSSelfAttention(SelfAttention):
    """Megatron self-attention with this layer's LESS kernels (module docstring)."""

    def __init__(self, config, submodules, *args, less_state: LESSState, **kwargs):
        super().__init__(config, dataclasses.replace(submodules, core_attention=LESSCoreAttention), *args, **kwargs)
        s = less_state
        self.less_state = less_state
        tp = parallel_state.get_tensor_model_parallel_rank()
        heads, groups = self.num_attention_heads_per_partition, self.num_query_groups_per_partition
        self.less = LESSKernels(KernelShape(heads, groups, self.hidden_size_per_attention_head, s.settings,
                                            tp * heads, tp * groups, self.config.num_attention_heads,
                                            self.config.num_query_groups or self.config.num_attention_heads,
                                            s.seed + self.layer_number))
        self.core_attention.bind(self)
        self.pending_loss: Optional[torch.Tensor] = None


class LESSCoreAttention(SDPACoreAttention):
    """Full causal attention out; the LESS layer loss on the side (module docstring)."""

    def __init__(self, config, layer_number: int, *args, **kwargs):
        super().__init__(config, layer_number, *args, **kwargs)
        self.layer_number = layer_number  # global, 1-based
        self._owner: list[Any] = []  # the LESSSelfAttention (a list: not a registered submodule)

    def bind(self, owner: LESSSelfAttention) -> None:
        self._owner = [owner]

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, **kwargs):
        out = super().forward(query, key, value, attention_mask, attn_mask_type, **kwargs)
        owner = self._owner[0]
        q, k, v = (t.detach().permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        owner.pending_loss = self.layer_loss(owner, q, k, v, out.detach())
        return out

    def layer_loss(self, owner: LESSSelfAttention, q, k, v, full: torch.Tensor) -> torch.Tensor:
        """MSE between the full and the LESS attention after the output projection, positions >= budget."""
        st = owner.less_state
        b, h, n, d = q.shape
        scale = self.softmax_scale or d ** -0.5
        with torch.no_grad():
            visible, evicted = eviction_masks(st.evictions(q, k, v, self.layer_number - 1))
        less = less_attention(q, k, v, visible, evicted, owner.less.phi_q(q), owner.less.phi_k(k), scale)
        less = less.permute(2, 0, 1, 3).reshape(n, b, h * d).to(full.dtype)
        diff, _ = owner.linear_proj(full - less)  # [s, b, hidden], summed over the tensor-parallel heads
        mse = diff[st.budget:].float().pow(2).mean() if n > st.budget else diff.sum() * 0
        st.record(self.layer_number, mse)
        return mse
