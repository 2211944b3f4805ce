"""StreamingLLM (Xiao et al., 2023), LESS's Lambda-masking: the ``n_sink`` first tokens (the attention
sinks) and the most recent ones. The priority is the position alone; no attention is needed."""

from __future__ import annotations

from dataclasses import dataclass

from dmc_train.errors import ConfigError
from dmc_train.policies.base import PolicyConfig, Scorer


@dataclass
class StreamingLLMConfig(PolicyConfig):
    n_sink: int = 4

    def check(self) -> None:
        super().check()
        if self.n_sink < 0:
            raise ConfigError(f"n_sink={self.n_sink} must be >= 0")


class StreamingLLM(Scorer):
    name = "streaming_llm"
    label = "StreamingLLM"
    Config = StreamingLLMConfig

    def fixed(self, budget):
        return self.cfg.n_sink, max(budget - self.cfg.n_sink, 0)

    def priority(self, entries, q, step):
        return entries.positions.float()
