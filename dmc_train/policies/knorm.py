"""Knorm (Devoto et al., 2024): keys with a low L2 norm tend to receive high attention, so the entries
with the largest key norm are evicted. No attention is needed (LSH-E's baseline).

Ties: in the first layer a token repeated at two positions has the same key norm up to rounding
(RoPE is a rotation), so which copy stays is decided by floating-point noise, as in kvpress; the
engine and the teacher-forced form can then keep different copies of the same token.
"""

from __future__ import annotations

from dmc_train.policies.base import PolicyConfig, Scorer


class Knorm(Scorer):
    name = "knorm"
    label = "Knorm"
    Config = PolicyConfig

    def prompt_scores(self, q, k, layer):
        return self.new_scores(k)

    def new_scores(self, k):
        return -k.float().norm(dim=-1)
