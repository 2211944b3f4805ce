"""Step time and peak memory of DMC training vs vanilla attention on the same model, measured in one run.

    python benchmarks/dmc_train_step.py [--lengths 512 1024 2048 4096] [--steps 3] [--out docs/dmc_train.png]

Model: the base_tiny shape (4 layers, hidden 256, 8 heads of 32) with a 512-token vocabulary (so the
output layer does not dominate), one sequence per step, fp32, one process. For each sequence length
and variant (vanilla SDPA; DMC with exact accumulation; DMC with the paper's window of 12) a fresh
process times full optimizer steps (forward, backward, Adam; median of ``--steps`` after one
warm-up; wall-clock and the process's CPU time, which other processes sharing the cores disturb
less) and records the peak resident memory a step adds above the memory held before it (Linux
VmHWM, reset before each step; glibc's mmap threshold is fixed at 64 KiB so freed tensors leave the
resident set and every step's peak is seen). Ratios are DMC / vanilla at the same length.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

VARIANTS = {
    "vanilla": ["method=none"],
    "dmc_exact": ["method=dmc", "method.target_cr=2", "method.accumulation=exact"],
    "dmc_window": ["method=dmc", "method.target_cr=2", "method.accumulation=window"],
}


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def measure(trainer, steps: int) -> tuple[float, float, float]:
    """(median step seconds, median step CPU seconds, max peak bytes above the pre-step RSS) over
    ``steps`` steps after a warm-up."""
    trainer.train_step()
    times, cpu, peaks = [], [], []
    for _ in range(steps):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        before = _status("VmRSS")
        t0, c0 = time.perf_counter(), time.process_time()
        trainer.train_step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        peaks.append(_status("VmHWM") - before)
    return statistics.median(times), statistics.median(cpu), max(peaks)


def worker(n: int, variant: str, steps: int, max_len: int) -> None:
    """One (length, variant) in this process; prints ``{"seconds": ..., "cpu_seconds": ..., "peak_bytes": ...}``."""
    import tempfile

    from dmc_train.recipes import load_config
    from dmc_train.training.loop import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config([
            "+recipe=tiny_pretrain", "model=base_tiny", "model.vocab_size=512",
            f"model.max_position_embeddings={max_len}", f"train.seq_length={n}", "train.micro_batch_size=1",
            "train.global_batch_size=1", "train.max_steps=100", "logging.progress=false", f"run_dir={tmp}/run",
            "checkpoint.resume=none", *VARIANTS[variant]])
        seconds, cpu_seconds, peak = measure(Trainer(cfg), steps)
    print(json.dumps({"seconds": seconds, "cpu_seconds": cpu_seconds, "peak_bytes": peak}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=None, help="also save a PNG of the ratios")
    parser.add_argument("--worker", nargs=2, metavar=("N", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(int(args.worker[0]), args.worker[1], args.steps, max(args.lengths))

    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    rows = []
    for n in args.lengths:
        result = {"n": n}
        for name in VARIANTS:
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", str(n), name, "--steps", str(args.steps),
                   "--lengths", *map(str, args.lengths)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"error: {name} at n={n} failed:\n{proc.stderr[-3000:]}")
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            result[name] = (r["seconds"], r["peak_bytes"], r["cpu_seconds"])
            print(f"  n={n:5d} {name:10s} step {r['seconds'] * 1e3:8.1f} ms (CPU {r['cpu_seconds'] * 1e3:8.1f} ms)  "
                  f"peak +{r['peak_bytes'] / 2**20:7.1f} MiB", flush=True)
        rows.append(result)

    print("\nseq len | vanilla ms | DMC exact ms (x) | DMC window ms (x) | vanilla MiB | DMC exact MiB (x) | "
          "DMC window MiB (x)")
    for r in rows:
        v_t, v_m = r["vanilla"][:2]
        cells = [f"{r['n']:7d}", f"{v_t * 1e3:10.1f}"]
        for name in ("dmc_exact", "dmc_window"):
            cells.append(f"{r[name][0] * 1e3:8.1f} ({r[name][0] / v_t:.2f}x)")
        cells.append(f"{v_m / 2**20:11.1f}")
        for name in ("dmc_exact", "dmc_window"):
            cells.append(f"{r[name][1] / 2**20:8.1f} ({r[name][1] / v_m:.2f}x)")
        print(" | ".join(cells))
    print("\nCPU time per step (user + system, all threads) | vanilla ms | DMC exact ms (x) | DMC window ms (x)")
    for r in rows:
        v_c = r["vanilla"][2]
        print(f"{r['n']:7d} | {v_c * 1e3:10.1f} | " + " | ".join(
            f"{r[name][2] * 1e3:8.1f} ({r[name][2] / v_c:.2f}x)" for name in ("dmc_exact", "dmc_window")))
    if args.out:
        plot(rows, args.out)
        print(f"plot: {args.out}")


def plot(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = [r["n"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for i, (ax, what) in enumerate(zip(axes, ("step time", "peak memory"))):
        for name in ("dmc_exact", "dmc_window"):
            ax.plot(lengths, [r[name][i] / r["vanilla"][i] for r in rows], marker="o", label=name)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.set_xlabel("sequence length")
        ax.set_ylabel(f"{what}: DMC / vanilla")
        ax.legend()
    fig.suptitle("DMC training vs vanilla attention (base_tiny shape, CPU, one run)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
