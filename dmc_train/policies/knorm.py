"""Knorm (Devoto et al., 2024): keys with a low L2 norm tend to receive high attention, so the entries
with the largest key norm are evicted. No attention is needed (LSH-E's baseline).

The norm is rounded to 1/1024: a token repeated at two positions has the same key norm (RoPE is a
rotation), and the rounding makes such ties exact, so the keep rule's tie-break (the newest stays)
decides them rather than floating-point noise of the projection.
"""

from __future__ import annotations

from dmc_train.policies.base import PolicyConfig, Scorer


class Knorm(Scorer):
    name = "knorm"
    Config = PolicyConfig

    def prompt_scores(self, q, k, layer):
        return self.new_scores(k)

    def new_scores(self, k):
        return -(k.float().norm(dim=-1) * 1024).round() / 1024
