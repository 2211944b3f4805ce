"""Wall time of short commands with and without the megatron import adjustments (dmc_train/megatron_import.py).

    python benchmarks/startup.py [--repeats 5]

Each command runs in a fresh process from this checkout, alternately in the two variants, ``--repeats``
times each, and the medians are compared:

- ``adjusted``: the command as users run it;
- ``as shipped``: the same command with the adjustments switched off (the hook's table emptied before
  anything imports megatron), i.e. megatron-core 0.16.1 as installed.

Commands: importing the training loop alone, and a 1-step tiny training run (start-up, one step, one
checkpoint save, exit), in a fresh run directory each time. Prints one table of medians and ratios.
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

VARIANTS = {
    "adjusted": "import dmc_train\n",
    "as shipped": "import dmc_train.megatron_import as m\nm._AFTER_IMPORT.clear()\n",
}
COMMANDS = {
    "import the training loop": "import dmc_train.training.loop\n",
    "1-step tiny training run": ("import runpy, sys\nsys.argv = ['launch/pretrain.py', '+recipe=tiny_pretrain', "
                                 "'train.max_steps=1', 'train.eval_interval=0', 'logging.progress=false', "
                                 "'optim.warmup_steps=0', 'run_dir=' + {run_dir!r}]\n"
                                 "runpy.run_path('launch/pretrain.py', run_name='__main__')\n"),
}


def timed(code: str) -> float:
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="startup_")
    times = {(c, v): [] for c in COMMANDS for v in VARIANTS}
    try:
        for r in range(args.repeats):
            for c, body in COMMANDS.items():
                for v, prefix in VARIANTS.items():
                    run_dir = os.path.join(work, f"run_{len(times[c, v])}_{v.replace(' ', '_')}")
                    times[c, v].append(timed(prefix + body.format(run_dir=run_dir)))
                    shutil.rmtree(run_dir, ignore_errors=True)
            print(f"repeat {r + 1}/{args.repeats} done", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n| command | as shipped (s) | adjusted (s) | adjusted / as shipped |\n|---|---|---|---|")
    for c in COMMANDS:
        old, new = statistics.median(times[c, "as shipped"]), statistics.median(times[c, "adjusted"])
        print(f"| {c} | {old:.2f} | {new:.2f} | {new / old:.2f}x |")


if __name__ == "__main__":
    main()
