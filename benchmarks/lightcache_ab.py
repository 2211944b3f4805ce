"""LightCache's parallel form (teacher-forced attention over whole sequences) in this checkout against another
revision of the project: one layer of a real model's shape at long contexts, time and output.

    python benchmarks/lightcache_ab.py --baseline 4c5e2db             # SmolLM2-135M's layer, 6,144 and 16,384 tokens

The layer is SmolLM2-135M's (9 query / 3 KV heads of 64, hidden 576, RoPE theta 100,000) with random weights and
random q, k, v (seeded: both revisions get the same), and LightCache at ``benchmarks/lightcache.py``'s defaults for a
model trained on 8,192 tokens (global 4, local 4,096, top_k 8 x segment 256, r_k 4, r_v 32): past 4,100 tokens every
query selects. Each revision runs in its own process (``--worker``, its checkout first on ``PYTHONPATH``; the
baseline checked out once into ``runs/bench/ab/<commit>`` as ``decode_ab.py`` does) and times one
``LightCache.parallel_attention`` call per length; the two alternate, A B B A ..., for ``--rounds`` rounds. Printed
per length: the median seconds of each, their ratio (this / baseline), and the largest difference between their
outputs.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from decode_ab import ROOT, checkout  # benchmarks/decode_ab.py (this script's directory is on sys.path)

OPTIONS = {"global": 4, "local": 4096, "top_k": 8, "segment": 256, "r_k": 4, "r_v": 32, "chunk": 8192}
HEADS, KV_HEADS, HEAD_DIM, HIDDEN, THETA = 9, 3, 64, 576, 100000.0


def worker(length: int, threads: int, out: str) -> None:
    """Time one parallel-form call at ``length`` tokens with the checkout first on the path; print its seconds,
    save its output to ``out``."""
    import functools

    import torch

    from dmc_train.models.rope import rope, rope_inv_freq
    from dmc_train.policies.lightcache import LightCache

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    w_k, w_v = (torch.randn(KV_HEADS * HEAD_DIM, HIDDEN, generator=g) for _ in range(2))
    lightcache = LightCache.from_weights(OPTIONS, [w_k], [w_v], KV_HEADS, 8192, HEAD_DIM ** -0.5, torch.float32)

    class Info:  # what the parallel form reads of the model: its RoPE
        rotate = staticmethod(functools.partial(rope, inv_freq=rope_inv_freq(HEAD_DIM, THETA)))

    q, k, v = (torch.randn(1, h, length, HEAD_DIM, generator=g) for h in (HEADS, KV_HEADS, KV_HEADS))
    start = time.perf_counter()
    result = lightcache.parallel_attention(0, q, k, v, Info)
    seconds = time.perf_counter() - start
    torch.save(result, out)
    print(json.dumps({"seconds": seconds, "module": sys.modules[LightCache.__module__].__file__}))


def timed(root: str, length: int, threads: int, out: str) -> float:
    """One worker run of the checkout at ``root``; checks that it imported that checkout's code."""
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", str(length), "--threads",
                           str(threads), "--out", out], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": root, "PYTHONWARNINGS": "ignore"})
    if done.returncode:
        raise SystemExit(f"error: the worker for {root} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    if not os.path.realpath(answer["module"]).startswith(os.path.realpath(root) + os.sep):
        raise SystemExit(f"error: the worker for {root} imported {answer['module']}")
    return answer["seconds"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", help="the revision to compare with (a commit, tag or branch)")
    p.add_argument("--lengths", type=int, nargs="+", default=[6144, 16384])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.threads, args.out)
        return
    if not args.baseline:
        raise SystemExit("error: give --baseline <revision> (the code to compare this checkout with)")
    import torch

    roots = {"this": ROOT, "baseline": checkout(args.baseline)}
    outs = {side: os.path.join(ROOT, "runs", "bench", "ab", f"lightcache_{side}.pt") for side in roots}
    print(f"this checkout vs {args.baseline} ({roots['baseline']}); SmolLM2-135M's layer, LightCache {OPTIONS}, "
          f"{args.rounds} rounds, {args.threads} threads", flush=True)
    print("tokens | this s | baseline s | this / baseline | max |output difference|")
    for length in args.lengths:
        seconds = {side: [] for side in roots}
        for r in range(args.rounds):
            for side in (["this", "baseline"] if r % 2 == 0 else ["baseline", "this"]):
                seconds[side].append(timed(roots[side], length, args.threads, outs[side]))
        this, base = (statistics.median(seconds[side]) for side in ("this", "baseline"))
        diff = float((torch.load(outs["this"]) - torch.load(outs["baseline"])).abs().max())
        print(f"{length} | {this:.2f} | {base:.2f} | {this / base:.3f} | {diff:.1e}", flush=True)


if __name__ == "__main__":
    main()
