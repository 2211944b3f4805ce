"""Retrofit a base model with DMC, GQA and Fixed Memory Pooling at equal token budgets; compare them.

    python benchmarks/retrofit_study.py                      # the controlled study (preset "study")
    python benchmarks/retrofit_study.py --preset tiny        # the first comparison, from runs/base_tiny
    python benchmarks/retrofit_study.py --runs gqa2 dmc2     # a subset; --parallel 2 runs two at a time

Presets:
- ``study``: base ``runs/base_tiny_long`` (``+recipe=base_tiny_long``, 9.8M tokens; trained here first
  when missing), every retrofit 0.98M tokens (10 % of the base budget) at LR 5e-4, in three regimes:
  - 240 steps x 16 sequences, one cosine schedule (5e-4 -> 5e-5) for every method; DMC zero-out 20
    steps, ramp 160, 60 at the target: GQA, DMC and pooling at 2x/4x, and DMC's own schedule
    (constant LR, cosine over the last 60 steps) at 2x (``dmc2_dmcsched``);
  - ``*_steps``: the same tokens in 960 steps of 4 sequences (ramp 640), cosine: DMC 2x (both RoPE
    orders, both CR-loss forms) and 4x;
  - ``*_ramp2``: the same tokens in 1,920 steps of 2 sequences under one WSD schedule for every method
    (constant LR, cosine to 10 % over the last 480 steps); DMC zero-out 160, ramp 1,120, 640 at the
    target: GQA, DMC (both RoPE orders) and pooling at 2x/4x, the released and per-(layer, head) CR losses at 2x;
    GQA and DMC 2x at a lower LR (``*_lr``), and in 960 steps of 4 sequences (``*_ramp4``, same shape).
- ``tiny``: the first comparison (base ``runs/base_tiny`` from README command 1, 400 steps x
  8,192 tokens, DMC on its own constant-then-cosine schedule, GQA cosine).

Resumable: a finished run (``eval.json`` of its last checkpoint) is not repeated, an interrupted one
resumes (``resume=auto``). GQA runs start from ``checkpoints_tools/convert_gqa.py`` output. Prints
held-out perplexity and the KV-cache compression (DMC and pooling: measured on the test split with
the hard, inference-time decisions), writes ``results.json`` under the preset's folder in runs/, a
plot ``docs/retrofit_<preset>.png`` and, for the study, per-head CR heatmaps
``docs/retrofit_study_heatmaps.png`` and the training-time CR against its target
``docs/retrofit_study_cr.png``.
"""

import argparse
import json
import os
import subprocess
import sys
import time

from dmc_train.recipes import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # runs/ and docs/ of this checkout

_DMC = ["+recipe=dmc_tiny"]
_GQA = ["+recipe=gqa_tiny"]
_POOL = ["+recipe=dmc_tiny", "method=fixed_pooling"]
# The study's tokens in 4x the optimizer steps (960 x 4 sequences instead of 240 x 16), ramp 4x longer.
_STEPS = ["train.max_steps=960", "train.global_batch_size=4", "train.micro_batch_size=4", "method.zero_out_steps=80",
          "method.ramp_steps=640", "train.eval_interval=240", "checkpoint.save_interval=240"]


def _wsd(steps: int, seqs: int, dmc: bool = False) -> list[str]:
    """The ramp regime: the study's tokens in ``steps`` steps of ``seqs`` sequences under one schedule for
    every method, constant LR then a cosine to 10 % over the last quarter (``optim.schedule=wsd``);
    DMC zeroes out over the first 1/12 of the steps, ramps until 2/3 and holds the target for the last third."""
    q = steps // 4
    args = [f"train.max_steps={steps}", f"train.global_batch_size={seqs}", f"train.micro_batch_size={seqs}",
            "optim.schedule=wsd", f"optim.anneal_steps={q}", f"train.eval_interval={q}",
            f"checkpoint.save_interval={q}"]
    return args + ([f"method.zero_out_steps={steps // 12}", f"method.ramp_steps={steps * 7 // 12}"] if dmc else [])


