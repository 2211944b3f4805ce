"""Run project scripts in subprocesses (training installs the CPU compatibility layer process-wide,
so tests keep it out of the pytest process)."""

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# where the tests' tensors live (tests/conftest.py; the ``device`` fixture is the torch.device)
TEST_DEVICE = os.environ.get("DMC_TEST_DEVICE", "cpu")
# Triton kernels run: compiled on a GPU, or on CPU tensors under the interpreter (set by tests/conftest.py)
TRITON_RUNS = TEST_DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Environment variables that torch, megatron-core or Python read when they start or import: a launch whose values
# differ from the fork server's gets a fresh interpreter.
IMPORT_TIME_ENV = ("PYTHONPATH", "PYTHONHOME", "PYTHONHASHSEED", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                   "CUDA_VISIBLE_DEVICES", "TRITON_INTERPRET", "LD_LIBRARY_PATH", "LD_PRELOAD")


class PreloadedPython:
    """Single-process launches forked from ``tests/preload_server.py`` (torch and megatron-core imported once per
    pytest worker) instead of a fresh interpreter each; CPU only (a fork after CUDA is set up is unsafe). Returns
    what ``subprocess.run(..., capture_output=True, text=True)`` returns."""

    def __init__(self):
        self.server = None
        self.env = None
        self.lock = threading.Lock()

    def takes(self, env: dict) -> bool:
        if TEST_DEVICE != "cpu":
            return False
        if self.env is None:
            self.env = dict(env)
        return all(env.get(key) == self.env.get(key) for key in IMPORT_TIME_ENV)

    def _start(self):
        if self.server is None or self.server.poll() is not None:
            self.server = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "preload_server.py")],
                                           cwd=ROOT, env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                           stderr=subprocess.DEVNULL, text=True)
            atexit.register(self.server.kill)
        return self.server

    def _reply(self, server, timeout: float) -> int:
        if not select.select([server.stdout], [], [], timeout)[0]:
            raise TimeoutError
        line = server.stdout.readline()
        if not line:
            raise RuntimeError(f"the tests' fork server (tests/preload_server.py) ended with {server.wait()}")
        return int(line)

    def run(self, cmd: list[str], cwd: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
        with self.lock, tempfile.TemporaryDirectory() as tmp:
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            for path in (out, err):
                open(path, "w").close()
            server = self._start()
            server.stdin.write(json.dumps({"argv": cmd[1:], "env": env, "cwd": cwd, "stdout": out, "stderr": err})
                               + "\n")
            server.stdin.flush()
            pid = self._reply(server, 60)
            try:
                code = self._reply(server, timeout)
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                self._reply(server, 60)
                raise subprocess.TimeoutExpired(cmd, timeout) from None
            with open(out, errors="replace") as o, open(err, errors="replace") as e:
                return subprocess.CompletedProcess(cmd, code, o.read(), e.read())


PRELOADED = PreloadedPython()


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
        if nproc == 1 and PRELOADED.takes(full_env):
            proc = PRELOADED.run(cmd, cwd, full_env, timeout)
        else:
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
