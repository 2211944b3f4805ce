"""Stop signals as a cluster delivers them, table-driven: SIGUSR1 and SIGTERM sent to every process, to
the task's process group, to the torchrun agent alone or to one rank alone, under plain torchrun and
under the Slurm node wrapper (launch/slurm/torchrun_node.sh), and to a single process.

The cases of one layout form a chain in one run directory: each launch resumes from the checkpoint the
previous case's signal left, trains to its case's step, where the test-only method of
tests/scripts/pretrain_hold.py holds the ranks until the signal has arrived (so the stop step is exact
whatever the machine's speed), and gets the signal. Each case checks: the launcher's exit code (see
docs/CLUSTER.md, "What survives what"), a complete checkpoint at exactly that step, the requeue (SIGUSR1
only), no traceback from any rank, and every checkpoint and metrics row written before byte-for-byte
untouched. The last launch runs to the end, and the chain's losses must equal an uninterrupted run's
exactly. The first case of each chain comes before any checkpoint exists; the single process's first
signal arrives during start-up (the model built, no step run yet).
"""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional

import psutil
import pytest

from tests.helpers import ROOT, free_port

STEPS = 18
TINY = ["tests/scripts/pretrain_hold.py", "+recipe=tiny_pretrain", "train.eval_interval=0", "train.log_interval=1",
        "checkpoint.save_interval=0", "checkpoint.keep_last=0", f"train.max_steps={STEPS}", "method=hold_for_signal"]
# torchrun's own option: SIGUSR1 joins the signals it forwards to the ranks (it has no handler for it otherwise)
FORWARD_USR1 = {"PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"}


@dataclass
class Case:
    id: str
    launcher: str  # "torchrun" | "wrapper" (launch/slurm/torchrun_node.sh around torchrun) | "process"
    sig: signal.Signals
    to: str  # "all" processes | the launcher's process "group" | the torchrun "agent" | "rank" 1 | "process"
    exit_code: int  # of the launched command (torchrun exits 1 after it forwarded a signal itself)
    at: int  # the step after which the signal arrives (0: during start-up: the run stops after step 1)
    env: Optional[dict] = None

    @property
    def requeue(self) -> bool:
        return self.sig == signal.SIGUSR1


TWO_RANKS = [  # the first case comes before the first checkpoint
    Case("usr1-all-wrapper", "wrapper", signal.SIGUSR1, "all", 0, at=2),  # Slurm --signal, proctrack/cgroup
    Case("term-agent", "torchrun", signal.SIGTERM, "agent", 1, at=4),
    Case("usr1-rank", "torchrun", signal.SIGUSR1, "rank", 0, at=6),
    Case("term-all-wrapper", "wrapper", signal.SIGTERM, "all", 1, at=8),  # scancel / time limit, proctrack/cgroup
    Case("usr1-agent", "torchrun", signal.SIGUSR1, "agent", 1, at=10, env=FORWARD_USR1),
    Case("term-rank-wrapper", "wrapper", signal.SIGTERM, "rank", 0, at=12),
    Case("usr1-group-wrapper", "wrapper", signal.SIGUSR1, "group", 0, at=14),  # Slurm --signal, proctrack/pgid
]
ONE_PROCESS = [
    Case("term-startup", "process", signal.SIGTERM, "process", 0, at=0),
    Case("usr1-process", "process", signal.SIGUSR1, "process", 0, at=3),
]


def command(launcher: str, args: list[str]) -> list[str]:
    torchrun = ["--nproc_per_node=2", f"--master_port={free_port()}", *args]
    if launcher == "wrapper":
        return ["bash", os.path.join(ROOT, "launch", "slurm", "torchrun_node.sh"), *torchrun]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *torchrun]
    return [sys.executable, *args]


