"""A run directory is never trained over: one run at a time (``.lock``), no fresh start over existing
checkpoints, and a missing or corrupt ``latest`` pointer falls back to the newest complete checkpoint."""

import json
import os
import shutil
import socket
import subprocess

import pytest

from tests.helpers import run
from tests.test_bad_input import assert_one_line_error, tree_digest

TINY = ["launch/pretrain.py", "+recipe=tiny_pretrain", "train.eval_interval=0", "checkpoint.save_interval=4",
        "logging.progress=false"]
FALLBACK = "checkpoints/latest is missing or invalid; resuming from the newest complete checkpoint iter_0000008"


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """A finished 8-step run with complete iter_0000004 and iter_0000008; its lock is gone."""
    run_dir = tmp_path_factory.mktemp("base") / "run"
    run([*TINY, f"run_dir={run_dir}", "train.max_steps=8"])
    assert not (run_dir / ".lock").exists()
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["iter_0000004", "iter_0000008", "latest"]
    return run_dir


def copy_run(base_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(base_run, run_dir)
    return run_dir


def steps_logged(run_dir) -> list[int]:
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line)["step"] for line in f]


def dead_pid() -> int:
    proc = subprocess.Popen(["sleep", "0"])
    proc.wait()  # reaped: the PID names no process
    return proc.pid


def write_lock(run_dir, pid: int) -> None:
    (run_dir / ".lock").write_text(json.dumps({"host": socket.gethostname(), "pid": pid, "job": None}))


def test_resume_none_refuses_to_overwrite_checkpoints(base_run, tmp_path):
    run_dir = copy_run(base_run, tmp_path)
    (run_dir / "checkpoints" / "latest").unlink()  # even without the pointer
    before = tree_digest(run_dir / "checkpoints")
    proc = run([*TINY, f"run_dir={run_dir}", "train.max_steps=8", "checkpoint.resume=none"], check=False)
    assert_one_line_error(proc, f"run_dir {run_dir} already holds checkpoints (newest iter_0000008)",
                          "another run_name / run_dir", f"delete {run_dir}/checkpoints")
    assert tree_digest(run_dir / "checkpoints") == before
    assert not (run_dir / ".lock").exists()


@pytest.mark.parametrize("pointer", ["missing", "binary_garbage"])
def test_auto_resumes_from_newest_complete_checkpoint(base_run, tmp_path, pointer):
    """Also: a stale lock (dead PID) is reclaimed, a broken write (*.tmp) is ignored, the lock is gone after."""
    run_dir = copy_run(base_run, tmp_path)
    ckpts = run_dir / "checkpoints"
    if pointer == "missing":
        (ckpts / "latest").unlink()
    else:
        (ckpts / "latest").write_bytes(b"\xff\xfe\x00\x81garbage\x00")
    (ckpts / "iter_0000012.tmp").mkdir()  # an interrupted write is not a complete checkpoint
    write_lock(run_dir, dead_pid())
    kept = {name: tree_digest(ckpts / name) for name in ("iter_0000004", "iter_0000008")}
    proc = run([*TINY, f"run_dir={run_dir}", "train.max_steps=10"])
    assert FALLBACK in proc.stdout
    assert "resumed from" in proc.stdout and "at step 8" in proc.stdout
    assert "warning: reclaiming stale lock" in proc.stderr and str(run_dir / ".lock") in proc.stderr
    assert steps_logged(run_dir) == list(range(1, 11))  # 1-8 from the first run, then 9 and 10
    assert (ckpts / "latest").read_text() == "iter_0000010"
    assert {name: tree_digest(ckpts / name) for name in kept} == kept
    assert not (run_dir / ".lock").exists()


@pytest.mark.parametrize("pointer", [b"/etc", b""])
def test_invalid_pointer_is_named_with_the_checkpoint_to_use(base_run, tmp_path, pointer):
    run_dir = copy_run(base_run, tmp_path)
    (run_dir / "checkpoints" / "latest").write_bytes(pointer)
    before = tree_digest(run_dir / "checkpoints")
    proc = run([*TINY, f"run_dir={run_dir}", "train.max_steps=10", f"checkpoint.resume={run_dir}"], check=False)
    assert_one_line_error(proc, f"checkpoint pointer {run_dir}/checkpoints/latest is invalid",
                          f"checkpoint.resume={run_dir}/checkpoints/iter_0000008")
    assert "interrupted" not in proc.stderr
    assert tree_digest(run_dir / "checkpoints") == before


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.distributed)])
def test_live_lock_refuses_the_second_run(base_run, tmp_path, nproc):
    run_dir = copy_run(base_run, tmp_path)
    write_lock(run_dir, os.getpid())  # this test process is alive
    # one process takes the lock before Hydra writes anything; under torchrun, before checkpoints and metrics
    watched = [run_dir] if nproc == 1 else [run_dir / "checkpoints"]
    before = [tree_digest(p) for p in watched], (run_dir / ".lock").read_text(), steps_logged(run_dir)
    proc = run([*TINY, f"run_dir={run_dir}", "train.max_steps=10"], nproc=nproc, check=False, timeout=120)
    if nproc == 1:
        assert_one_line_error(proc, f"in use by PID {os.getpid()}", f"(lock {run_dir}/.lock)")
    else:  # torchrun exits 1 when a worker fails; every rank raised (none waits for a collective)
        assert proc.returncode != 0
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and f"in use by PID {os.getpid()}" in errors[0], proc.stderr[-3000:]
        assert "exitcode  : 2" in proc.stderr and "RunDirError" not in proc.stderr, proc.stderr[-3000:]
    # nothing written, the holder's lock kept
    assert ([tree_digest(p) for p in watched], (run_dir / ".lock").read_text(), steps_logged(run_dir)) == before
