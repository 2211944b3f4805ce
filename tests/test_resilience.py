"""Preemption (SIGUSR1 -> checkpoint -> requeue -> exact resume) and the NaN/Inf guard."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.helpers import ROOT, free_port, run

TINY = ["launch/pretrain.py", "+recipe=tiny_pretrain", "train.eval_interval=0", "checkpoint.save_interval=0",
        "train.log_interval=1"]


def step_losses(run_dir) -> dict[int, float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["lm_loss"] for r in map(json.loads, f)}


def fake_scontrol(tmp_path) -> tuple[dict, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "scontrol.args"
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {record}\n')
    (bin_dir / "scontrol").chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242"}, str(record)


@pytest.mark.distributed
def test_sigusr1_checkpoints_requeues_and_resumes_exactly(tmp_path):
    steps = 60
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    run([*TINY, f"run_dir={ref_dir}", f"train.max_steps={steps}"], nproc=2)
    env, record = fake_scontrol(tmp_path)

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           *TINY, f"run_dir={run_dir}", f"train.max_steps={steps}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.02)
    for child in psutil.Process(proc.pid).children():  # the two ranks, as SLURM signals the job step
        child.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    stopped_at = max(step_losses(run_dir))
    assert stopped_at < steps, "the signal arrived too late to test anything"
    assert "stopped by" in out and "job requeued" in out
    with open(record) as f:
        assert f.read().split() == ["requeue", "4242"]
    latest = (run_dir / "checkpoints" / "latest").read_text()
    assert latest == f"iter_{stopped_at:07d}"

    run([*TINY, f"run_dir={run_dir}", f"train.max_steps={steps}"], nproc=2)  # the requeued job
    assert step_losses(run_dir) == step_losses(ref_dir)


FAULTY = ["tests/scripts/pretrain_nonfinite.py", *TINY[1:], "method=inject_nonfinite"]


def test_nan_step_is_skipped_and_training_continues(tmp_path):
    proc = run([*FAULTY, f"run_dir={tmp_path}/run", "train.max_steps=5", "method.at=[3]"])
    assert "step 3: non-finite loss or gradient, update skipped (1 in a row" in proc.stdout
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        rows = {r["step"]: r for r in map(json.loads, f)}
    assert rows[3].get("skipped") == 1 and all("skipped" not in rows[s] for s in (1, 2, 4, 5))
    assert all(rows[s]["lm_loss"] == rows[s]["lm_loss"] for s in (4, 5))  # finite again (not NaN)


def test_nan_streak_stops_with_last_good_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    proc = run([*FAULTY, f"run_dir={run_dir}", "train.max_steps=10", "method.at=[3,4,5]",
                "train.max_nonfinite_steps=3"], check=False)
    assert proc.returncode == 3, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "3 consecutive steps with a non-finite loss" in errors[0]
    assert (run_dir / "checkpoints" / "latest").read_text() == "iter_0000005"
    # the saved weights are the last good ones (after step 2): training resumes with finite losses
    run([*TINY, f"run_dir={run_dir}", "train.max_steps=7"])
    rows = step_losses(run_dir)
    assert all(rows[s] == rows[s] for s in (6, 7)) and rows[6] < 7.0
