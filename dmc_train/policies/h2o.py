"""H2O (Zhang et al., 2023): a window of recent tokens plus the heavy hitters, the entries with the
largest attention probability accumulated over every query so far (the prompt's included).

GQA: a KV head's probability is the sum over its G query heads. The budget is split between the
recent window and the heavy hitters by ``recent_fraction`` (0.5: equally, as in H2O and LESS).
"""

from __future__ import annotations

from dmc_train.policies.base import RecentWindowConfig, Scorer


class H2O(Scorer):
    name = "h2o"
    label = "H2O"
    Config = RecentWindowConfig  # recent_fraction 0.5: the rest of the budget for heavy hitters
    attention = "probs"

    def fixed(self, budget):
        return 0, self.cfg.recent(budget)

    def update(self, entries, attention, step):
        entries.scores += attention
