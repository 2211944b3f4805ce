"""PreemptionHandler: real signals set a flag, ranks agree on stopping, rank 0 requeues via scontrol."""

import multiprocessing as mp
import os
import signal
import threading

import pytest

from dmc_train.training.preemption import PreemptionHandler
from tests.helpers import run


def fake_scontrol(bin_dir, record, exit_code=0):
    """A ``scontrol`` that appends its argv to ``record`` (and fails with ``exit_code`` != 0)."""
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / "scontrol"
    exe.write_text(f'#!/bin/sh\necho "$@" >> "{record}"\n'
                   + (f'echo "scontrol: error: Job is not requeueable" >&2\nexit {exit_code}\n' if exit_code else ""))
    exe.chmod(0o755)
    return bin_dir


@pytest.fixture
def slurm_env(tmp_path, monkeypatch):
    record = tmp_path / "scontrol_calls.txt"
    bin_dir = fake_scontrol(tmp_path / "bin", record)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    return record


def test_sigusr1_stops_and_requeues(slurm_env):
    previous = signal.getsignal(signal.SIGUSR1)
    with PreemptionHandler() as handler:
        assert not handler.should_stop() and handler.received is None
        os.kill(os.getpid(), signal.SIGUSR1)  # the handler runs before the next bytecode
        assert handler.received == signal.SIGUSR1
        assert handler.should_stop() and handler.should_stop()  # sticky
        assert handler.requeue_requested
        assert handler.requeue() is True
    assert slurm_env.read_text().split() == ["requeue", "4242"]
    assert signal.getsignal(signal.SIGUSR1) is previous  # uninstalled


def test_sigterm_stops_without_requeue(slurm_env):
    with PreemptionHandler() as handler:
        os.kill(os.getpid(), signal.SIGTERM)
        assert handler.should_stop() and not handler.requeue_requested
        assert handler.requeue() is False and "no requeue signal" in handler.requeue_error
        assert not slurm_env.exists()
        assert handler.requeue(force=True) is True
    assert slurm_env.read_text().split() == ["requeue", "4242"]


