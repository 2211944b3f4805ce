"""A fork server for the tests' launches of the project's commands (:func:`tests.helpers.run`, CPU only).

torch and megatron-core take about 9 s to import on one core, several times what a tiny test run computes. This
process imports them once per pytest worker; each launch is a fork of it that runs the script as
``python <script> <args>`` (or ``python -c``/``-m``) would: its own arguments, environment, working directory,
``sys.path[0]`` and standard streams, the fresh interpreter's warning filters, and the exit code and tracebacks
of an ordinary interpreter exit (atexit handlers, non-daemon threads joined). What differs from a fresh process is
only that those modules are already imported, so the environment variables they read at import must equal this
server's: :func:`tests.helpers.run` starts a fresh interpreter otherwise (``IMPORT_TIME_ENV``).

A launch of several ranks (``torchrun --nproc_per_node=N``) forks one child per rank with torchrun's environment
variables; when one rank fails the others get SIGTERM, as torchrun does.

Protocol, one JSON object per line: the client writes ``{"argv", "cwd", "ranks": [{"env", "stdout", "stderr"},
...]}`` on this process's stdin; it answers the children's pids, then their exit codes (``-N`` for a signal, as
``subprocess``), one line each.
"""

import gc
import json
import os
import signal
import sys
import warnings

FRESH_WARNING_FILTERS = list(warnings.filters)
warnings.simplefilter("ignore")  # megatron-core's import-time warnings, which no child would show either
import dmc_train  # noqa: E402,F401  (first, as in every entry point: its adjustments to megatron-core's import)

# isort: split
import hydra  # noqa: E402,F401
import megatron.core  # noqa: E402,F401  (imports torch)

# isort: split
# What most launches import after start-up, 1-1.5 s of a tiny training run each: the trainer, the engine, hydra's
# override grammar, and torch._dynamo, which torch.optim imports when the optimizer takes its first parameter group
import hydra._internal.utils  # noqa: E402,F401
import omegaconf.grammar_parser  # noqa: E402,F401
import torch._dynamo  # noqa: E402,F401

import dmc_train.inference.engine  # noqa: E402,F401
import dmc_train.training.loop  # noqa: E402,F401

# The imported objects out of the collector's reach: a child's collections and exit would otherwise touch (and so
# copy) every page of them, 2 s per child.
gc.freeze()


def run_child(request: dict) -> None:
    """In the forked child: become ``python <argv...>`` and run it; raises SystemExit (or the script's
    exception) up to the interpreter's top level, which exits as a fresh interpreter would."""
    import runpy

    created = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], created),
                            (2, request["stderr"], created)):
        opened = os.open(path, flags)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = open(0, closefd=False)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    warnings.filters[:] = FRESH_WARNING_FILTERS
    warnings._filters_mutated()
    argv = request["argv"]
    if argv[0] == "-c":
        sys.argv, sys.path[0] = ["-c", *argv[2:]], ""
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    elif argv[0] == "-m":
        sys.argv, sys.path[0] = [argv[1], *argv[2:]], os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = os.path.abspath(argv[0])
        sys.argv, sys.path[0] = list(argv), os.path.dirname(script)
        runpy.run_path(script, run_name="__main__")
    sys.exit(0)


def serve() -> None:
    requests, replies = sys.stdin.buffer, sys.stdout
    while line := requests.readline():
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pids = []
        for rank in request["ranks"]:
            pid = os.fork()
            if pid == 0:
                run_child({**request, **rank})
            pids.append(pid)
        print(*pids, file=replies, flush=True)
        print(*wait_all(pids), file=replies, flush=True)


def wait_all(pids: list[int]) -> list[int]:
    """The exit codes of ``pids``; when one fails, the others get SIGTERM (as torchrun stops a job's ranks)."""
    codes = {}
    while len(codes) < len(pids):
        pid, status = os.wait()
        codes[pid] = os.waitstatus_to_exitcode(status)
        if codes[pid] != 0:
            for other in set(pids) - set(codes):
                os.kill(other, signal.SIGTERM)
    return [codes[pid] for pid in pids]


if __name__ == "__main__":
    serve()
