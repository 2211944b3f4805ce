"""The NaN/Inf guard: a non-finite step is skipped; a streak stops the run without saving the weights that
produced it, at its newest checkpoint (real divergence, optim.lr=1e10: tests/test_fault_injection.py).

Preemption (SIGUSR1 -> checkpoint -> requeue -> exact resume) is tests/test_signals.py."""

import json
import os

from tests.helpers import run

TINY = ["launch/pretrain.py", "+recipe=tiny_pretrain", "train.eval_interval=0", "checkpoint.save_interval=0",
        "train.log_interval=1"]


def step_losses(run_dir) -> dict[int, float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["lm_loss"] for r in map(json.loads, f)}


FAULTY = ["tests/scripts/pretrain_nonfinite.py", *TINY[1:], "method=inject_nonfinite"]


def test_nan_step_is_skipped_and_training_continues(tmp_path):
    proc = run([*FAULTY, f"run_dir={tmp_path}/run", "train.max_steps=5", "method.at=[3]"])
    assert "step 3: non-finite loss or gradient, update skipped (1 in a row" in proc.stdout
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        rows = {r["step"]: r for r in map(json.loads, f)}
    assert rows[3].get("skipped") == 1 and all("skipped" not in rows[s] for s in (1, 2, 4, 5))
    assert all(rows[s]["lm_loss"] == rows[s]["lm_loss"] for s in (4, 5))  # finite again (not NaN)


def test_nan_streak_stops_without_saving_and_resumes_from_the_checkpoint_before(tmp_path):
    run_dir = tmp_path / "run"
    proc = run([*FAULTY, f"run_dir={run_dir}", "train.max_steps=10", "method.at=[3,4,5]",
                "train.max_nonfinite_steps=3", "checkpoint.save_interval=2"], check=False)
    assert proc.returncode == 3, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "3 consecutive steps with a non-finite loss" in errors[0]
    assert "the current weights produced them and are not saved" in errors[0]
    assert f"the newest checkpoint is {run_dir}/checkpoints/iter_0000002, saved before the streak" in errors[0]
    # the save due at step 4 waited for a finite step, which never came
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["iter_0000002", "latest"]
    run([*TINY, f"run_dir={run_dir}", "train.max_steps=7"])  # resumes at step 2: finite losses from step 3 on
    rows = step_losses(run_dir)
    assert sorted(rows) == list(range(1, 8))
    assert all(rows[s] == rows[s] for s in range(3, 8)) and rows[7] < 7.0
