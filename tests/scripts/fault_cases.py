"""Run the fault-injection table of tests/test_fault_injection.py in one process (megatron is imported once).

    python tests/scripts/fault_cases.py <work dir> <results.json>

Builds the base run, then for each case: copies the base run to the case's run directory, applies the
case's ``prep``, hashes the watched paths, runs the case exactly as ``launch/pretrain.py`` would
(``cli.precheck`` -> ``cli.check_before_hydra`` -> ``train_app``) with this process's stdout and stderr
(file descriptors, so library logging and tracebacks are caught too) redirected to files, and hashes
the watched paths again. The test asserts on the results.
"""

import contextlib
import json
import os
import resource
import shutil
import signal
import sys
import traceback

from dmc_train import cli
from dmc_train.distributed import silence_expected_warnings
from dmc_train.recipes import register_schema
from launch.pretrain import train_app
from tests import test_fault_injection as table


def run_entry(overrides: list[str], out_path: str, err_path: str) -> int:
    """``launch/pretrain.py <overrides>`` in this process; returns the exit code ("traceback": uncaught)."""
    saved = os.dup(1), os.dup(2)
    with open(out_path, "w") as out, open(err_path, "w") as err:
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            cfg = cli.precheck(overrides)
            cli.check_before_hydra(cfg)
            train_app(cfg)
            code = 0
        except SystemExit as e:
            code = e.code
        except BaseException:
            traceback.print_exc()
            code = "traceback"
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
    return code


@contextlib.contextmanager
def file_size_limit(max_bytes):
    """RLIMIT_FSIZE = ``max_bytes`` (None: unchanged), with SIGXFSZ ignored so a write fails with EFBIG."""
    if max_bytes is None:
        yield
        return
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, limits[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)


def main(work: str, results_path: str) -> None:
    silence_expected_warnings()
    register_schema()
    base = os.path.join(work, "base")
    code = run_entry([*table.BASE, f"run_dir={base}"], os.path.join(work, "base.out"), os.path.join(work, "base.err"))
    assert code == 0, open(os.path.join(work, "base.err")).read()[-3000:]
    results = {}
    for case in table.CASES:
        run_dir = os.path.join(work, case.id, "run")
        os.makedirs(os.path.dirname(run_dir))
        shutil.copytree(base, run_dir)
        try:
            run_dir = case.prep(run_dir) or run_dir
        except table.Unavailable as e:
            results[case.id] = {"skipped": str(e)}
            continue
        before = table.digests(run_dir)
        out, err = os.path.join(work, case.id, "stdout"), os.path.join(work, case.id, "stderr")
        overrides = [o.format(run_dir=run_dir, case_dir=os.path.dirname(run_dir)) for o in case.overrides]
        with file_size_limit(case.max_file_bytes):
            code = run_entry([*table.COMMON, f"run_dir={run_dir}", *overrides], out, err)
        results[case.id] = {"run_dir": run_dir, "code": code, "before": before, "after": table.digests(run_dir),
                            "stdout": open(out).read(), "stderr": open(err).read()}
        print(f"{case.id}: exit {code}", flush=True)
    with open(results_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
