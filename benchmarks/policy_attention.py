"""What each eviction policy keeps of the attention, per layer: the evidence behind the study's orderings.

    python benchmarks/policy_attention.py                                   # runs/inits/smollm2, 1/4 and 1/8
    python benchmarks/policy_attention.py --sequences 2 --fractions 0.25 --policies knorm lsh_e h2o

For an imported checkpoint (``launch/prepare_model.py``) and its held-out test split, the first
``--sequences`` sequences of ``--seq-length`` tokens are run teacher-forced through every policy's parallel form
(``--prompt-len`` tokens of prompt, then the decoded tokens under the budget, as the study's cells), and for every
decoded query and layer two numbers are taken against the full attention of the same query:

- **kept mass**: the share of the full attention's probability (mean over the query heads) that falls on the
  entries the policy lets this query see. 1 = the policy lost nothing this query would have read;
- **recent coverage**: the share of the ``--recent`` tokens before the query that it still sees.

Printed: one row per (policy, schedule, fraction) with the mean over layers and the weakest layer of each, and the
per-layer curves as ``<out>/policy_attention.png``. Under the decode schedule a policy with no recent window (Knorm,
whose priority is the key norm alone) can evict the newest tokens, which most heads attend to; the recent
coverage shows whether it does.
"""

import argparse
import json
import os
import time

import torch


def test_sequences(checkpoint: str, count: int, seq_length: int) -> torch.Tensor:
    """``[count, seq_length]`` tokens of the checkpoint's held-out test split, in its own tokenizer."""
    from dmc_train.data.datasets import build_datasets
    from dmc_train.evaluation.harness import samples_of
    from dmc_train.evaluation.imported import imported_overrides
    from dmc_train.recipes import load_config

    cfg = load_config(imported_overrides([f"checkpoint.resume={checkpoint}", f"train.seq_length={seq_length}"]))
    _, _, test = build_datasets(cfg, num_train_samples=cfg.train.global_batch_size)
    return samples_of(test, count)[0]


def measure(model, scorer, budget: int, tokens: torch.Tensor, prompt_len: int, recent: int) -> dict[str, list]:
    """Per layer, over the decoded queries of ``tokens [b, n]``: the mean kept mass and recent coverage."""
    from dmc_train.policies.parallel import run_policy

    mass, coverage = [], []

    def attend(layer, q, k, v, info):
        run = run_policy(scorer, q, k, v, budget, layer, prompt_len, tokens.shape[1] - prompt_len)
        b, h, n, _ = q.shape
        hk = k.shape[1]
        sees = run.visible()[:, :, prompt_len:]  # [b, H_kv, m, n]: decoded query t sees entry j
        logits = torch.einsum("bkgtd,bknd->bkgtn", q.float().view(b, hk, h // hk, n, -1)[:, :, :, prompt_len:],
                              k.float()) * scorer.scale
        t = torch.arange(prompt_len, n)[:, None]
        causal = torch.arange(n)[None, :] <= t  # [m, n]
        probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)  # full attention
        mass.append(float((probs * sees[:, :, None]).sum(-1).mean()))
        window = causal & (torch.arange(n)[None, :] > t - 1 - recent) & (torch.arange(n)[None, :] < t)  # [m, n]
        coverage.append(float((sees & window).sum(-1).float().mean() / window.sum(-1).float().mean()))
        return run.out

    model.forward_with_attention(tokens, attend)
    return {"kept_mass": mass, "recent_coverage": coverage}


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fractions = sorted({r["fraction"] for r in rows}, reverse=True)
    fig, axes = plt.subplots(2, len(fractions), figsize=(6 * len(fractions), 7), squeeze=False)
    for col, f in enumerate(fractions):
        for r in (r for r in rows if r["fraction"] == f):
            style = "-" if r["schedule"] == "decode" else "--"
            for row, key in enumerate(("kept_mass", "recent_coverage")):
                axes[row][col].plot(r[key], style, label=f"{r['label']} ({r['schedule']})", linewidth=1.2)
        axes[0][col].set_title(f"budget 1/{round(1 / f)} of the context")
        axes[0][col].set_ylabel("full attention's mass on the kept entries")
        axes[1][col].set_ylabel("share of the recent tokens still seen")
        for row in range(2):
            axes[row][col].set_xlabel("layer")
            axes[row][col].grid(True, alpha=0.3)
        axes[0][col].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    from dmc_train.inference.model import LlamaForInference
    from dmc_train.policies import POLICIES, build_scorer

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", default="runs/inits/smollm2")
    parser.add_argument("--sequences", type=int, default=2)
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--prompt-len", type=int, default=768)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.125])
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    parser.add_argument("--schedules", nargs="+", default=["decode", "prefill"], choices=["decode", "prefill"])
    parser.add_argument("--recent", type=int, default=32)
    parser.add_argument("--out", default="runs/policy_attention")
    args = parser.parse_args()

    model, _ = LlamaForInference.from_checkpoint(args.checkpoint)
    tokens = test_sequences(args.checkpoint, args.sequences, args.seq_length)
    rows, start = [], time.perf_counter()
    cases = [(f, s, p) for f in args.fractions for s in args.schedules for p in args.policies]
    print(f"{'policy':<14} {'schedule':<8} {'fraction':>8} {'kept mass':>10} {'weakest layer':>14} "
          f"{'recent seen':>12} {'weakest layer':>14}")
    for i, (f, schedule, name) in enumerate(cases):
        options = {"budget": f, "schedule": schedule} | ({"compression_ratio": 1 - f} if schedule == "prefill" else {})
        s = model.shape
        scorer = build_scorer(name, options, s.head_dim, s.num_heads // s.num_kv_heads, model.scale)
        budget = scorer.budget(args.seq_length)
        r = {"policy": name, "label": POLICIES[name].label, "schedule": schedule, "fraction": f, "budget": budget,
             **measure(model, scorer, budget, tokens, args.prompt_len, args.recent)}
        rows.append(r)
        m, c = r["kept_mass"], r["recent_coverage"]
        print(f"{r['label']:<14} {schedule:<8} {f:>8g} {sum(m) / len(m):>10.3f} "
              f"{min(m):>7.3f} (L{m.index(min(m)):>2}) {sum(c) / len(c):>12.3f} {min(c):>7.3f} (L{c.index(min(c)):>2})"
              f"   [{i + 1}/{len(cases)}, {time.perf_counter() - start:.0f}s]", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "policy_attention.json"), "w") as fh:
        json.dump({"args": vars(args), "rows": rows}, fh, indent=1)
    plot(rows, os.path.join(args.out, "policy_attention.png"))
    print(f"wrote {os.path.join(args.out, 'policy_attention.png')} and policy_attention.json")


if __name__ == "__main__":
    main()
