"""DMC as an attention variant of the Llama layer spec: the attention modules, the CR-loss plumbing
that reaches every layer's decisions, and the one weight edit DMC makes (zeroing the decision rows).

A method selects it with ``build_model(cfg, attention=dmc_self_attention_spec(state))``.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.spec_utils import ModuleSpec

from dmc_train.models.dmc.attention import DecisionHandoff, DMCCoreAttention, DMCSelfAttention, DMCState
from dmc_train.models.dmc.cr_loss import FORMS, CRLossTracker
from dmc_train.models.layer_loss import AttachLoss
from dmc_train.models.llama_weights import qkv_by_group

__all__ = ["FORMS", "AttachLoss", "CRLossTracker", "DMCCoreAttention", "DMCSelfAttention", "DMCState",
           "DecisionHandoff", "dmc_self_attention_spec", "track_chunks", "zero_decision_rows"]


def dmc_self_attention_spec(state: DMCState) -> ModuleSpec:
    """The ``self_attention`` entry of the layer spec for DMC; every layer shares ``state``."""
    return ModuleSpec(module=DMCSelfAttention, params={"dmc_state": state})


def track_chunks(chunks: list[torch.nn.Module], tracker: CRLossTracker) -> None:
    """Tell ``tracker`` when each model chunk's forward starts and ends (it counts micro-batches per
    chunk and launches the CR-loss reduction once all of a rank's chunks ran one)."""
    for i, chunk in enumerate(chunks):
        chunk.register_forward_pre_hook(lambda *_, i=i: tracker.begin_chunk(i))
        chunk.register_forward_hook(lambda *_, i=i: tracker.end_chunk(i))


@torch.no_grad()
def zero_decision_rows(chunks: list[torch.nn.Module], channel: int) -> None:
    """Zero the W_q / W_k rows of decision channel ``channel`` in every DMC layer of ``chunks``
    (the G query heads and the key head of every local query group)."""
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, DMCSelfAttention):
                rows = qkv_by_group(module.linear_qkv.weight, module.num_attention_heads_per_partition,
                                    module.num_query_groups_per_partition)  # [groups, G + 2, d, hidden]
                rows[:, :-1, channel, :] = 0
