"""Stop training cleanly when SLURM warns of the time limit or preempts, then requeue the job.

    handler = PreemptionHandler().install()        # main thread, before the loop
    while step < stop_at:
        train_step()
        if handler.should_stop():                  # collective: every rank, same place, every step
            save_checkpoint()                      # finish step -> checkpoint ->
            handler.requeue()                      # -> `scontrol requeue $SLURM_JOB_ID` (rank 0) -> exit
            break
    handler.uninstall()

Signals (defaults): SIGUSR1 is the early warning of launch/submit.py's jobs (``#SBATCH
--signal=USR1@300``) and SIGUSR2 that of the Hydra submitit launcher (whose own USR2 handler, which
requeues without a checkpoint, this one replaces): the job should continue later, so they ask for a
requeue. SIGTERM comes from ``scancel``, the time limit or preemption: stop and checkpoint (within
SLURM's KillWait, often 30 s, and torchrun's shutdown timeout), but do not requeue (a user's
``scancel`` must end the job; SLURM requeues preempted jobs itself when configured to).

The handler only records the signal; all work (the collective, the checkpoint, the requeue) happens
in the training loop. So a signal to any one rank, to all of them, or forwarded by torchrun or the
SLURM node wrapper (launch/slurm/torchrun_node.sh) never interrupts a collective or a save: every
rank learns of it at the next ``should_stop()``. Delivery patterns and exit codes: docs/CLUSTER.md.

Start-up: an entry point calls :func:`catch_early` as its first statement (``launch/pretrain.py``), before
the heavy imports, so a signal that arrives while Python imports torch and megatron, the config is
composed or the model is built is recorded too; the trainer's handler takes over what it recorded. A
process started with the stop signals blocked (the node wrapper starts torchrun so, and the ranks
inherit the mask) keeps a signal that arrives before that point pending, and ``install()`` unblocks
it, so it is delivered then. This module imports torch only when ``should_stop()`` runs.
"""

from __future__ import annotations

import atexit
import shutil
import signal
import subprocess
from typing import Iterable, Optional, Union

SignalLike = Union[int, str, signal.Signals]


def _as_signal(sig: SignalLike) -> signal.Signals:
    if isinstance(sig, str):
        name = sig.upper() if sig.upper().startswith("SIG") else "SIG" + sig.upper()
        return signal.Signals[name]
    return signal.Signals(sig)