def environment(tmp_path, extra: Optional[dict] = None) -> dict:
    """A fake ``scontrol`` (records its arguments), SLURM_JOB_ID, the venv's torchrun on PATH, and a
    torchrun shutdown limit no loaded machine reaches (it SIGKILLs the ranks 30 s after forwarding)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.log"}\n')
    (bin_dir / "scontrol").chmod(0o755)
    path = os.pathsep.join([str(bin_dir), os.path.dirname(sys.executable), os.environ["PATH"]])
    return {**os.environ, "PATH": path, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "SLURM_JOB_ID": "4242",
            "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "900", **(extra or {})}


def snapshot(run_dir) -> dict[str, str]:
    """sha256 of every file under checkpoints/ but the ``latest`` pointer, and of metrics.jsonl."""
    found = {}
    for root, _, files in os.walk(run_dir / "checkpoints"):
        for name in files:
            path = os.path.join(root, name)
            if name != "latest":
                found[os.path.relpath(path, run_dir)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return found


def losses(run_dir) -> dict[int, float]:
    with open(run_dir / "metrics.jsonl") as f:
        return {r["step"]: r["lm_loss"] for r in map(json.loads, f)}


def targets(case: Case, proc: subprocess.Popen) -> list[psutil.Process]:
    top = psutil.Process(proc.pid)
    if case.launcher == "process":
        return [top]
    agent = top.children()[0] if case.launcher == "wrapper" else top
    ranks = sorted(agent.children(), key=lambda p: p.pid)
    assert len(ranks) == 2, ranks
    rank1 = next(p for p in ranks if p.environ().get("RANK") == "1")
    return {"all": [top, agent, *ranks] if top != agent else [agent, *ranks], "agent": [agent],
            "rank": [rank1]}[case.to]


def run_case(case: Case, run_dir, tmp_path, holds: list[int], nranks: int):
    """Launch, wait until every rank holds at ``case.at``, deliver the case's signal, wait for the end."""
    hold_dir = tmp_path / "hold"
    log = tmp_path / f"{case.id}.log"
    args = [*TINY, f"run_dir={run_dir}", f"method.at=[{','.join(map(str, holds))}]", f"method.dir={hold_dir}"]
    with open(log, "w") as out:
        proc = subprocess.Popen(command(case.launcher, args), cwd=ROOT, env=environment(tmp_path, case.env),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        ready = [hold_dir / f"ready.{case.at}.{r}" for r in range(nranks)]
        deadline = time.monotonic() + 600
        while not all(p.exists() for p in ready):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-5000:]
            time.sleep(0.05)
        if case.to == "group":
            os.killpg(proc.pid, case.sig)
        else:
            for p in targets(case, proc):
                p.send_signal(case.sig)
        code = proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return code, log.read_text()


def run_chain(cases: list[Case], tmp_path, nranks: int):
    launcher = "torchrun" if nranks > 1 else "process"
    ref, run_dir = tmp_path / "ref", tmp_path / "run"
    ref_proc = subprocess.run(command(launcher, [*TINY, f"run_dir={ref}"]), cwd=ROOT, env=environment(tmp_path),
                              capture_output=True, text=True, timeout=900)
    assert ref_proc.returncode == 0, ref_proc.stderr[-5000:]
    holds = [case.at for case in cases]
    requeues, step = 0, 0
    for case in cases:
        step = case.at or step + 1  # where the run stops
        before = snapshot(run_dir) if run_dir.exists() else {}
        rows_before = (run_dir / "metrics.jsonl").read_bytes() if run_dir.exists() else b""
        code, out = run_case(case, run_dir, tmp_path, holds, nranks)
        where = f"case {case.id}: exit {code}\n{out[-6000:]}"
        assert code == case.exit_code, where
        assert max(losses(run_dir)) == step, where
        assert (run_dir / "checkpoints" / "latest").read_text() == f"iter_{step:07d}", where
        assert (run_dir / "checkpoints" / f"iter_{step:07d}" / "meta.json").exists(), where
        assert f"stopped by {case.sig.name} after step {step}" in out, where
        tracebacks = out.count("Traceback (most recent call last)")
        assert tracebacks == (1 if case.exit_code else 0), where  # torchrun's own SignalException only
        if case.exit_code:
            assert "SignalException" in out, where
        requeues += case.requeue
        calls = (tmp_path / "scontrol.log").read_text().splitlines() if (tmp_path / "scontrol.log").exists() else []
        assert calls == ["requeue 4242"] * requeues, where
        after = snapshot(run_dir)
        assert {k: after.get(k) for k in before} == before, where  # earlier checkpoints untouched
        assert (run_dir / "metrics.jsonl").read_bytes().startswith(rows_before), where
    done = subprocess.run(command(launcher, [*TINY, f"run_dir={run_dir}"]), cwd=ROOT, env=environment(tmp_path),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-5000:]
    assert losses(run_dir) == losses(ref)  # exactly the uninterrupted run's losses, every step
    assert sorted(losses(ref)) == list(range(1, STEPS + 1))


@pytest.mark.slow
@pytest.mark.distributed
def test_signals_under_torchrun_checkpoint_and_resume_exactly(tmp_path):
    run_chain(TWO_RANKS, tmp_path, nranks=2)


@pytest.mark.slow
def test_signals_to_a_single_process_checkpoint_and_resume_exactly(tmp_path):
    run_chain(ONE_PROCESS, tmp_path, nranks=1)
