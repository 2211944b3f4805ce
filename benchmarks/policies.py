"""Eviction policies: decode cost that stays flat as the context grows, and held-out perplexity at a budget.

    python benchmarks/policies.py                        # both parts (the second needs runs/base_tiny)
    python benchmarks/policies.py --part speed --contexts 256 1024 4096 --budget 256
    python benchmarks/policies.py --part ppl --checkpoint runs/base_tiny --max-sequences 64

1. **speed**: a model shaped like ``base_tiny`` (4 layers, hidden 256, 8 heads, MHA) with random weights
   and 4,096+ positions. For each context length a batch of ``--batch`` prompts of that length is
   prefilled into every cache, then ``--steps`` decode steps are timed round robin over every
   (context, cache) pair (median step; the machine's load hits every one alike). Every policy holds ``--budget``
   entries per (sequence, layer, KV head) whatever the context; the full cache holds the context.
   Printed per cache: step time per context, the ratio of the longest to the shortest context (goal
   <= 1.15 for a policy), the policy's step over the full cache's holding as many entries (the full
   cache at context = budget; goal <= 1.3), and the bytes one sequence holds (pages + state).
2. **ppl**: teacher-forced perplexity of a trained checkpoint on the first ``--max-sequences``
   sequences of its test split, for every policy (schedule ``decode``, decoding from the first token)
   at budgets 1/2, 1/4, 1/8 of the sequence length, next to the full cache; a plot to ``--out``.

All ratios come from this run (the machine is noisy).
"""