_RAMP2, _RAMP2_DMC = _wsd(1920, 2), _wsd(1920, 2, dmc=True)  # the ramp regime's main runs
_RAMP4, _RAMP4_DMC = _wsd(960, 4), _wsd(960, 4, dmc=True)  # the same shape in 960 steps of 4 sequences


PRESETS = {
    "tiny": {
        "base": ("runs/base_tiny", ["+recipe=base_tiny"]),
        "common": {"dmc": [], "gqa": []},
        "runs": {
            "dmc2": _DMC + ["method.target_cr=2"],
            "dmc4": _DMC + ["method.target_cr=4"],
            "gqa2": _GQA + ["model.num_query_groups=4"],
            "gqa4": _GQA + ["model.num_query_groups=2"],
            "pool2": _POOL + ["method.pool=2"],
            "pool4": _POOL + ["method.pool=4"],
        },
        "title": "Retrofitting base_tiny (3.3M tokens each)",
    },
    "study": {
        "base": ("runs/base_tiny_long", ["+recipe=base_tiny_long"]),
        # One schedule and one token budget for every method: 240 steps x 16 x 256 tokens.
        "common": {
            "all": ["train.max_steps=240", "train.global_batch_size=16", "train.eval_interval=60",
                    "checkpoint.save_interval=60", "optim.lr=5e-4", "optim.schedule=cosine",
                    "optim.min_lr_ratio=0.1", "optim.warmup_steps=0"],
            "dmc": ["checkpoint.init_from=runs/base_tiny_long", "method.zero_out_steps=20",
                    "method.ramp_steps=160", "method.finetune_steps=0"],
            "gqa": ["checkpoint.init_from=runs/base_tiny_long_gqa${model.num_query_groups}"],
        },
        "runs": {
            "gqa2": _GQA + ["model.num_query_groups=4"],
            "dmc2": _DMC + ["method.target_cr=2"],
            "gqa4": _GQA + ["model.num_query_groups=2"],
            "dmc4": _DMC + ["method.target_cr=4"],
            "pool2": _POOL + ["method.pool=2"],
            # DMC's own schedule (constant LR, cosine to 10 % over the 60 steps at the target).
            "dmc2_dmcsched": _DMC + ["method.target_cr=2", "optim.schedule=constant", "method.finetune_steps=60"],
            "dmc2_steps": _DMC + ["method.target_cr=2", *_STEPS],
            "dmc2_steps_pre": _DMC + ["method.target_cr=2", "method.rope_order=pre", *_STEPS],
            "dmc2_steps_released": _DMC + ["method.target_cr=2", "method.cr_loss=released", *_STEPS],
            "dmc4_steps": _DMC + ["method.target_cr=4", *_STEPS],
            "dmc2_ramp2": _DMC + ["method.target_cr=2", *_RAMP2_DMC],
            "gqa2_ramp2": _GQA + ["model.num_query_groups=4", *_RAMP2],
            "gqa4_ramp2": _GQA + ["model.num_query_groups=2", *_RAMP2],
            "dmc4_ramp2": _DMC + ["method.target_cr=4", *_RAMP2_DMC],
            "pool2_ramp2": _POOL + ["method.pool=2", *_RAMP2_DMC],
            "pool4_ramp2": _POOL + ["method.pool=4", *_RAMP2_DMC],
            "dmc2_ramp2_pre": _DMC + ["method.target_cr=2", "method.rope_order=pre", *_RAMP2_DMC],
            "dmc2_ramp2_released": _DMC + ["method.target_cr=2", "method.cr_loss=released", *_RAMP2_DMC],
            "dmc4_ramp2_pre": _DMC + ["method.target_cr=4", "method.rope_order=pre", *_RAMP2_DMC],
            "dmc2_ramp2_per_layer_head": _DMC + ["method.target_cr=2", "method.cr_loss=per_layer_head", *_RAMP2_DMC],
            # The ramp regime at LR 1.75e-4 (5e-4 / sqrt(8): square-root scaling for 8x smaller batches).
            "gqa2_ramp2_lr": _GQA + ["model.num_query_groups=4", *_RAMP2, "optim.lr=1.75e-4"],
            "dmc2_ramp2_lr": _DMC + ["method.target_cr=2", *_RAMP2_DMC, "optim.lr=1.75e-4"],
            "gqa2_ramp4": _GQA + ["model.num_query_groups=4", *_RAMP4],
            "dmc2_ramp4": _DMC + ["method.target_cr=2", *_RAMP4_DMC],
        },
        "title": "Retrofitting base_tiny_long (0.98M tokens each, one LR schedule)",
    },
}


