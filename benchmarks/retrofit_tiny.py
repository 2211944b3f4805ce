"""Retrofit the base model with DMC, GQA and Fixed Memory Pooling at equal token budgets; compare them.

    python benchmarks/retrofit_tiny.py [--runs dmc2 dmc4 gqa2 gqa4 pool2 pool4] [--parallel 2]

Needs ``runs/base_tiny`` (README command 1). Each run is a recipe (``dmc_tiny`` / ``gqa_tiny``) with the
same data and 400 steps x 8,192 tokens; GQA runs start from ``checkpoints_tools/convert_gqa.py``
output. Runs that finished already are not repeated (``resume=auto``, cached ``eval.json``); with
``--parallel 2`` two runs share the machine, one thread each. Prints held-out perplexity and the
achieved compression (DMC: hard decisions on the held-out text, as at inference) and writes
``docs/retrofit_tiny.png``.
"""

import argparse
import json
import os
import subprocess
import sys
import time

from dmc_train.recipes import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # runs/ and docs/ of this checkout

BASE = "runs/base_tiny"
RUNS = {
    "dmc2": ["+recipe=dmc_tiny", "method.target_cr=2"],
    "dmc4": ["+recipe=dmc_tiny", "method.target_cr=4"],
    "gqa2": ["+recipe=gqa_tiny", "model.num_query_groups=4"],
    "gqa4": ["+recipe=gqa_tiny", "model.num_query_groups=2"],
    "pool2": ["+recipe=dmc_tiny", "method=fixed_pooling", "method.target_cr=2"],
    "pool4": ["+recipe=dmc_tiny", "method=fixed_pooling", "method.target_cr=4"],
}


def sh(args: list[str], log: str | None = None, threads: int | None = None) -> subprocess.Popen:
    """``python <args>`` in the checkout root (``args`` start with ``-m <module>``)."""
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    out = open(log, "a") if log else None
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def wait(proc: subprocess.Popen, what: str) -> None:
    if proc.wait() != 0:
        sys.exit(f"error: {what} failed (exit {proc.returncode}); see its log under runs/")


def convert(groups: int) -> None:
    out = f"runs/base_tiny_gqa{groups}"
    if not os.path.exists(os.path.join(ROOT, out, "meta.json")):
        wait(sh(["-m", "checkpoints_tools.convert_gqa", "--input", BASE, "--output", out, "--groups", str(groups)]),
             f"GQA conversion to {groups} groups")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--parallel", type=int, default=2)
    args = parser.parse_args()
    if not os.path.exists(os.path.join(ROOT, BASE, "eval.json")):
        sys.exit(f"error: {BASE} is missing or not evaluated; run README command 1 (launch/quickstart.sh) first")
    for name in args.runs:
        if name.startswith("gqa"):
            convert(int(RUNS[name][1].split("=")[1]))

    os.makedirs(os.path.join(ROOT, "runs/logs"), exist_ok=True)
    threads = max(1, (os.cpu_count() or 1) // args.parallel)
    pending, active = list(args.runs), []
    t0 = time.time()
    while pending or active:
        while pending and len(active) < args.parallel:
            name = pending.pop(0)
            log = os.path.join(ROOT, f"runs/logs/retrofit_{name}.log")
            print(f"[{time.time() - t0:6.0f}s] start {name}: {' '.join(RUNS[name])} (log {log})", flush=True)
            cmd = ["-m", "launch.pretrain", *RUNS[name], "logging.progress=true"]
            active.append((name, sh(cmd, log, threads), log))
        time.sleep(5)
        for item in list(active):
            name, proc, log = item
            if proc.poll() is not None:
                active.remove(item)
                wait(proc, f"training {name}")
                wait(sh(["-m", "launch.evaluate", *RUNS[name]], log, threads), f"evaluating {name}")
                print(f"[{time.time() - t0:6.0f}s] done {name}", flush=True)

    rows = [("base (MHA)", 1.0, _eval(BASE))]
    for name in args.runs:
        cfg = load_config(RUNS[name])
        ev = _eval(cfg.run_dir)
        if cfg.method.name == "none":  # GQA: heads / groups
            cr = cfg.model.num_attention_heads / cfg.model.num_query_groups
        else:  # DMC / pooling: measured from the decisions on the test split
            cr = ev["test_achieved_cr"]
        rows.append((name, cr, ev))
    print("\nrun        | KV compression | valid ppl | test ppl")
    for name, cr, ev in rows:
        print(f"{name:10s} | {cr:14.2f} | {ev['valid_ppl']:9.2f} | {ev['test_ppl']:8.2f}")
    plot(rows, os.path.join(ROOT, "docs/retrofit_tiny.png"))


def _eval(run_dir: str) -> dict:
    with open(os.path.join(ROOT, run_dir, "eval.json")) as f:
        return json.load(f)


def plot(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    families = {"dmc": "DMC", "gqa": "GQA", "pool": "Fixed Memory Pooling"}
    ax.axhline(rows[0][2]["test_ppl"], color="gray", ls="--", lw=1, label="base model (no extra training)")
    for prefix, label in families.items():
        pts = sorted((cr, ev["test_ppl"]) for name, cr, ev in rows if name.startswith(prefix))
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xlabel("KV-cache compression (achieved on test)")
    ax.set_ylabel("test perplexity")
    ax.set_title("Retrofitting base_tiny (3.3M tokens each)", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
