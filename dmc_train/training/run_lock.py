"""One run per run directory: ``<run_dir>/.lock``, taken by rank 0 and held for the run's lifetime.

The lock file is created atomically (``O_CREAT | O_EXCL``) and holds the owner's host, PID and (under
SLURM) job ID. A lock whose owner is gone (same host and the PID no longer alive, or the same SLURM job
requeued) is stale and reclaimed with a one-line warning; a live owner makes the new run fail with a
:class:`RunDirError` naming the holder and the lock path. The lock is removed on any normal or error
exit (``release``, and ``atexit`` as a backstop), with the run directory itself if taking the lock created
it and nothing else was written there (a rejected run leaves nothing behind).
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
from typing import Optional

from dmc_train import distributed
from dmc_train.errors import RunDirError

LOCK = ".lock"
_held: dict[str, str] = {}  # abspath(run_dir) -> lock path, held by this process
_created: set[str] = set()  # run directories that taking the lock created


def lock_path(run_dir: str) -> str:
    return os.path.join(os.path.abspath(run_dir), LOCK)


def _owner() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "job": distributed.scheduler_job_id()}


def _read(path: str) -> Optional[dict]:
    try:
        with open(path, "rb") as f:
            holder = json.loads(f.read().decode())
        return holder if isinstance(holder, dict) and isinstance(holder.get("pid"), int) else None
    except (OSError, ValueError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stale(holder: dict) -> bool:
    me = _owner()
    if holder.get("job") and holder["job"] == me["job"]:
        return True  # an earlier incarnation of this (requeued) job
    return holder.get("host") == me["host"] and (holder["pid"] == me["pid"] or not _pid_alive(holder["pid"]))


def check_writable(run_dir: str) -> None:
    """Raise RunDirError unless ``run_dir`` (or, if it does not exist yet, its nearest existing parent)
    can be written: a read-only file system or an immutable directory fails here, before any work.
    ``os.access`` reports both even for root, whom permission bits do not stop."""
    existing = os.path.abspath(run_dir)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise RunDirError(f"run_dir {run_dir} cannot be created: {existing} is a file; use another run_dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RunDirError(f"run_dir {run_dir} is not writable ({existing} is on a read-only file system or "
                          f"not writable); use a run_dir on a writable file system")


def acquire(run_dir: str) -> None:
    """Take ``run_dir``'s lock for this process (a no-op if it already holds it); raise RunDirError if a
    live run holds it or the directory cannot be written."""
    key = os.path.abspath(run_dir)
    if key in _held:
        return
    path = lock_path(run_dir)
    check_writable(run_dir)
    try:
        if not os.path.isdir(key):
            os.makedirs(key)
            _created.add(key)
    except OSError as e:
        raise RunDirError(f"run_dir {run_dir} cannot be created ({e.strerror}); use a run_dir on a writable "
                          f"file system") from None
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read(path)
            if holder is None:
                raise RunDirError(f"run directory {key} has an unreadable lock {path}; if no run is using this "
                                  f"directory, delete the lock file and start again") from None
            if not _stale(holder):
                raise RunDirError(f"run directory {key} is in use by PID {holder['pid']} on {holder.get('host')} "
                                  f"(lock {path}); wait for that run to end, stop it, or use another run_name / "
                                  f"run_dir") from None
            print(f"warning: reclaiming stale lock {path} of PID {holder['pid']} on {holder.get('host')} "
                  f"(no longer running)", file=sys.stderr, flush=True)
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
            continue
        except OSError as e:
            raise RunDirError(f"run_dir {run_dir} is not writable ({e.strerror}: {path}); use a run_dir on a "
                              f"writable file system") from None
        with os.fdopen(fd, "w") as f:
            json.dump(_owner(), f)
        _held[key] = path
        return
    raise RunDirError(f"could not take the lock {path} (another run keeps taking it); use another run_dir")


def release(run_dir: str) -> None:
    """Remove ``run_dir``'s lock if this process holds it (idempotent)."""
    path = _held.pop(os.path.abspath(run_dir), None)
    if path is None:
        return
    holder = _read(path)
    if holder is not None and holder.get("pid") == os.getpid():
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
    key = os.path.dirname(path)
    if key in _created:
        _created.discard(key)
        try:
            os.rmdir(key)  # only if empty: the run was rejected before writing anything
        except OSError:
            pass


def release_all() -> None:
    for key in list(_held):
        release(key)


atexit.register(release_all)


def hold(run_dir: str) -> None:
    """Collective: rank 0 takes ``run_dir``'s lock; every rank raises the same RunDirError if it could not."""
    error = None
    if distributed.is_rank0():
        try:
            acquire(run_dir)
        except RunDirError as e:
            error = str(e)
    error = distributed.broadcast_object(error)
    if error is not None:
        raise RunDirError(error)