def run_args(preset: str, name: str) -> list[str]:
    """The Hydra overrides of run ``name``: its recipe and settings, then the preset's common ones."""
    p = PRESETS[preset]
    args = list(p["runs"][name])
    common = p["common"]
    family = "gqa" if name.startswith("gqa") else "dmc"
    extra = [*common.get("all", []), *common[family]]
    if extra:  # the study names its runs; the tiny preset keeps the recipes' run names
        extra.append(f"run_name=study_{name}")
    # A run's own setting wins over the common one (e.g. dmc2_dmcsched's schedule).
    own = {a.split("=")[0] for a in args}
    return args + [a for a in extra if a.split("=")[0] not in own]


def sh(args: list[str], log: str | None = None, threads: int | None = None) -> subprocess.Popen:
    """``python <args>`` in the checkout root (``args`` start with ``-m <module>``)."""
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    out = open(log, "a") if log else None
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def wait(proc: subprocess.Popen, what: str) -> None:
    if proc.wait() != 0:
        sys.exit(f"error: {what} failed (exit {proc.returncode}); see its log under runs/logs/")


def _eval(run_dir: str) -> dict:
    with open(os.path.join(ROOT, run_dir, "eval.json")) as f:
        return json.load(f)


def prepare_base(preset: str) -> str:
    """The preset's base run, trained and evaluated here when missing (the study's; the tiny preset's
    base is README command 1)."""
    base, recipe = PRESETS[preset]["base"]
    if os.path.exists(os.path.join(ROOT, base, "eval.json")):
        return base
    if preset == "tiny":
        sys.exit(f"error: {base} is missing or not evaluated; run README command 1 (launch/quickstart.sh) first")
    os.makedirs(os.path.join(ROOT, "runs/logs"), exist_ok=True)
    log = os.path.join(ROOT, "runs/logs/retrofit_base.log")
    print(f"training the base model {' '.join(recipe)} (log {log})", flush=True)
    wait(sh(["-m", "launch.pretrain", *recipe, "logging.progress=true"], log), "training the base model")
    wait(sh(["-m", "launch.evaluate", *recipe], log), "evaluating the base model")
    return base


def convert(base: str, groups: int) -> None:
    out = f"{base}_gqa{groups}"
    if not os.path.exists(os.path.join(ROOT, out, "meta.json")):
        wait(sh(["-m", "checkpoints_tools.convert_gqa", "--input", base, "--output", out, "--groups", str(groups)]),
             f"GQA conversion to {groups} groups")


def train_all(preset: str, names: list[str], parallel: int, threads: int) -> None:
    """Train and evaluate every run not finished yet, ``parallel`` at a time with ``threads`` threads each."""
    os.makedirs(os.path.join(ROOT, "runs/logs"), exist_ok=True)
    pending = [n for n in names if not os.path.exists(os.path.join(ROOT, run_dir(preset, n), "eval.json"))]
    active = []
    t0 = time.time()
    while pending or active:
        while pending and len(active) < parallel:
            name = pending.pop(0)
            log = os.path.join(ROOT, f"runs/logs/retrofit_{preset}_{name}.log")
            args = run_args(preset, name)
            print(f"[{time.time() - t0:6.0f}s] start {name}: {' '.join(args)} (log {log})", flush=True)
            active.append((name, sh(["-m", "launch.pretrain", *args, "logging.progress=true"], log, threads), log))
        time.sleep(5)
        for item in list(active):
            name, proc, log = item
            if proc.poll() is not None:
                active.remove(item)
                wait(proc, f"training {name}")
                wait(sh(["-m", "launch.evaluate", *run_args(preset, name)], log, threads), f"evaluating {name}")
                print(f"[{time.time() - t0:6.0f}s] done {name}", flush=True)


