"""H2O (Zhang et al., 2023): a window of recent tokens plus the heavy hitters, the entries with the
largest attention probability accumulated over every query so far (the prompt's included).

GQA: a KV head's probability is the sum over its G query heads. The budget is split between the
recent window and the heavy hitters by ``recent_fraction`` (0.5: equally, as in H2O and LESS).
"""

from __future__ import annotations

from dataclasses import dataclass

from dmc_train.errors import ConfigError
from dmc_train.policies.base import PolicyConfig, Scorer
from kernels.paged import attention_column_sums


@dataclass
class H2OConfig(PolicyConfig):
    recent_fraction: float = 0.5  # share of the budget for the recent window (the rest: heavy hitters)

    def check(self) -> None:
        super().check()
        if not 0 <= self.recent_fraction <= 1:
            raise ConfigError(f"recent_fraction={self.recent_fraction} must be in [0, 1]")


class H2O(Scorer):
    name = "h2o"
    Config = H2OConfig
    attention = "probs"

    def fixed(self, budget):
        return 0, int(round(self.cfg.recent_fraction * budget))

    def prompt_scores(self, q, k, layer):
        return attention_column_sums(q, k, self.scale)

    def update(self, entries, attention, step):
        entries.scores += attention