import argparse
import json
import os
import statistics
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def speed(args) -> dict:
    from dmc_train.inference.caches import build_cache
    from dmc_train.inference.model import LlamaForInference, ModelShape, random_weights
    from dmc_train.inference.pool import PagePool
    from dmc_train.policies import POLICIES

    longest = max(args.contexts)
    shape = ModelShape(num_layers=4, hidden_size=256, ffn_hidden_size=688, num_heads=8, num_kv_heads=8,
                       vocab_size=4096, max_positions=longest + args.steps + 8)
    model = LlamaForInference(shape, random_weights(shape), None, torch.float32)
    rows = args.batch * shape.num_layers * shape.num_kv_heads
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, shape.vocab_size, (longest,), generator=g) for _ in range(args.batch)]
    names = ["full", *POLICIES]
    caches = {}
    for context in args.contexts:  # every cache of every context holds the same prompts
        for name in names:
            pages = rows * (-(-(context + args.steps + 1) // 16))
            cache = build_cache(name, PagePool(pages, 16, shape.head_dim, rows, shape.max_positions), model,
                                {} if name == "full" else {"budget": args.budget})
            for s in range(args.batch):
                cache.add(s, args.steps)
                model.prefill(cache, s, prompts[s][:context])
            caches[context, name] = cache
        print(f"  prefilled {context} tokens x {args.batch} sequences into every cache", flush=True)
    times = {key: [] for key in caches}
    seqs = list(range(args.batch))
    for step in range(args.steps):  # round robin over every (context, cache): the machine's load hits all alike
        tokens = torch.randint(0, shape.vocab_size, (args.batch,), generator=g)
        for (context, name), cache in caches.items():
            start = time.perf_counter()
            model.decode(cache, seqs, tokens, torch.full((args.batch,), context + step))
            times[context, name].append(time.perf_counter() - start)
    results = {name: {} for name in names}
    for (context, name), cache in caches.items():
        held = cache.bytes_held(0)
        results[name][context] = {"step_ms": 1e3 * statistics.median(times[context, name][2:]),
                                  "bytes": held["total"], "state_bytes": held["state"]}
        print(f"  {name:14s} context {context:5d}: {results[name][context]['step_ms']:.2f} ms/step "
              f"(batch {args.batch}), {held['total'] / 1024:.0f} KiB per sequence", flush=True)
    lo, hi = min(args.contexts), max(args.contexts)
    full_at_budget = results["full"].get(args.budget, {}).get("step_ms")
    print(f"\nstep time at {hi} / at {lo} tokens of context; step over the full cache holding {args.budget} "
          f"entries; KiB per sequence at {hi}")
    for name, r in results.items():
        flat = r[hi]["step_ms"] / r[lo]["step_ms"]
        vs_full = (f"{r[hi]['step_ms'] / full_at_budget:.2f}x" if full_at_budget and name != "full" else "-")
        print(f"  {name:14s} {flat:5.2f}x   {vs_full:>6s}   {r[hi]['bytes'] / 1024:8.0f}")
    return results


def perplexity(args) -> dict:
    from dmc_train.data.datasets import build_datasets
    from dmc_train.evaluation.harness import samples_of, teacher_forced_metrics
    from dmc_train.inference.caches import teacher_forced
    from dmc_train.inference.model import LlamaForInference
    from dmc_train.policies import POLICIES

    model, loaded = LlamaForInference.from_checkpoint(args.checkpoint)
    cfg = loaded.cfg
    _, _, test = build_datasets(cfg, num_train_samples=cfg.train.global_batch_size)
    data = samples_of(test, args.max_sequences)
    n = cfg.train.seq_length
    results = {"full": {}}
    full = teacher_forced_metrics(teacher_forced("full", model, {}), *data)
    results["full"] = {str(n): full["ppl"]}
    print(f"full cache: test perplexity {full['ppl']:.2f} ({full['tokens']} tokens)", flush=True)
    budgets = [n // 2, n // 4, n // 8]
    for name in POLICIES:
        results[name] = {}
        for budget in budgets:
            r = teacher_forced_metrics(teacher_forced(name, model, {"budget": budget}), *data,
                                       progress=lambda line: print("  " + line, end="\r", flush=True), label=name)
            results[name][str(budget)] = r["ppl"]
            print(f"  {name:14s} budget {budget:4d} ({n // budget}x fewer entries): test perplexity {r['ppl']:.2f}"
                  + " " * 30, flush=True)
    print(f"\ntest perplexity, first {args.max_sequences} test sequences of {n} tokens (full cache "
          f"{full['ppl']:.2f})")
    print("| policy | " + " | ".join(f"budget {b} (1/{n // b})" for b in budgets) + " |")
    print("|---|" + "---|" * len(budgets))
    for name in POLICIES:
        print(f"| {name} | " + " | ".join(f"{results[name][str(b)]:.2f}" for b in budgets) + " |")
    for b in budgets:
        best = min(POLICIES, key=lambda p: results[p][str(b)])
        print(f"budget {b}: best {best} ({results[best][str(b)]:.2f})")
    plot(results, budgets, n, args.out)
    return results


def plot(results: dict, budgets: list[int], n: int, out: str) -> None:
    """Perplexity vs compression, one line per policy; the right panel without the policies far above the
    full cache, so the close ones can be told apart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    full = next(iter(results["full"].values()))
    close = [p for p in results if p != "full" and max(results[p].values()) < 1.5 * full]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, names in zip(axes, ([p for p in results if p != "full"], close)):
        for name in names:
            ax.plot([n / b for b in budgets], [results[name][str(b)] for b in budgets], marker="o", label=name)
        ax.axhline(full, color="black", linestyle="--", label="full cache")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("compression (context / budget per KV head)")
        ax.set_ylabel("test perplexity (teacher-forced decoding)")
        ax.legend(fontsize=8)
    axes[0].set_title("Eviction policies on base_tiny")
    axes[1].set_title("the policies within 1.5x of the full cache")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"plot: {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("speed", "ppl", "all"), default="all")
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--checkpoint", default=os.path.join(ROOT, "runs/base_tiny"))
    p.add_argument("--max-sequences", type=int, default=64)
    p.add_argument("--out", default=os.path.join(ROOT, "runs/policies.png"))
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    results = {}
    if args.part in ("speed", "all"):
        results["speed"] = speed(args)
    if args.part in ("ppl", "all"):
        results["ppl"] = perplexity(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