class PreemptionHandler:
    """Records SIGUSR1/SIGUSR2/SIGTERM (configurable) and turns them into an agreed stop and a requeue.

    Args:
        signals: the signals that request a stop.
        requeue_signals: the subset after which ``requeue()`` resubmits the job.
        scontrol: the ``scontrol`` executable, looked up on PATH when ``requeue()`` runs.
        group: the process group ``should_stop()`` reduces over (default: the default group).
    """

    def __init__(self, signals: Iterable[SignalLike] = ("SIGUSR1", "SIGUSR2", "SIGTERM"),
                 requeue_signals: Iterable[SignalLike] = ("SIGUSR1", "SIGUSR2"), scontrol: str = "scontrol",
                 group=None):
        self.signals = tuple(_as_signal(s) for s in signals)
        self.requeue_signals = frozenset(_as_signal(s) for s in requeue_signals)
        self.scontrol = scontrol
        self.group = group
        self.received: Optional[signal.Signals] = None  # the first signal this rank got
        self.seen: set[signal.Signals] = set()  # every signal this rank got
        self._requeue_wanted = False  # a requeue signal arrived on this rank
        self._stop = False  # agreed by should_stop(): sticky
        self._requeue = False  # agreed by should_stop(): sticky
        self.agreed: Optional[signal.Signals] = None  # a signal some rank got, as of the last should_stop()
        self._previous: dict[signal.Signals, object] = {}
        self.requeue_error: Optional[str] = None  # why the last requeue() did not requeue

    # -- signal handling ---------------------------------------------------------------------
    def install(self) -> "PreemptionHandler":
        """Install the handlers (main thread only); previous handlers are kept for ``uninstall``.

        A signal an earlier PreemptionHandler recorded (:func:`catch_early`) counts as received here, and
        the signals are unblocked in this thread, so one held pending since the process started (a
        mask inherited from the node wrapper) is delivered to this handler now."""
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        for prev in {id(p): p for p in self._previous.values()}.values():
            earlier = getattr(prev, "__self__", None)
            if isinstance(earlier, PreemptionHandler) and earlier is not self:
                self._adopt(earlier)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, self.signals)
        return self

    def _adopt(self, earlier: "PreemptionHandler") -> None:
        """Take over what ``earlier`` recorded (and clear it there, so it is acted on once)."""
        if earlier.received is not None and earlier.received in self.signals:
            self._on_signal(earlier.received, None)
        if earlier._requeue_wanted and self.requeue_signals & set(earlier.signals):
            self._requeue_wanted = True
        self.seen |= earlier.seen & set(self.signals)
        earlier.received, earlier._requeue_wanted, earlier.seen = None, False, set()

    def uninstall(self) -> None:
        """Restore the handlers that were installed before ``install``. An earlier PreemptionHandler among them
        (:func:`catch_early`) gets back the signals this one saw, so its ``seen`` stays every signal the process
        got (``cli.fail`` reads it: torchrun's SIGTERM can come while training unwinds from an error)."""
        earlier = [getattr(p, "__self__", None) for p in self._previous.values()]
        for sig, prev in self._previous.items():
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()
        for handler in earlier:  # after the restore: a signal from now on goes to it directly
            if isinstance(handler, PreemptionHandler) and handler is not self:
                handler.seen |= self.seen & set(handler.signals)

    def __enter__(self) -> "PreemptionHandler":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def _on_signal(self, signum, frame) -> None:  # record only; never do work in a handler
        self.seen.add(signal.Signals(signum))
        if self.received is None:
            self.received = signal.Signals(signum)
        if signum in self.requeue_signals:
            self._requeue_wanted = True

    def request_stop(self, sig: SignalLike = signal.SIGUSR1) -> None:
        """Act as if ``sig`` had arrived on this rank (for tests and programmatic stops)."""
        self._on_signal(_as_signal(sig), None)

    # -- decisions -------------------------------------------------------------------------
    def should_stop(self) -> bool:
        """True on every rank once any rank got a stop signal. Collective when torch.distributed is
        initialised: call it on all ranks of the group at the same point (e.g. after each step)."""
        import torch.distributed as dist

        local = [int(self.received is not None or self._stop), int(self._requeue_wanted or self._requeue),
                 int(self.received or self.agreed or 0)]
        if dist.is_available() and dist.is_initialized():
            import torch

            on_gpu = dist.get_backend(self.group) == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
            flags = torch.tensor(local, dtype=torch.int32, device=device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
            local = flags.tolist()
        self._stop, self._requeue = bool(local[0]), bool(local[1])
        self.agreed = signal.Signals(local[2]) if local[2] else None
        return self._stop

    @property
    def requeue_requested(self) -> bool:
        """Whether the agreed stop (as of the last ``should_stop()``) came with a requeue signal."""
        return self._requeue

    def requeue(self, force: bool = False) -> bool:
        """``scontrol requeue $SLURM_JOB_ID`` on global rank 0 under SLURM; True if it did.

        Only after a requeue signal was agreed by ``should_stop()`` unless ``force``. Call it after the
        checkpoint is complete on all ranks: SLURM ends the running job right away. An array task's
        ``SLURM_JOB_ID`` is its own id, so only that task is requeued. On failure returns False and sets
        ``requeue_error``.
        """
        import torch.distributed as dist

        from dmc_train.distributed import scheduler_job_id

        self.requeue_error = None
        job_id = scheduler_job_id()
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if not (force or self._requeue):
            self.requeue_error = "no requeue signal was received"
        elif not job_id:
            self.requeue_error = "not running under SLURM (SLURM_JOB_ID is not set)"
        elif rank != 0:
            self.requeue_error = "only global rank 0 requeues"
        else:
            exe = shutil.which(self.scontrol)
            if exe is None:
                self.requeue_error = f"{self.scontrol} not found on PATH"
            else:
                try:
                    proc = subprocess.run([exe, "requeue", job_id], capture_output=True, text=True, timeout=60)
                except (OSError, subprocess.TimeoutExpired) as e:
                    self.requeue_error = f"{exe} requeue {job_id}: {e}"
                else:
                    if proc.returncode == 0:
                        return True
                    self.requeue_error = (f"{exe} requeue {job_id} failed ({proc.returncode}): "
                                          + " ".join((proc.stderr or proc.stdout).split()))
        return False


_early: Optional[PreemptionHandler] = None


def catch_early() -> PreemptionHandler:
    """Record the stop signals from now on (call it first thing in a training entry point, main thread).

    The handler only records; ``train()``'s own handler takes over what it recorded when it is installed
    and hands control back to it when training ends, so a late signal (the process is exiting anyway)
    is recorded and changes nothing; once the process exits, the stop signals are ignored
    (:func:`_ignore_stop_signals`). Idempotent."""
    global _early
    if _early is None:
        _early = PreemptionHandler().install()
        atexit.register(_ignore_stop_signals)
    return _early


def _ignore_stop_signals() -> None:
    """At exit (before Python's finalization): ignore the stop signals. Finalization puts back the default action
    of every signal that has a Python handler, and the default action of SIGTERM or SIGUSR1 ends the process by the
    signal. A rank that stopped cleanly then dies of a late copy of the stop signal (under the node wrapper a rank
    gets it twice: from Slurm and relayed), and torchrun reports the task as failed."""
    for sig in _early.signals:
        signal.signal(sig, signal.SIG_IGN)

