"""``launch/pretrain.py`` plus a test-only method that holds the ranks after chosen steps until a signal
has arrived, so a test can deliver a stop signal at an exact step whatever the machine's speed.

    python tests/scripts/pretrain_hold.py +recipe=tiny_pretrain method=hold_for_signal \
        method.at=[3,6] method.dir=/tmp/hold

After each step in ``method.at`` (1-based, as logged; 0: during start-up, once the trainer is built and
before its first step) every rank creates ``<dir>/ready.<step>.<rank>`` and waits
(at most ``method.timeout`` seconds) until it has received a stop signal itself or another rank has:
the first rank to see its own signal creates ``<dir>/go.<step>``. The ranks are then past the step's
collectives and all ask the trainer's stop handler after this same step, so a signal delivered to any
of the processes stops the run right after ``step`` (before the first step for 0). The method changes
nothing else.
"""

import os
import time
from dataclasses import dataclass, field

from dmc_train.methods import register_method
from dmc_train.methods.base import Method


@dataclass
class HoldConfig:
    name: str = "hold_for_signal"
    at: list[int] = field(default_factory=list)
    dir: str = ""
    timeout: float = 600.0

    @staticmethod
    def check(cfg) -> None:
        pass


class HoldMethod(Method):
    def attach(self, trainer) -> None:
        self.trainer = trainer
        if 0 in self.cfg.method.at:  # start-up: the trainer is built, its first step not yet run
            self._hold(0, trainer.preemption)

    def after_step(self, step, model_chunks) -> dict:
        if step in self.cfg.method.at:
            self._hold(step, self.trainer.preemption)
        return {}

    def _hold(self, step, handler) -> None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        base = self.cfg.method.dir
        os.makedirs(base, exist_ok=True)
        open(os.path.join(base, f"ready.{step}.{rank}"), "w").close()
        go = os.path.join(base, f"go.{step}")
        deadline = time.monotonic() + self.cfg.method.timeout
        while not os.path.exists(go) and time.monotonic() < deadline:
            if handler.received is not None:
                open(go, "w").close()
                break
            time.sleep(0.01)


register_method("hold_for_signal", HoldConfig, f"{__name__}:HoldMethod")

if __name__ == "__main__":
    from launch.pretrain import main

    main()
