"""The engine's decode speed in this checkout against another revision of the project, on this machine: is a change
within 5 % of before? (The CPU path must stay within 5 % of its speed; a shared machine drifts by more than that
between two whole benchmark runs, so the two revisions are interleaved generation by generation.)

    python benchmarks/decode_ab.py --baseline 8eca667            # every cache below, 40 rounds
    python benchmarks/decode_ab.py --baseline main --caches full h2o --rounds 60

The baseline revision is checked out once (``git worktree``, detached) into ``runs/bench/ab/<commit>``. The
checkpoints, made on first use into ``runs/bench/ab/models`` by this checkout's trainer (``base_tiny``'s shape, one
training step: speed does not depend on what the weights learned): ``base``, its GQA 2x conversion and a fixed-pooling
2x model (DMC's cache at exactly 2x). Caches (``--caches``): ``full`` (base), ``gqa`` (the conversion), ``dmc`` (the
pooling model), ``h2o``, ``tova``, ``lsh_e`` (base, ``--budget`` entries per KV head: they evict from the first
decoded token on), ``lightcache`` (base, :data:`LIGHTCACHE`); ``less_free`` is not here (LESS needs a trained run).

One worker process per checkout (the same script, ``--worker <root>``, that checkout first on ``PYTHONPATH``: its
``dmc_train`` and ``kernels``) builds every engine once and generates once untimed (compiles, warms up). The
controller then asks them in turn, A B B A ..., for one generation of each cache per round: ``--batch`` prompts of
``--prompt`` tokens (held-out Shakespeare), ``--new`` tokens each, greedy; an answer is that generation's decode
seconds (the engine's ``stats["decode_s"]``: its decode forwards only). Printed per cache: the median over rounds of
this checkout's decode time / the baseline's, its 10th-90th percentile, the baseline's median milliseconds per step,
and whether the median is within ``--tolerance`` (default 5 %). Both workers run one at a time with the same
threads.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHES = {"full": ("base", "full"), "gqa": ("gqa2", "full"), "dmc": ("pool2", "dmc"), "h2o": ("base", "h2o"),
          "tova": ("base", "tova"), "lsh_e": ("base", "lsh_e"), "lightcache": ("base", "lightcache")}
# LightCache compresses every token past its 4 + 32 full-width ones (from the 37th on), so that the step runs its
# compression and selection
LIGHTCACHE = {"local": 32, "top_k": 2, "segment": 8}
OUT = os.path.join(ROOT, "runs", "bench", "ab")


def run(command: list[str], root: str) -> None:
    """``command`` with the checkout at ``root`` first on the path, in this checkout (its data)."""
    env = {**os.environ, "PYTHONPATH": root}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"error: {' '.join(command)} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")


def make_models(root: str) -> dict[str, str]:
    """The three checkpoints (module docstring), made once by the baseline's trainer (``root``): a checkpoint
    written by older code is one every later revision reads."""
    out = os.path.join(OUT, f"models-{os.path.basename(root)}")
    models = {name: os.path.join(out, name) for name in ("base", "gqa2", "pool2")}
    common = ["train.max_steps=1", "optim.warmup_steps=0", "train.eval_interval=0", "checkpoint.save_interval=1"]
    pretrain = os.path.join(root, "launch", "pretrain.py")
    convert = os.path.join(root, "checkpoints_tools", "convert_gqa.py")
    if not os.path.exists(os.path.join(models["base"], "checkpoints", "latest")):
        run([sys.executable, pretrain, "+recipe=base_tiny", f"run_dir={models['base']}", *common], root)
    if not os.path.exists(os.path.join(models["gqa2"], "meta.json")):
        run([sys.executable, convert, "--input", models["base"], "--output", models["gqa2"], "--groups", "4"], root)
    if not os.path.exists(os.path.join(models["pool2"], "checkpoints", "latest")):
        # fixed pooling's factor is method.pool; revisions before it was split from DMC's settings: method.target_cr
        with open(os.path.join(root, "dmc_train", "methods", "configs.py")) as f:
            factor = "method.pool=2" if "    pool: int" in f.read() else "method.target_cr=2"
        run([sys.executable, pretrain, "+recipe=dmc_tiny", "method=fixed_pooling", factor,
             f"checkpoint.init_from={models['base']}", "method.zero_out_steps=0", "method.ramp_steps=0",
             "method.finetune_steps=1", f"run_dir={models['pool2']}", *common], root)
    return models


def checkout(revision: str) -> str:
    """The baseline's worktree (made once per commit)."""
    commit = subprocess.run(["git", "rev-parse", "--short", revision], cwd=ROOT, capture_output=True,
                            text=True)
    if commit.returncode:
        raise SystemExit(f"error: {revision!r} is not a revision of this repository: {commit.stderr.strip()}")
    path = os.path.join(OUT, commit.stdout.strip())
    if not os.path.exists(path):
        run(["git", "worktree", "add", "--detach", path, commit.stdout.strip()], ROOT)
    return path