def run_dir(preset: str, name: str) -> str:
    return load_config(run_args(preset, name)).run_dir


def results(preset: str, base: str, names: list[str]) -> list[dict]:
    """One row per run: name, compression, held-out perplexities, per-head CR (DMC/pooling)."""
    rows = [{"name": "base", "cr": 1.0, **_ppl(_eval(base))}]
    for name in names:
        cfg = load_config(run_args(preset, name))
        ev = _eval(cfg.run_dir)
        row = {"name": name, **_ppl(ev)}
        if cfg.method.name == "none":  # GQA: heads / groups
            row["cr"] = cfg.model.num_attention_heads / cfg.model.num_query_groups
        else:  # DMC / pooling: measured from the hard decisions on the test split
            row["cr"] = ev["test_achieved_cr"]
            row["cr_per_head"] = ev.get("test_achieved_cr_per_head")
        rows.append(row)
    return rows


def _ppl(ev: dict) -> dict:
    return {"valid_ppl": ev["valid_ppl"], "test_ppl": ev["test_ppl"]}


_LINES = {"dmc": "DMC (post, paper loss)", "dmc_pre": "DMC, rope_order=pre", "gqa": "GQA",
          "pool": "Fixed Memory Pooling"}
_COLORS = {"dmc": "C0", "dmc_pre": "C1", "gqa": "C2", "pool": "C3"}  # a variant takes its method's colour


def _line(name: str) -> tuple[bool, str | None]:
    """(ramp regime?, plot line) of run ``name``; line None for a single variant (e.g. ``dmc2_released``,
    ``dmc2_ramp4``)."""
    ramp = "_ramp" in name
    kind = name.replace("_ramp2", "")
    line = {"dmc2": "dmc", "dmc4": "dmc", "dmc2_pre": "dmc_pre", "dmc4_pre": "dmc_pre", "gqa2": "gqa", "gqa4": "gqa",
            "pool2": "pool", "pool4": "pool"}.get(kind)
    return ramp, line


def plot(rows: list[dict], path: str, title: str) -> None:
    """Test perplexity against compression, one line per method; ramp-regime runs in a second panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(False, "240 steps x 16 sequences (x: variants)")]
    if any(_line(r["name"])[0] for r in rows[1:]):
        panels.append((True, "one WSD schedule; lines: 1,920 steps x 2 sequences"))
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2), squeeze=False, sharey=True)
    for ax, (ramp, subtitle) in zip(axes[0], panels):
        ax.axhline(rows[0]["test_ppl"], color="gray", ls="--", lw=1, label="base model (no extra training)")
        mine = [r for r in rows[1:] if _line(r["name"])[0] == ramp]
        for key, label in _LINES.items():
            pts = sorted((r["cr"], r["test_ppl"]) for r in mine if _line(r["name"])[1] == key)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label, color=_COLORS[key])
        singles = sorted((r for r in mine if _line(r["name"])[1] is None), key=lambda r: (r["cr"], r["test_ppl"]))
        for i, r in enumerate(singles):  # single variants, labelled; neighbours' labels alternate above/below
            color = _COLORS[next(k for k in ("gqa", "pool", "dmc") if r["name"].startswith(k))]
            ax.scatter([r["cr"]], [r["test_ppl"]], marker="x", zorder=3, color=color)
            ax.annotate(r["name"], (r["cr"], r["test_ppl"]), fontsize=7, xytext=(4, 4 if i % 2 else -10),
                        textcoords="offset points")
        ax.set_xlabel("KV-cache compression (DMC/pooling: achieved on test)")
        ax.set_title(subtitle, fontsize=9)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("test perplexity")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"plot: {path}")


def heatmaps(rows: list[dict], path: str) -> None:
    """Achieved CR per layer x KV head on the test split, one panel per learned-DMC run that compresses
    (log colour), five panels per row."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    runs = [r for r in rows if r["name"].startswith("dmc") and r.get("cr_per_head") and r["cr"] > 1.05]
    if not runs:
        return
    cols = min(5, len(runs))
    rows_ = math.ceil(len(runs) / cols)
    fig, axes = plt.subplots(rows_, cols, figsize=(2.8 * cols + 1, 2.6 * rows_), squeeze=False, layout="constrained")
    vmax = max(2.0, max(float(np.nanmax(np.asarray(r["cr_per_head"], dtype=float))) for r in runs))
    norm = matplotlib.colors.LogNorm(vmin=1.0, vmax=vmax)
    for ax in axes.flat[len(runs):]:
        ax.axis("off")
    for ax, r in zip(axes.flat, runs):
        data = np.asarray(r["cr_per_head"], dtype=float)
        im = ax.imshow(data, cmap="viridis", norm=norm, aspect="auto", origin="lower")
        ax.set_xticks(range(data.shape[1]))
        ax.set_yticks(range(data.shape[0]))
        ax.set_title(f"{r['name']} ({r['cr']:.2f}x)", fontsize=8)
        ax.set_xlabel("KV head", fontsize=7)
        ax.set_ylabel("layer", fontsize=7)
        ax.tick_params(labelsize=6)
    fig.colorbar(im, ax=axes.ravel().tolist(), label="CR (log)")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"heatmaps: {path}")


