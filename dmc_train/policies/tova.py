"""TOVA (Oren et al., 2024): evict the entry the current query attends to least; no accumulation.

Aggregation (option ``aggregate``): by default the probability is averaged over all query heads of
the layer, as in the TOVA paper and kvpress, so every KV head of a layer keeps the same positions;
``aggregate=kv_head`` scores each KV head by its own G query heads. After a prompt the scores are
the last prompt query's probabilities and the last prompt token is never dropped (kvpress pads it
with the maximum score); at decode step t the victim is the entry query t-1 attended to least,
which is TOVA's rule for a cache of B - 1 entries plus the current token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dmc_train.policies.base import PolicyConfig, Scorer


@dataclass
class TOVAConfig(PolicyConfig):
    aggregate: str = "layer"


class TOVA(Scorer):
    name = "tova"
    label = "TOVA"
    Config = TOVAConfig
    attention = "probs"

    def prompt_scores(self, q, k, layer):
        b, hk, n, d = k.shape
        q_last = q[:, :, -1].float().view(b, hk, -1, d)  # [b, H_kv, G, d]
        probs = torch.softmax(q_last @ k.float().transpose(2, 3) * self.scale, dim=-1)  # [b, H_kv, G, n]
        scores = probs.sum(2)
        scores[..., -1] = scores.amax(-1)  # kvpress: the last token is never pruned
        return scores

    def update(self, entries, attention, step):
        entries.scores.copy_(attention)