def worker(root: str, spec: dict) -> None:
    """Build the engines of ``spec`` with the checkout at ``root``, then answer ``<cache>`` lines on stdin with the
    decode seconds of one generation (module docstring). The worker was started with ``root`` first on
    ``PYTHONPATH``, so its imports are that checkout's (checked by the controller)."""
    import torch

    from dmc_train.inference.engine import Engine
    from dmc_train.inference.sampling import SamplingParams

    torch.set_num_threads(spec["threads"])
    params = SamplingParams(max_new_tokens=spec["new"])
    engines = {}
    for name in spec["caches"]:
        model, cache = CACHES[name]
        options = {"full": {}, "dmc": {}, "lightcache": LIGHTCACHE}.get(cache, {"budget": spec["budget"]})
        engines[name] = Engine.from_checkpoint(spec["models"][model], cache=cache, max_batch=spec["batch"],
                                               **options)
        engines[name].generate(spec["prompts"], params)  # warm-up: compiled kernels, packed weights
    print(json.dumps({"ready": os.path.dirname(os.path.dirname(sys.modules[Engine.__module__].__file__))}),
          flush=True)
    for line in sys.stdin:
        engine = engines[line.strip()]
        before = engine.stats["decode_s"]
        engine.generate(spec["prompts"], params)
        print(json.dumps({"decode_s": engine.stats["decode_s"] - before}), flush=True)


def held_out_prompts(n: int, length: int) -> list[list[int]]:
    """``n`` prompts of ``length`` token ids from the held-out plays, in base_tiny's tokenizer (imported here: a
    worker must import its own checkout's ``dmc_train``, which ``inference.py`` would import first)."""
    from inference import prompts  # benchmarks/inference.py (this script's directory is on sys.path)

    from dmc_train.data.tokenizer import load_tokenizer
    from dmc_train.recipes import load_config

    return prompts(load_tokenizer(load_config(["+recipe=base_tiny"]).data.tokenizer), n, length)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", help="the revision to compare with (a commit, tag or branch)")
    p.add_argument("--caches", nargs="+", default=list(CACHES), choices=list(CACHES))
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--budget", type=int, default=32, help="entries per KV head of the eviction policies")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tolerance", type=float, default=0.05)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, json.loads(sys.stdin.readline()))
        return
    if not args.baseline:
        raise SystemExit("error: give --baseline <revision> (the code to compare this checkout with)")
    roots = {"this": ROOT, "baseline": checkout(args.baseline)}
    spec = {"models": make_models(roots["baseline"]), "caches": args.caches, "batch": args.batch, "new": args.new,
            "budget": args.budget, "threads": args.threads, "prompts": held_out_prompts(args.batch, args.prompt)}
    workers = {}
    for side, root in roots.items():
        w = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", root], cwd=ROOT, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             env={**os.environ, "PYTHONPATH": root, "PYTHONWARNINGS": "ignore"})  # warnings: megatron's
        w.stdin.write(json.dumps(spec) + "\n")
        w.stdin.flush()
        workers[side] = w
    for side, w in workers.items():  # one at a time: the other builds meanwhile, timing starts after both
        line = w.stdout.readline()
        if not line:
            raise SystemExit(f"error: the {side} worker ({roots[side]}) failed while building its engines")
        loaded = json.loads(line)["ready"]
        if os.path.realpath(loaded) != os.path.realpath(os.path.join(roots[side], "dmc_train")):
            raise SystemExit(f"error: the {side} worker imported dmc_train from {loaded}, not from {roots[side]}")
    print(f"this checkout ({ROOT}) vs {args.baseline} ({roots['baseline']}); {args.rounds} rounds, batch "
          f"{args.batch}, prompts of {args.prompt} tokens, {args.new} new, {args.threads} threads", flush=True)
    seconds = {side: {c: [] for c in args.caches} for side in workers}
    for r in range(args.rounds):
        order = ["this", "baseline"] if r % 2 == 0 else ["baseline", "this"]
        for cache in args.caches:
            for side in order:
                workers[side].stdin.write(cache + "\n")
                workers[side].stdin.flush()
                seconds[side][cache].append(json.loads(workers[side].stdout.readline())["decode_s"])
        if (r + 1) % 10 == 0:
            print(f"round {r + 1}/{args.rounds}", flush=True)
    for w in workers.values():
        w.stdin.close()
        w.wait()
    print(f"\ncache | decode time this / baseline, median [p10-p90] | baseline ms/step | within "
          f"{args.tolerance:.0%}")
    for cache in args.caches:
        ratios = sorted(a / b for a, b in zip(seconds["this"][cache], seconds["baseline"][cache]))
        median = statistics.median(ratios)
        p10, p90 = ratios[len(ratios) // 10], ratios[-1 - len(ratios) // 10]
        step_ms = 1e3 * statistics.median(seconds["baseline"][cache]) / args.new
        verdict = "met" if median <= 1 + args.tolerance else "NOT met"
        print(f"{cache:6s} | {median:.3f} [{p10:.3f}-{p90:.3f}] | {step_ms:.2f} | {verdict}")


if __name__ == "__main__":
    main()
