"""Tokens/s and start-up time of the tiny model under several parallel layouts, measured in one run.

    python benchmarks/train_step.py [--steps 40] [--model tiny]

Each layout trains ``--steps`` steps of ``+recipe=tiny_pretrain`` on random tokens (TP=1 in one
process, the others under torchrun with 2 gloo ranks); tokens/s is the median over the logged steps
after the first 10 (warm-up), start-up is process start to first step (imports, process group,
model, optimizer). Ratios are relative to TP=1 measured in the same run (this machine is noisy).
"""

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile

LAYOUTS = [
    ("TP=1", 1, []),
    ("TP=2", 2, ["parallel.tensor=2"]),
    ("PP=2", 2, ["parallel.pipeline=2"]),
    ("PP=2 VPP=2", 2, ["parallel.pipeline=2", "parallel.virtual_pipeline=2"]),
    ("DP=2", 2, []),
]


def run(args: list[str], nproc: int) -> subprocess.CompletedProcess:
    """``python -m launch.pretrain <args>`` in one process, or under torchrun with ``nproc`` ranks."""
    if nproc > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={port}",
               "-m", *args]
    else:
        cmd = [sys.executable, "-m", *args]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"error: {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def measure(name, nproc, overrides, steps, model, workdir):
    run_dir = os.path.join(workdir, re.sub(r"\W+", "_", name))
    proc = run(["launch.pretrain", "+recipe=tiny_pretrain", f"model={model}", f"run_dir={run_dir}",
                f"train.max_steps={steps}", "train.eval_interval=0", "checkpoint.save_interval=0",
                "checkpoint.save_at_end=false", "train.log_interval=1", *overrides], nproc=nproc)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    tok_s = statistics.median(r["tokens_per_s"] for r in rows[10:])
    startup = float(re.search(r"start-up ([\d.]+)s", proc.stdout).group(1))
    return tok_s, startup


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--model", default="tiny")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: measure(name, n, o, args.steps, args.model, tmp) for name, n, o in LAYOUTS}
    base = results["TP=1"][0]
    print(f"model={args.model}, {args.steps} steps, global batch 8 x 64 tokens")
    print(f"{'layout':<12} {'tokens/s':>10} {'vs TP=1':>8} {'start-up s':>11}")
    for name, (tok_s, startup) in results.items():
        print(f"{name:<12} {tok_s:>10,.0f} {tok_s / base:>7.2f}x {startup:>11.1f}")


if __name__ == "__main__":
    main()
