"""Run project scripts in subprocesses (training installs the CPU compatibility layer process-wide,
so tests keep it out of the pytest process)."""

import json
import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# where the tests' tensors live (tests/conftest.py; the ``device`` fixture is the torch.device)
TEST_DEVICE = os.environ.get("DMC_TEST_DEVICE", "cpu")
# Triton kernels run: compiled on a GPU, or on CPU tensors under the interpreter (set by tests/conftest.py)
TRITON_RUNS = TEST_DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: list[str], nproc: int = 1, timeout: int = 600, check: bool = True, env: dict | None = None,
        cwd: str = ROOT):
    """Run ``python <args>`` (or ``torchrun --nproc_per_node=nproc <args>``) from ``cwd`` (default: the repo root;
    script paths are relative to the repo root either way)."""
    # a process group this pytest process set up (a test that loads a checkpoint in-process) leaves MASTER_PORT
    # and friends behind: the subprocess picks its own
    inherited = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE",
                                                                    "LOCAL_RANK")}
    full_env = {**inherited, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", **(env or {})}
    for attempt in range(3):
        if nproc > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                   f"--master_port={free_port()}", *args]
        else:
            cmd = [sys.executable, *args]
        if cwd != ROOT:
            cmd = [c if not c.endswith(".py") or os.path.isabs(c) else os.path.join(ROOT, c) for c in cmd]
        proc = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
        # the free port can be taken (another test's connection) before torchrun binds it: choose another
        if nproc == 1 or proc.returncode == 0 or "EADDRINUSE" not in proc.stderr:
            break
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def run_json(args: list[str], out_path: str, **kw) -> dict:
    run([*args[:1], out_path, *args[1:]], **kw)
    with open(out_path) as f:
        return json.load(f)