def test_signal_held_since_start_up_reaches_the_handler(slurm_env):
    """Started with SIGUSR1 blocked (as the node wrapper starts the ranks): one sent before any handler exists
    stays pending and is delivered when the handler is installed (it unblocks)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    try:  # pending (to this thread: pytest's other threads do not block it, a rank's have it blocked from birth)
        signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)  # its default action would end the process
        with PreemptionHandler() as handler:
            assert handler.received == signal.SIGUSR1 and handler.should_stop() and handler.requeue_requested
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
    assert signal.SIGUSR1 not in signal.pthread_sigmask(signal.SIG_BLOCK, set())


def test_trainer_handler_takes_over_what_the_early_one_recorded(slurm_env):
    """catch_early()'s handler (the entry point's first line) records; the trainer's handler adopts that once,
    and hands the signals back to it when training ends."""
    early = PreemptionHandler().install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # e.g. during the imports
        os.kill(os.getpid(), signal.SIGUSR1)
        assert early.received == signal.SIGTERM
        with PreemptionHandler() as trainer:
            assert trainer.received == signal.SIGTERM and trainer.should_stop() and trainer.requeue_requested
            assert early.received is None  # taken over: a later start in this process does not see it again
        assert signal.getsignal(signal.SIGTERM) == early._on_signal
        with PreemptionHandler() as again:
            assert not again.should_stop()
    finally:
        early.uninstall()


def test_early_handler_gets_back_what_the_trainer_saw():
    """The trainer's handler hands catch_early()'s handler back the signals it recorded, so that one knows every
    signal the process got (cli.fail asks it whether torchrun's SIGTERM came), but acts on none of them again."""
    early = PreemptionHandler().install()
    try:
        with PreemptionHandler() as trainer:
            signal.raise_signal(signal.SIGTERM)  # e.g. torchrun's, while training unwinds from an error
            assert trainer.seen == {signal.SIGTERM}
        assert early.seen == {signal.SIGTERM} and early.received is None
    finally:
        early.uninstall()


# rank 1 of two hits an error after training started: it stays silent if torchrun's SIGTERM came (rank 0 reported)
FAIL_ON_RANK_1 = """
import signal, sys
from dmc_train import cli
from dmc_train.training.preemption import PreemptionHandler, catch_early
cli.OTHER_RANKS_WAIT_S = 0.5
catch_early()
with PreemptionHandler():  # train()'s, until the error leaves train()
    if sys.argv[1] == "sigterm":
        signal.raise_signal(signal.SIGTERM)
cli.fail("boom")
"""


@pytest.mark.parametrize("case, stderr", [("sigterm", ""), ("none", "error: boom (rank 1)\n")])
def test_other_rank_reports_only_if_torchrun_did_not_stop_it(case, stderr):
    proc = run(["-c", FAIL_ON_RANK_1, case], env={"RANK": "1", "WORLD_SIZE": "2"}, check=False, timeout=120)
    assert (proc.returncode, proc.stderr) == (2, stderr)


# a stop signal that comes after Python's own signal handling ended (the node wrapper relays a signal each rank also
# got directly, and a loaded machine delays the relay past the rank's clean exit)
LATE_SIGNAL = """
import os, signal
from dmc_train.training.preemption import catch_early
catch_early()
class LateSignal:  # deleted while Python tears the modules down, after finalization reset the signal handlers
    def __init__(self):  # what __del__ needs, kept here: the module's globals may be gone by then
        self.kill, self.pid, self.sig = os.kill, os.getpid(), signal.SIGTERM
    def __del__(self):
        self.kill(self.pid, self.sig)
late = LateSignal()
"""


def test_a_stop_signal_during_the_exit_does_not_end_the_process_by_the_signal():
    proc = run(["-c", LATE_SIGNAL], check=False, fresh=True, timeout=120)  # a real interpreter's finalization
    assert proc.returncode == 0, proc.stderr  # without the handling at exit: -15 (SIGTERM's default action)


def test_requeue_needs_slurm(slurm_env, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID")
    handler = PreemptionHandler()
    handler.request_stop("USR1")
    assert handler.should_stop()
    assert handler.requeue() is False and "SLURM_JOB_ID" in handler.requeue_error
    assert not slurm_env.exists()


def test_requeue_reports_scontrol_failure(tmp_path, monkeypatch):
    record = tmp_path / "calls.txt"
    bin_dir = fake_scontrol(tmp_path / "bin", record, exit_code=1)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    handler = PreemptionHandler(signals=["SIGUSR2"], requeue_signals=["USR2"])
    handler.request_stop(signal.SIGUSR2)
    assert handler.should_stop()
    assert handler.requeue() is False and "not requeueable" in handler.requeue_error
    assert record.read_text().split() == ["requeue", "7"]
    handler.scontrol = "no-such-scontrol"
    assert handler.requeue() is False and "not found on PATH" in handler.requeue_error


def _rank(rank, world, init_file, out_dir, bin_dir):
    import torch.distributed as dist

    os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    os.environ["SLURM_JOB_ID"] = "99"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    handler = PreemptionHandler().install()
    results = [handler.should_stop()]  # nobody signalled yet
    if rank == 1:
        os.kill(os.getpid(), signal.SIGUSR1)
    results.append(handler.should_stop())  # rank 1's signal stops rank 0 too
    dist.barrier()
    results.append(handler.requeue())
    results.append(handler.agreed.name)  # the signal's name is known on every rank, not only where it arrived
    (out_dir / f"rank{rank}.txt").write_text(" ".join(str(r) for r in results))
    dist.destroy_process_group()


@pytest.mark.distributed
def test_ranks_agree_and_only_rank0_requeues(tmp_path):
    record = tmp_path / "calls.txt"
    bin_dir = fake_scontrol(tmp_path / "bin", record)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, 2, tmp_path / "init", tmp_path, bin_dir)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert (tmp_path / "rank0.txt").read_text() == "False True True SIGUSR1"
    assert (tmp_path / "rank1.txt").read_text() == "False True False SIGUSR1"
    assert record.read_text().split() == ["requeue", "99"]
