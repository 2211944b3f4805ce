"""A checkpoint write interrupted part-way leaves the previous checkpoint as ``latest`` and loadable."""

import os

import pytest

from tests.helpers import run


@pytest.mark.parametrize("mode", ["during_write", "before_rename"])
def test_crash_keeps_previous_latest(tmp_path, mode):
    run_dir = tmp_path / "run"
    proc = run(["tests/scripts/crash_during_save.py", str(run_dir), mode], check=False)
    assert proc.returncode == 9, proc.stderr[-2000:]
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest").read_text() == "iter_0000001"
    assert (ckpts / "iter_0000002.tmp").is_dir() and not (ckpts / "iter_0000002").exists()

    # resume=auto loads step 1, finishes the run, and cleans up the broken write
    proc = run(["launch/pretrain.py", "+recipe=tiny_pretrain", f"run_dir={run_dir}", "train.max_steps=3",
                "checkpoint.save_interval=1", "train.eval_interval=0"])
    assert "resumed from" in proc.stdout and "at step 1" in proc.stdout
    assert (ckpts / "latest").read_text() == "iter_0000003"
    assert sorted(os.listdir(ckpts)) == ["iter_0000001", "iter_0000002", "iter_0000003", "latest"]