def cr_curves(preset: str, names: list[str], path: str) -> None:
    """Training-time compression (relaxed decisions, logged every few steps) against the CR target, per
    DMC / pooling run, over the tokens seen: whether the decisions follow the ramp. Ramp-regime runs in
    a second panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [n for n in names if not n.startswith(("gqa", "pool"))]
    ramp = [n for n in runs if "_ramp" in n]
    panels = [p for p in ([n for n in runs if n not in ramp], ramp) if p]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False, sharey=True)
    for ax, panel in zip(axes[0], panels):
        for name in panel:
            cfg = load_config(run_args(preset, name))
            per_step = cfg.train.global_batch_size * cfg.train.seq_length / 1e6
            with open(os.path.join(ROOT, cfg.run_dir, "metrics.jsonl")) as f:
                rows = [r for r in map(json.loads, f) if "cr" in r]
            tokens = [r["step"] * per_step for r in rows]
            line, = ax.plot(tokens, [r["cr"] for r in rows], label=f"{name} ({cfg.train.max_steps} steps)")
            ax.plot(tokens, [r["target_cr"] for r in rows], ls=":", color=line.get_color())
        ax.set_xlabel("retrofit tokens (M)")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("compression in training (dotted: target)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"CR curves: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="study", choices=list(PRESETS))
    parser.add_argument("--runs", nargs="+", help="a subset of the preset's runs (default: all)")
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--threads", type=int, help="threads per run (default: the cores split evenly)")
    args = parser.parse_args()
    preset = PRESETS[args.preset]
    names = args.runs or list(preset["runs"])
    unknown = [n for n in names if n not in preset["runs"]]
    if unknown:
        sys.exit(f"error: unknown run(s) {', '.join(unknown)} for preset {args.preset}; "
                 f"choose from {', '.join(preset['runs'])}")
    base = prepare_base(args.preset)
    for name in names:
        if name.startswith("gqa"):
            convert(base, load_config(run_args(args.preset, name)).model.num_query_groups)
    train_all(args.preset, names, args.parallel, args.threads or max(1, (os.cpu_count() or 1) // args.parallel))

    rows = results(args.preset, base, names)
    print("\nrun            | KV compression | valid ppl | test ppl")
    for r in rows:
        print(f"{r['name']:14s} | {r['cr']:14.2f} | {r['valid_ppl']:9.2f} | {r['test_ppl']:8.2f}")
    out = os.path.join(ROOT, "runs", f"retrofit_{args.preset}")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(rows, f, indent=1)
    plot(rows, os.path.join(ROOT, f"docs/retrofit_{args.preset}.png"), preset["title"])
    if args.preset == "study":
        heatmaps(rows, os.path.join(ROOT, "docs/retrofit_study_heatmaps.png"))
        cr_curves(args.preset, names, os.path.join(ROOT, "docs/retrofit_study_cr.png"))


if __name__ == "__main__":
    main()
