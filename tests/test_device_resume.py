"""A checkpoint moves between devices: written on the test device (``DMC_TEST_DEVICE``), resumed on the CPU, then
resumed on the test device again; the losses after each move are those of a run that never stopped (the same on
CPU; within float rounding of the other device's arithmetic on a GPU), so weights, optimizer state and data
position moved with it."""

import json
import os

import pytest

from tests.helpers import TEST_DEVICE, run

ON_CPU = {"CUDA_VISIBLE_DEVICES": ""}


def losses(run_dir) -> dict[int, float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["lm_loss"] for r in map(json.loads, f) if "lm_loss" in r}


def test_checkpoint_moves_between_devices(tmp_path):
    """DMC: its state (the CR schedule, the decisions' noise by step) moves along with the model's."""
    args = ["launch/pretrain.py", "+recipe=tiny_pretrain", "train.max_steps=4", "logging.progress=false",
            "method=dmc", "method.target_cr=2"]
    run([*args, f"run_dir={tmp_path}/whole"])
    moved = [*args, f"run_dir={tmp_path}/moved"]
    run([*moved, "train.max_steps_per_job=2"])  # steps 1-2 on the test device
    resumed_on_cpu = run([*moved, "train.max_steps_per_job=1"], env=ON_CPU).stdout  # step 3
    run(moved)  # step 4, back on the test device
    assert "resumed from" in resumed_on_cpu and "at step 2" in resumed_on_cpu
    if TEST_DEVICE == "cuda":
        assert "written on CUDA and resumes on CPU" in resumed_on_cpu
    whole, steps = losses(tmp_path / "whole"), losses(tmp_path / "moved")
    tol = 0.0 if TEST_DEVICE == "cpu" else 1e-4
    assert sorted(steps) == [1, 2, 3, 4]
    for step in (3, 4):
        assert steps[step] == pytest.approx(whole[step], rel=tol, abs=0), step
