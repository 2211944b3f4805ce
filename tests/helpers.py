"""Run project scripts in subprocesses (training installs the CPU compatibility layer process-wide,
so tests keep it out of the pytest process). On CPU they are forked from a server that has torch and megatron-core
imported (``tests/preload_server.py``): a tiny training run takes 3 s instead of 11."""

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
    """Launches forked from ``tests/preload_server.py`` (torch and megatron-core imported once per pytest worker)
    instead of a fresh interpreter per process; CPU only (a fork after CUDA is set up is unsafe). Several ranks get
    torchrun's environment variables. Returns what ``subprocess.run(..., capture_output=True, text=True)`` returns,
    the ranks' outputs one after the other."""

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

    def _reply(self, server, timeout: float) -> list[int]:
        if not select.select([server.stdout], [], [], timeout)[0]:
            raise TimeoutError
        line = server.stdout.readline()
        if not line:
            raise RuntimeError(f"the tests' fork server (tests/preload_server.py) ended with {server.wait()}")
        return [int(word) for word in line.split()]

    def run(self, argv: list[str], cwd: str, env: dict, timeout: float, nproc: int) -> subprocess.CompletedProcess:
        port = str(free_port()) if nproc > 1 else None
        with self.lock, tempfile.TemporaryDirectory() as tmp:
            ranks = [{"env": env if nproc == 1 else {**env, **torchrun_env(rank, nproc, port)},
                      "stdout": os.path.join(tmp, f"stdout.{rank}"), "stderr": os.path.join(tmp, f"stderr.{rank}")}
                     for rank in range(nproc)]
            server = self._start()
            server.stdin.write(json.dumps({"argv": argv, "cwd": cwd, "ranks": ranks}) + "\n")
            server.stdin.flush()
            pids = self._reply(server, timeout)  # the first launch also waits for the server's imports
            try:
                codes = self._reply(server, timeout)
            except TimeoutError:
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
                self._reply(server, 60)
                raise subprocess.TimeoutExpired(argv, timeout) from None
            out, err = ("".join(open(rank[name], errors="replace").read() for rank in ranks)
                        for name in ("stdout", "stderr"))
            code = next((c for c in codes if c != 0), 0)
            return subprocess.CompletedProcess([sys.executable, *argv], code, out, err)


def torchrun_env(rank: int, nproc: int, port: str) -> dict:
    """The environment torchrun gives rank ``rank`` of ``nproc`` on one node."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(rank), "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
            "ROLE_NAME": "default", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(nproc),
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none"}


PRELOADED = PreloadedPython()


def run(args: list[str], nproc: int = 1, timeout: int = 600, check: bool = True, env: dict | None = None,
        cwd: str = ROOT, fresh: bool = False):
    """Run ``python <args>`` (or, ``nproc`` > 1, its ranks as ``torchrun --nproc_per_node=nproc <args>`` starts them)
    from ``cwd`` (default: the repo root; script paths are relative to the repo root either way).

    On CPU the processes are forked from a server with torch and megatron-core imported (:class:`PreloadedPython`).
    ``fresh`` starts a fresh interpreter (and torchrun itself): for a test of what a command imports, of torchrun's
    own behaviour, or of a failure under torchrun (torchrun reports it)."""
    # a process group this pytest process set up (a test that loads a checkpoint in-process) leaves MASTER_PORT
    # and friends behind: the subprocess picks its own
    inherited = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE",
                                                                    "LOCAL_RANK")}
    full_env = {**inherited, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", **(env or {})}
    if cwd != ROOT:
        args = [a if not a.endswith(".py") or os.path.isabs(a) else os.path.join(ROOT, a) for a in args]
    forked = not fresh and (nproc == 1 or check) and PRELOADED.takes(full_env)
    for attempt in range(3):
        if forked:
            proc = PRELOADED.run(args, cwd, full_env, timeout, nproc)
        else:
            cmd = [sys.executable, *args]
            if nproc > 1:
                cmd[1:1] = ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}"]
            proc = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
        # the free port can be taken (another test's connection) before rank 0 binds it: choose another
        if nproc == 1 or proc.returncode == 0 or "EADDRINUSE" not in proc.stderr:
            break
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(proc.args)} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def run_json(args: list[str], out_path: str, **kw) -> dict:
    run([*args[:1], out_path, *args[1:]], **kw)
    with open(out_path) as f:
        return json.load(f)
