"""``launch/pretrain.py`` plus a test-only method that makes chosen steps non-finite (the NaN guard's tests).

    python tests/scripts/pretrain_nonfinite.py +recipe=tiny_pretrain method=inject_nonfinite method.at=[3,4]

At the steps in ``method.at`` (1-based, as logged) the LM loss is weighted by NaN, so the loss
gradient of every parameter is NaN (the logged LM loss itself stays finite).
"""

from dataclasses import dataclass, field

from dmc_train.methods import register_method
from dmc_train.methods.base import Method


@dataclass
class NonFiniteConfig:
    name: str = "inject_nonfinite"
    at: list[int] = field(default_factory=list)

    @staticmethod
    def check(cfg) -> None:
        pass


class NonFiniteMethod(Method):
    def before_step(self, step, model_chunks) -> None:
        self.lm_loss_weight = float("nan") if step + 1 in self.cfg.method.at else 1.0


register_method("inject_nonfinite", NonFiniteConfig, f"{__name__}:NonFiniteMethod")

if __name__ == "__main__":
    from launch.pretrain import main

    main()
