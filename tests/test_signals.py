"""Stop signals as a cluster delivers them, table-driven: SIGUSR1 and SIGTERM sent to every process, to
the task's process group, to the torchrun agent alone or to one rank alone, under plain torchrun and
under the Slurm node wrapper (launch/slurm/torchrun_node.sh), and to a single process; after a step or at
a moment of start-up.

The cases of one layout form a chain in one run directory: each launch resumes from the checkpoint the
previous case's signal left, trains to its case's step, where the test-only method of
tests/scripts/pretrain_hold.py holds the ranks until the signal has arrived (so the stop step is exact
whatever the machine's speed), and gets the signal. Each case checks: the launcher's exit code (see
docs/CLUSTER.md, "What survives what"), a complete checkpoint at exactly that step, the requeue (SIGUSR1
only), no traceback from any rank, and every checkpoint and metrics row written before byte-for-byte
untouched. The last launch runs to the end, and the chain's losses must equal an uninterrupted run's
exactly. The first case of each chain comes before any checkpoint exists.

A start-up case delivers its signal at a moment of start-up instead (``Case.moment``): the wrapper has
just started (torchrun not yet), torchrun runs but has no ranks yet, the ranks have just been started,
the ranks' handler is in place (their imports still running), or the trainer is built (held, before its
first step). The run must stop before its first step, write nothing (nothing new to save: every file
of the run directory byte-for-byte unchanged, ``latest`` too) and requeue after SIGUSR1.
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

from tests.helpers import ROOT, free_port, run

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
    at: int = 0  # the step after which the signal arrives (0: a start-up case, see moment)
    env: Optional[dict] = None
    # start-up cases: "wrapper" (its traps set, torchrun not started), "agent" (torchrun running, no ranks
    # yet), "ranks" (the ranks just started), "handler" (the targets' and ranks' handlers installed),
    # "built" (the trainer built, held before its first step)
    moment: Optional[str] = None

    @property
    def requeue(self) -> bool:
        return self.sig == signal.SIGUSR1


TWO_RANKS = [  # the first case comes before the first checkpoint
    Case("usr1-group-wrapper-startup", "wrapper", signal.SIGUSR1, "group", 0, moment="wrapper"),
    Case("usr1-all-wrapper", "wrapper", signal.SIGUSR1, "all", 0, at=2),  # Slurm --signal, proctrack/cgroup
    Case("term-all-wrapper-startup", "wrapper", signal.SIGTERM, "all", 0, moment="agent"),
    Case("term-agent", "torchrun", signal.SIGTERM, "agent", 1, at=4),
    Case("usr1-all-wrapper-startup", "wrapper", signal.SIGUSR1, "all", 0, moment="ranks"),
    Case("usr1-rank", "torchrun", signal.SIGUSR1, "rank", 0, at=6),
    Case("usr1-rank-startup", "torchrun", signal.SIGUSR1, "rank", 0, moment="handler"),
    Case("term-all-wrapper", "wrapper", signal.SIGTERM, "all", 0, at=8),  # scancel / time limit, proctrack/cgroup
    Case("term-agent-startup", "torchrun", signal.SIGTERM, "agent", 1, moment="handler"),
    Case("usr1-agent", "torchrun", signal.SIGUSR1, "agent", 1, at=10, env=FORWARD_USR1),
    Case("usr1-agent-startup", "torchrun", signal.SIGUSR1, "agent", 1, env=FORWARD_USR1, moment="built"),
    Case("term-rank-wrapper", "wrapper", signal.SIGTERM, "rank", 0, at=12),
    Case("term-rank-wrapper-startup", "wrapper", signal.SIGTERM, "rank", 0, moment="built"),
    Case("usr1-group-wrapper", "wrapper", signal.SIGUSR1, "group", 0, at=14),  # Slurm --signal, proctrack/pgid
]
ONE_PROCESS = [
    Case("term-process-startup", "process", signal.SIGTERM, "process", 0, moment="handler"),
    Case("usr1-process", "process", signal.SIGUSR1, "process", 0, at=3),
    Case("term-process-startup-built", "process", signal.SIGTERM, "process", 0, moment="built"),
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


def everything(run_dir) -> dict[str, str]:
    """sha256 of every file under ``run_dir`` (``latest``, metrics, config.yaml included); {} if none."""
    found = {}
    for root, _, files in os.walk(run_dir):
        for name in files:
            path = os.path.join(root, name)
            found[os.path.relpath(path, run_dir)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return found


def losses(run_dir) -> dict[int, float]:
    with open(run_dir / "metrics.jsonl") as f:
        return {r["step"]: r["lm_loss"] for r in map(json.loads, f)}


def caught(pid: int) -> set[int]:
    """The signals process ``pid`` has a handler for (empty once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = int(next(line for line in f if line.startswith("SigCgt:")).split()[1], 16)
    except (OSError, StopIteration):
        return set()
    return {n for n in range(1, 65) if mask >> (n - 1) & 1}


def processes(case: Case, proc: subprocess.Popen) -> tuple[psutil.Process, Optional[psutil.Process], list]:
    """(the launched process, the torchrun agent or None, the ranks started so far)."""
    top = psutil.Process(proc.pid)
    if case.launcher == "process":
        return top, None, []
    agent = top if case.launcher == "torchrun" else None
    for kid in top.children() if case.launcher == "wrapper" else []:  # the starter that execs torchrun (same
        try:                                                         # PID), once it has
            cmdline = kid.cmdline()
        except psutil.Error:
            continue
        if any(a.endswith("torchrun") for a in cmdline[1:2]):
            agent = kid
    ranks = sorted(agent.children(), key=lambda p: p.pid) if agent else []
    return top, agent, ranks


def reached(case: Case, proc: subprocess.Popen) -> bool:
    """Whether start-up has reached ``case.moment`` (every process the moment names exists, as it says)."""
    top, agent, ranks = processes(case, proc)
    if case.moment == "wrapper":
        return {signal.SIGUSR1, signal.SIGTERM} <= caught(top.pid)
    if case.moment == "agent":
        return agent is not None and not ranks
    if case.launcher == "process":
        return case.sig in caught(top.pid)
    if case.moment == "ranks":
        return len(ranks) == 2
    return len(ranks) == 2 and all(case.sig in caught(p.pid) for p in ranks)  # "handler"


def targets(case: Case, proc: subprocess.Popen) -> list[psutil.Process]:
    top, agent, ranks = processes(case, proc)
    if case.to == "rank":
        return [next(p for p in ranks if p.environ().get("RANK") == "1")]
    return {"all": [p for p in dict.fromkeys([top, agent, *ranks]) if p is not None], "agent": [agent],
            "process": [top]}[case.to]


def run_case(case: Case, run_dir, tmp_path, nranks: int):
    """Launch, wait until every rank holds at ``case.at`` (or start-up has reached ``case.moment``), deliver
    the case's signal, wait for the end. A launch whose torchrun lost its free port to another process before it
    started the ranks (EADDRINUSE, nothing written yet) is started again on another port."""
    for _ in range(3):
        code, out = _launch_and_signal(case, run_dir, tmp_path, nranks)
        if code is not None:
            return code, out
    raise AssertionError(f"case {case.id}: torchrun found no free port in 3 launches\n{out[-3000:]}")


def _launch_and_signal(case: Case, run_dir, tmp_path, nranks: int):
    """:func:`run_case`'s one launch: ``(exit code, log)``, or ``(None, log)`` when torchrun's port was taken."""
    hold_dir = tmp_path / "hold" / case.id
    held = case.at or (0 if case.moment == "built" else None)
    log = tmp_path / f"{case.id}.log"
    args = [*TINY, f"run_dir={run_dir}", f"method.at=[{'' if held is None else held}]", f"method.dir={hold_dir}"]
    with open(log, "w") as out:
        proc = subprocess.Popen(command(case.launcher, args), cwd=ROOT, env=environment(tmp_path, case.env),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        ready = [hold_dir / f"ready.{held}.{r}" for r in range(nranks)]
        deadline = time.monotonic() + 600
        while not (all(p.exists() for p in ready) if held is not None else reached(case, proc)):
            if proc.poll() is not None and "EADDRINUSE" in log.read_text():
                return None, log.read_text()
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-5000:]
            time.sleep(0.01)
        sent_to = [] if case.to == "group" else targets(case, proc)
        if case.moment in ("wrapper", "agent"):  # still before the ranks (torchrun imports for a second or more)
            assert not processes(case, proc)[2], f"case {case.id}: the ranks started before the signal"
        if case.to == "group":
            os.killpg(proc.pid, case.sig)
        for p in sent_to:
            p.send_signal(case.sig)
        code = proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return code, log.read_text()


def run_chain(cases: list[Case], tmp_path, nranks: int):
    ref, run_dir = tmp_path / "ref", tmp_path / "run"
    run([*TINY, f"run_dir={ref}"], nproc=nranks, env=environment(tmp_path), timeout=900)  # the reference: any launcher
    requeues, step = 0, 0
    for case in cases:
        step = case.at or step  # where the run stops (a start-up case: where the previous one did)
        before = snapshot(run_dir) if run_dir.exists() else {}
        files_before = everything(run_dir)
        rows_before = (run_dir / "metrics.jsonl").read_bytes() if (run_dir / "metrics.jsonl").exists() else b""
        code, out = run_case(case, run_dir, tmp_path, nranks)
        where = f"case {case.id}: exit {code}\n{out[-6000:]}"
        assert code == case.exit_code, where
        if case.moment:  # stopped before its first step: nothing written, latest untouched
            assert f"stopped by {case.sig.name} during start-up, before the first step: nothing new to save" in out, \
                where
            assert everything(run_dir) == files_before, where
        else:
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
        if not case.moment:
            assert (run_dir / "metrics.jsonl").read_bytes().startswith(rows_before), where
    # the chain's end under the real launcher (fresh: torchrun itself), a new port when its was taken
    run([*TINY, f"run_dir={run_dir}"], nproc=nranks, env=environment(tmp_path), timeout=900, fresh=True)
    assert losses(run_dir) == losses(ref)  # exactly the uninterrupted run's losses, every step
    assert sorted(losses(ref)) == list(range(1, STEPS + 1))


@pytest.mark.slow(minutes=5)
@pytest.mark.distributed
def test_signals_under_torchrun_checkpoint_and_resume_exactly(tmp_path):
    run_chain(TWO_RANKS, tmp_path, nranks=2)


@pytest.mark.slow
def test_signals_to_a_single_process_checkpoint_and_resume_exactly(tmp_path):
    run_chain(ONE_PROCESS, tmp_path, nranks=1)
