"""Run logging: a progress line on rank 0, ``metrics.jsonl`` in the run directory, wandb when configured."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Optional

from dmc_train.distributed import is_rank0


def format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class RunLogger:
    """Rank 0 writes; other ranks' calls are no-ops. ``log`` appends one JSON object per line.

    Rows of steps after ``start_step`` (logged by a run that stopped before its next checkpoint, and
    trained again now) are dropped first, so each step appears once in ``metrics.jsonl``.
    """

    def __init__(self, run_dir: str, total_steps: int, tokens_per_step: int, cfg: Optional[Any] = None,
                 progress: bool = True, start_step: int = 0):
        self.active = is_rank0()
        self.total_steps, self.tokens_per_step, self.progress = total_steps, tokens_per_step, progress
        self.t_start = time.perf_counter()
        self.t_last, self.step_last = self.t_start, start_step
        self.wandb = None
        if not self.active:
            return
        os.makedirs(run_dir, exist_ok=True)
        path = os.path.join(run_dir, "metrics.jsonl")
        _drop_rows_after(path, start_step)
        self.metrics_file = open(path, "a", buffering=1)
        if cfg is not None and cfg.logging.wandb_project:
            self.wandb = _start_wandb(cfg, run_dir)

    def log(self, step: int, metrics: dict, exclude_seconds: float = 0.0) -> None:
        """Record metrics of optimizer step ``step`` (1-based) and print the progress line.

        ``exclude_seconds`` (e.g. time spent evaluating) is left out of tokens/s and the ETA.
        """
        if not self.active:
            return
        now = time.perf_counter()
        done_steps = step - self.step_last
        dt = now - self.t_last - exclude_seconds
        tok_s = done_steps * self.tokens_per_step / dt if dt > 0 else 0.0
        eta = (self.total_steps - step) * dt / max(done_steps, 1)
        self.t_last, self.step_last = now, step
        record = {"step": step, **metrics, "tokens_per_s": round(tok_s, 1), "time_s": round(now - self.t_start, 3)}
        self.metrics_file.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            self.wandb.log(record, step=step)
        if self.progress:
            shown = "  ".join(_fmt(k, v) for k, v in metrics.items() if not isinstance(v, (list, dict)))
            print(f"[{step}/{self.total_steps}] {shown}  tok/s {tok_s:,.0f}  eta {format_duration(eta)}",
                  file=sys.stdout, flush=True)

    def info(self, message: str) -> None:
        if self.active:
            print(message, flush=True)

    def close(self) -> None:
        if self.active:
            self.metrics_file.close()
            if self.wandb is not None:
                self.wandb.finish()


def _drop_rows_after(path: str, step: int) -> None:
    """Keep the rows of ``path`` up to ``step`` (and no torn last line); the file is replaced atomically."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = f.readlines()
    kept = [line for line in lines if _row_step(line) <= step]
    if len(kept) < len(lines):
        with open(path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)


def _row_step(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf


def _fmt(key: str, value) -> str:
    if isinstance(value, float):
        return f"{key} {value:.4g}" if abs(value) >= 1e-3 or value == 0 else f"{key} {value:.3e}"
    return f"{key} {value}"


def _start_wandb(cfg: Any, run_dir: str):
    import wandb
    from omegaconf import OmegaConf

    mode = cfg.logging.wandb_mode or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
    return wandb.init(project=cfg.logging.wandb_project, name=cfg.run_name, dir=run_dir, mode=mode,
                      config=OmegaConf.to_container(cfg, resolve=True))
