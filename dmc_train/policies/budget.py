"""A cache budget: the entries an eviction policy (or LESS) keeps per (sequence, layer, KV head).

    Budget.of(64).entries(1024)     -> 64     a number of entries
    Budget.of(0.25).entries(1024)   -> 256    a fraction of the context
    Budget.of(None)                 -> Budget(0.25), the default

A fraction is a fraction of the **context actually evaluated or generated**: the evaluated sequence length
(the harness, the study, the parallel form's ``tokens [b, n]``), a request's prompt + generated tokens
(transformers' ``PolicyCache``), the training sequence (LESS). Never of the model's maximum positions: a
model with 8,192 positions evaluated on 1,024-token sequences at ``0.25`` keeps 256 entries, not 2,048.

The number tells the two apart: an ``int`` >= 1 or a whole float > 1 is entries, a float in (0, 1] a
fraction (``1.0``: the whole context). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from dmc_train.errors import ConfigError

DEFAULT = 0.25


@dataclass(frozen=True)
class Budget:
    value: float = DEFAULT

    def __post_init__(self) -> None:
        v = self.value
        number = isinstance(v, (int, float)) and not isinstance(v, bool)
        entries = number and v >= 1 and float(v).is_integer() and (isinstance(v, int) or v > 1)
        fraction = number and isinstance(v, float) and 0 < v <= 1
        if not (entries or fraction):
            raise ConfigError(f"budget={v} must be a whole number of entries >= 1 or a fraction of the context in "
                              f"(0, 1]")

    @classmethod
    def of(cls, value: "float | Budget | None") -> "Budget":
        """``value`` as a budget (None: the default, 1/4 of the context); one-line :class:`ConfigError` if invalid."""
        if isinstance(value, Budget):
            return value
        return cls(DEFAULT if value is None else value)

    @property
    def is_fraction(self) -> bool:
        return isinstance(self.value, float) and self.value <= 1

    def entries(self, context: Optional[int]) -> int:
        """Entries kept for a ``context`` of that many tokens (at least 1). A fraction needs the context: without
        one (None) a one-line :class:`ConfigError` says to give entries."""
        if not self.is_fraction:
            return int(self.value)
        if context is None:
            raise ConfigError(f"budget={self.value} is a fraction of the context, and the context is not known here "
                              f"(requests of any length); give a number of entries, e.g. budget=256")
        return max(1, int(self.value * context))

    def report(self, context: int) -> dict[str, float]:
        """The budget both ways for ``context`` tokens: ``budget_entries`` and ``budget_fraction`` (of the context)."""
        n = self.entries(context)
        return {"budget_entries": n, "budget_fraction": n / context}
