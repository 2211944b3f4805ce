"""LESS on base_tiny: held-out perplexity of Full, Baseline (the policy alone), Baseline+ (the policy with as
many extra entries as LESS's state holds bytes) and LESS, at two budgets, with the transfer rows (LESS
trained at one budget, run at the other), and one cell decoded for real by the engine's LESS cache.

    python benchmarks/less.py                              # trains what is missing (recipe less_tiny), then evaluates
    python benchmarks/less.py --policy h2o --budgets 12 25 --steps 200 --max-sequences 64

Needs ``runs/base_tiny`` (README command 1). Training runs go to ``runs/less_tiny_<policy>_<budget>``
(resumable: a finished run is not trained again). Evaluation: teacher-forced decoding of the first
``--max-sequences`` test sequences (each decoded from its first token with the budget), the parallel form
the engine's decoding equals (tests). Prints the table and the training cost (tokens/s of a LESS step
vs a vanilla step of the same model) and writes ``--out`` (PNG).
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train(policy: str, budget: int, steps: int) -> str:
    run_dir = os.path.join(ROOT, f"runs/less_tiny_{policy}_{budget}")
    if not os.path.exists(os.path.join(run_dir, "checkpoints", "latest")) or _step(run_dir) < steps:
        print(f"training LESS on {policy} at budget {budget} ({steps} steps) -> {run_dir}", flush=True)
        subprocess.run([sys.executable, "launch/pretrain.py", "+recipe=less_tiny", f"method.policy={policy}",
                        f"method.budget={budget}", f"train.max_steps={steps}", f"train.eval_interval={steps // 2}",
                        f"checkpoint.save_interval={steps // 2}", f"run_dir={run_dir}"], cwd=ROOT, check=True)
    return run_dir


def _step(run_dir: str) -> int:
    with open(os.path.join(run_dir, "checkpoints", "latest")) as f:
        return int(f.read().strip().rsplit("_", 1)[-1])


def throughput(run_dir: str) -> float:
    lines = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    rates = sorted(m["tokens_per_s"] for m in lines if "tokens_per_s" in m)
    return rates[len(rates) // 2] if rates else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", default=os.path.join(ROOT, "runs/base_tiny"))
    p.add_argument("--policy", default="h2o")
    p.add_argument("--budgets", type=int, nargs=2, default=[12, 25], help="entries (5 %% and 10 %% of 256)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--max-sequences", type=int, default=64)
    p.add_argument("--engine-sequences", type=int, default=4, help="sequences decoded by the engine for one cell")
    p.add_argument("--out", default=os.path.join(ROOT, "runs/less.png"))
    p.add_argument("--json", default=os.path.join(ROOT, "runs/less_benchmark.json"))
    args = p.parse_args()

    from dmc_train.data.datasets import build_datasets
    from dmc_train.evaluation.harness import samples_of, teacher_forced_metrics
    from dmc_train.inference.caches import teacher_forced
    from dmc_train.inference.model import LlamaForInference

    runs = {b: train(args.policy, b, args.steps) for b in args.budgets}
    base, loaded = LlamaForInference.from_checkpoint(args.base)
    cfg = loaded.cfg
    _, _, test = build_datasets(cfg, num_train_samples=cfg.train.global_batch_size)
    data = samples_of(test, args.max_sequences)
    s, n = base.shape, cfg.train.seq_length
    less = {b: LlamaForInference.from_checkpoint(runs[b])[0] for b in args.budgets}  # the base + its kernels
    rank = less[args.budgets[0]].method.rank
    # Baseline+: as many extra K+V entries as fit in the bytes of LESS's state (H and z; fp32 both), rounded down
    extra = (rank * s.head_dim + rank) // (2 * s.head_dim)

    def ppl(budget: int, trained=None) -> float:
        start = time.perf_counter()  # the policy alone on the base, or the base with LESS's kernels from `trained`
        forward = (teacher_forced(args.policy, base, {"budget": budget}) if trained is None else
                   teacher_forced("less", less[trained], {"budget": budget}))
        r = teacher_forced_metrics(forward, *data)
        print(f"  budget {budget:3d} {'policy' if trained is None else f'LESS trained at {trained}'}: "
              f"ppl {r['ppl']:.2f} ({time.perf_counter() - start:.0f}s)", flush=True)
        return r["ppl"]

    results = {"full": ppl(n), "extra_entries": extra, "rows": {}}
    for b in args.budgets:
        other = [x for x in args.budgets if x != b][0]
        results["rows"][b] = {"baseline": ppl(b), "baseline_plus": ppl(b + extra), "less": ppl(b, b),
                              f"less_trained_at_{other}": ppl(b, other)}
    results["engine_cell"] = engine_perplexity(less[args.budgets[0]], test, args.engine_sequences)
    results["train_tokens_per_s"] = {**{str(b): throughput(runs[b]) for b in args.budgets},
                                     "base_tiny": throughput(args.base)}
    report(results, args)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
    plot(results, args)


def engine_perplexity(model, data, count: int) -> dict:
    """The same cell two ways on ``count`` sequences of a LESS ``model``: teacher-forced (parallel form) and
    decoded token by token by the engine's LESS cache (the harness's incremental measure)."""
    from dmc_train.evaluation.harness import incremental_metrics, samples_of
    from dmc_train.inference.caches import teacher_forced

    r = incremental_metrics(model, "less", {}, teacher_forced("less", model, {}), *samples_of(data, count))
    return {"sequences": count, "budget": model.method.budget, "ppl_parallel": r["ppl_parallel"],
            "ppl_engine": r["ppl_engine"]}


def report(r: dict, args) -> None:
    print(f"\nLESS on {args.policy}, base_tiny, first {args.max_sequences} test sequences of 256 tokens; "
          f"full cache {r['full']:.2f}; Baseline+ = budget + {r['extra_entries']} entries (the state's bytes)")
    print("| budget | Baseline | Baseline+ | LESS | LESS trained at the other budget |")
    print("|---|---|---|---|---|")
    for b, row in r["rows"].items():
        transfer = next(v for k, v in row.items() if k.startswith("less_trained_at"))
        print(f"| {b} | {row['baseline']:.2f} | {row['baseline_plus']:.2f} | {row['less']:.2f} | {transfer:.2f} |")
    c = r["engine_cell"]
    print(f"engine cell (budget {c['budget']}, {c['sequences']} sequences): parallel form {c['ppl_parallel']:.4f}, "
          f"engine decoding {c['ppl_engine']:.4f}")
    t = r["train_tokens_per_s"]
    print("training tokens/s: " + ", ".join(f"{k}: {v:,.0f}" for k, v in t.items()))


def plot(r: dict, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = list(r["rows"])
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for key, label in (("baseline", "Baseline (policy)"), ("baseline_plus", "Baseline+"), ("less", "LESS")):
        ax.plot(budgets, [r["rows"][b][key] for b in budgets], marker="o", label=label)
    ax.axhline(r["full"], color="black", linestyle="--", label="full cache")
    ax.set_xlabel(f"{args.policy} budget (entries per KV head, context 256)")
    ax.set_ylabel("test perplexity")
    ax.set_title("LESS on base_tiny")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
