"""GPU training cost of every method against vanilla, and DMC's kernels alone, measured in one run on one GPU.

    python benchmarks/gpu_train.py [--layers 2] [--seq 4096] [--steps 3] [--lengths 4096 8192] [--out DIR]

1. **Training steps.** Full optimizer steps (forward, backward, Adam; bf16; one sequence of ``--seq``
   tokens) of a Llama-2-7B-shaped model with ``--layers`` layers (hidden 4096, 32 heads of 128, FFN
   11008, vocabulary 32000) for vanilla attention, DMC with exact and with window accumulation, fixed
   pooling (4x) and LESS (H2O at a quarter of the sequence), each in a fresh process (``--worker``): median
   step time after a warm-up step, and the peak GPU memory of a step (``torch.cuda.max_memory_allocated``).
   Goals: DMC step <= 1.15x vanilla, peak memory <= 1.1x.
2. **DMC attention alone**, forward + backward at ``[1, 32, n, 128]`` bf16 (MHA and GQA 4, n in
   ``--lengths``) for each implementation (``fused/cudnn``: cuDNN's kernels under the bias channel, the
   element-wise stages compiled, as ``dmc_attention`` runs on Hopper; the same with eager stages; ``fused/flash``:
   FlashAttention-2's kernels; ``flex``: FlexAttention with the bias as a ``score_mod``),
   against ``F.scaled_dot_product_attention(is_causal=True)``, and each one's error against the dense float64
   reference (forward and the gradients of q, k~, v~ and alpha) at a small size. Goal: <= 1.25x SDPA.
3. **Partial accumulation alone** (exact and window, forward and backward) at ``[1, 32, n, 128]`` bf16: GB/s
   of the bytes it must move, against the device-to-device copy bandwidth measured here and against the
   PyTorch scan. Goals: >= 50 % of the copy bandwidth, never slower than PyTorch.

Prints the tables and the goals met / NOT met last; writes ``gpu_train.json`` and ``gpu_train.png`` to
``--out`` (default ``runs/gpu_train``). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from inference import copy_bandwidth  # benchmarks/inference.py (this script's directory is on sys.path)

METHODS = {
    "vanilla": ["method=none"],
    "dmc_exact": ["method=dmc", "method.target_cr=4", "method.accumulation=exact"],
    "dmc_window": ["method=dmc", "method.target_cr=4", "method.accumulation=window"],
    "fixed_pooling": ["method=fixed_pooling", "method.pool=4"],
    "less": ["method=less", "method.policy=h2o", "method.budget=0.25"],
}


# ---------------------------------------------------------------------------------------------
# 1. training steps, one method per process
# ---------------------------------------------------------------------------------------------


def worker(method: str, layers: int, seq: int, steps: int) -> dict:
    from dmc_train.recipes import load_config
    from dmc_train.training.loop import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config([
            "+recipe=tiny_pretrain", "model=llama2_7b", f"model.num_layers={layers}",
            f"model.max_position_embeddings={seq}", f"train.seq_length={seq}", "train.micro_batch_size=1",
            "train.global_batch_size=1", "train.max_steps=100", "train.precision=bf16", "logging.progress=false",
            "data.kind=synthetic", "data.tokenizer=null", f"run_dir={tmp}/run", "checkpoint.resume=none",
            *METHODS[method]])
        trainer = Trainer(cfg)
        trainer.train_step()  # warm-up: kernels compiled, allocator settled
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            metrics = trainer.train_step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return {"seconds": statistics.median(times), "peak_bytes": torch.cuda.max_memory_allocated(),
                "loss": metrics["lm_loss"]}


def training_steps(args) -> dict:
    results = {}
    for method in METHODS:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", method, "--layers", str(args.layers),
               "--seq", str(args.seq), "--steps", str(args.steps)]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            results[method] = {"error": f"no result within {args.timeout} s"}
            print(f"  {method:14s} FAILED: {results[method]['error']}", flush=True)
            continue
        if proc.returncode != 0:
            results[method] = {"error": (proc.stderr.strip().splitlines() or ["?"])[-1][:300]}
            print(f"  {method:14s} FAILED: {results[method]['error']}\n{proc.stderr[-4000:]}", flush=True)
            continue
        results[method] = json.loads(proc.stdout.strip().splitlines()[-1])
        r = results[method]
        print(f"  {method:14s} step {r['seconds'] * 1e3:8.1f} ms  peak {r['peak_bytes'] / 2**30:6.2f} GiB  "
              f"loss {r['loss']:.3f}  ({time.perf_counter() - t0:.0f} s with start-up)", flush=True)
    return results


# ---------------------------------------------------------------------------------------------
# 2. DMC attention alone
# ---------------------------------------------------------------------------------------------


def _bench(fn) -> float:
    """Median milliseconds of ``fn()`` (CUDA events, triton's do_bench)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def _flex_attention():
    """DMC attention by FlexAttention: the per-key bias added by a ``score_mod`` (gradients reach alpha
    through the captured bias tensor)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention)
    masks = {}

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def attend(q, k, v, alpha, scale, free_channel):
        n, group = q.shape[2], q.shape[1] // k.shape[1]
        if n not in masks:
            masks[n] = create_block_mask(causal, None, None, n, n, device=q.device)
        bias = torch.nn.functional.pad(torch.log1p(-alpha[..., 1:].float()), (0, 1))  # key j: log(1 - alpha_{j+1})
        keep = torch.ones(q.shape[-1], dtype=q.dtype, device=q.device)
        keep[free_channel] = 0

        def score_mod(score, b, h, q_idx, kv_idx):
            return torch.where(kv_idx < q_idx, score + bias[b, h // group, kv_idx], score)

        return compiled(q * keep, k * keep, v, score_mod=score_mod, block_mask=masks[n], scale=scale,
                        enable_gqa=group > 1)

    return attend


def attention_candidates() -> dict:
    from kernels.dmc.attention_fused import CUDA_CUDNN, CUDA_FLASH, FusedDMCAttention

    def fused_with(ops):
        return lambda q, k, v, a, s, c: FusedDMCAttention.apply(q, k, v, a, s, c, ops)

    return {
        "fused/cudnn": fused_with(CUDA_CUDNN),  # dmc_attention's choice on Hopper
        "fused/cudnn, eager stages": fused_with(dataclasses.replace(CUDA_CUDNN, compiled=False)),
        "fused/flash": fused_with(CUDA_FLASH),
        "flex": _flex_attention(),
    }


def _attention_inputs(hq, hk, n, d, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, hq, n, d, device="cuda", generator=gen).to(dtype)
    k = torch.randn(1, hk, n, d, device="cuda", generator=gen).to(dtype)
    v = torch.randn(1, hk, n, d, device="cuda", generator=gen).to(dtype)
    alpha = torch.rand(1, hk, n, device="cuda", generator=gen) * 0.98
    return [t.requires_grad_() for t in (q, k, v, alpha)]


def attention_errors(candidates: dict) -> dict:
    """``|| x - ref || / || ref ||`` of out, dq, dk, dv, dalpha for bf16 inputs vs the dense float64 reference."""
    from kernels.dmc import dense_dmc_attention

    q, k, v, alpha = _attention_inputs(8, 2, 300, 128, torch.bfloat16, seed=1)
    c, scale = 127, 128 ** -0.5
    up = torch.randn(1, 8, 300, 128, device="cuda", dtype=torch.float64)

    def run(fn, inputs):
        out = fn(*inputs[:4], scale, c)
        grads = torch.autograd.grad((out.double() * up).sum(), inputs)
        return [out, *grads]

    keep = torch.ones(128, dtype=torch.float64, device="cuda")
    keep[c] = 0  # the free channel takes no part in attention
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v, alpha)]
    ref = run(lambda q_, k_, v_, a_, s, ch: dense_dmc_attention(q_ * keep, k_ * keep, v_, a_, s), ref_in)
    errors = {}
    for name, fn in candidates.items():
        try:
            got = run(fn, [q, k, v, alpha])
            errors[name] = [((g.double() - r).norm() / r.norm()).item() for g, r in zip(got, ref)]
        except Exception as e:  # a candidate that does not run here is reported, not fatal
            errors[name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        print(f"  error vs float64 {name:12s} {errors[name]}", flush=True)
    return errors


def attention_times(candidates: dict, lengths: list[int]) -> list[dict]:
    import torch.nn.functional as F

    rows = []
    for n in lengths:
        for hk in (32, 8):
            q, k, v, alpha = _attention_inputs(32, hk, n, 128, torch.bfloat16)
            grad = torch.randn_like(q)
            flops = 4 * 32 * n * n * 128 / 2 * 3.5  # causal forward (2 products) + backward (2.5x forward)

            def sdpa():
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hk != 32)
                out.backward(grad)

            row = {"n": n, "G": 32 // hk, "sdpa_ms": _bench(sdpa)}
            for name, fn in candidates.items():
                if name == "flex" and n != lengths[0]:  # each length compiles anew; one is enough to compare
                    row[name] = None
                    continue

                def step(fn=fn):
                    fn(q, k, v, alpha, 128 ** -0.5, 127).backward(grad)

                try:
                    row[name] = _bench(step)
                except Exception as e:
                    row[name] = None
                    print(f"  {name} at n={n} G={32 // hk} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                for t in (q, k, v, alpha):
                    t.grad = None
            cells = "  ".join(f"{name} {row[name]:.2f} ms ({row[name] / row['sdpa_ms']:.2f}x)"
                              if row[name] is not None else f"{name} -" for name in candidates)
            print(f"  n={n} G={row['G']}: SDPA {row['sdpa_ms']:.2f} ms ({flops / row['sdpa_ms'] / 1e9:.0f} TFLOP/s)  "
                  f"{cells}", flush=True)
            rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------
# 3. partial accumulation alone
# ---------------------------------------------------------------------------------------------


def accumulation_times(lengths: list[int]) -> list[dict]:
    from kernels.dmc import partial_accumulation
    from kernels.dmc.accumulation import partial_accumulation_torch

    rows = []
    for n in lengths:
        h, d = 32, 128
        gen = torch.Generator(device="cuda").manual_seed(0)
        k, v = (torch.randn(1, h, n, d, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
        alpha = torch.rand(1, h, n, device="cuda", generator=gen)
        omega = torch.rand(1, h, n, device="cuda", generator=gen) + 0.1
        inputs = [t.requires_grad_() for t in (k, v, alpha, omega)]
        big, small = 2 * h * n * d, h * n * 4  # bytes of one [1, h, n, d] bf16 tensor, one [1, h, n] fp32 one
        fwd_bytes = 2 * big + 2 * small + 2 * big + small  # read k, v, alpha, omega; write k~, v~, z
        bwd_bytes = 6 * big + 3 * small + 2 * big + 2 * small  # read dk~, dv~, k, v, k~, v~, alpha, omega, z; write 4
        for mode in ("exact", "window"):
            row = {"n": n, "mode": mode}
            for name, fn in (("triton", partial_accumulation), ("torch", partial_accumulation_torch)):
                args = (mode, 12, 32) if name == "torch" else (mode,)

                def fwd(fn=fn, args=args):
                    with torch.no_grad():
                        fn(*inputs, *args)

                out = fn(*inputs, *args)
                ups = [torch.randn_like(o) for o in out]
                fwd_ms = _bench(fwd)

                def fwd_bwd(fn=fn, args=args):
                    torch.autograd.backward(fn(*inputs, *args), ups)

                bwd_ms = max(_bench(fwd_bwd) - fwd_ms, 1e-6)
                row[name] = {"fwd_ms": fwd_ms, "bwd_ms": bwd_ms, "fwd_gbs": fwd_bytes / fwd_ms / 1e6,
                             "bwd_gbs": bwd_bytes / bwd_ms / 1e6}
                for t in inputs:
                    t.grad = None
            t_, p_ = row["triton"], row["torch"]
            print(f"  n={n} {mode:6s}: triton fwd {t_['fwd_ms']:.3f} ms ({t_['fwd_gbs']:.0f} GB/s) bwd "
                  f"{t_['bwd_ms']:.3f} ms ({t_['bwd_gbs']:.0f} GB/s) | torch fwd {p_['fwd_ms']:.3f} ms bwd "
                  f"{p_['bwd_ms']:.3f} ms", flush=True)
            rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------


def report(results: dict) -> list[str]:
    """The goals, one line each: met / NOT met with the numbers."""
    lines = []
    steps = results.get("steps", {})
    base = steps.get("vanilla", {})
    for method in ("dmc_exact", "dmc_window", "fixed_pooling", "less"):
        r = steps.get(method, {})
        if "seconds" not in r or "seconds" not in base:
            lines.append(f"{method}: no measurement ({r.get('error') or base.get('error') or 'not run'})")
            continue
        t, m = r["seconds"] / base["seconds"], r["peak_bytes"] / base["peak_bytes"]
        if method.startswith("dmc"):
            lines.append(f"{method} step {t:.2f}x vanilla (goal <= 1.15): {'met' if t <= 1.15 else 'NOT met'}; "
                         f"peak memory {m:.2f}x (goal <= 1.1): {'met' if m <= 1.1 else 'NOT met'}")
        else:
            lines.append(f"{method} step {t:.2f}x vanilla, peak memory {m:.2f}x (no goal)")
    for row in results.get("attention", []):
        best = min(((row[k], k) for k in row if k not in ("n", "G", "sdpa_ms") and row[k] is not None),
                   default=(None, None))
        if best[0] is None:
            continue
        ratio = best[0] / row["sdpa_ms"]
        lines.append(f"attention n={row['n']} G={row['G']}: fastest {best[1]} {ratio:.2f}x SDPA (goal <= 1.25): "
                     f"{'met' if ratio <= 1.25 else 'NOT met'}")
    copy = results.get("copy_bytes_per_s")
    for row in results.get("accumulation", []):
        t_, p_ = row["triton"], row["torch"]
        share = min(t_["fwd_gbs"], t_["bwd_gbs"]) * 1e9 / copy
        faster = t_["fwd_ms"] <= p_["fwd_ms"] and t_["bwd_ms"] <= p_["bwd_ms"]
        lines.append(f"accumulation {row['mode']} n={row['n']}: {share:.0%} of copy bandwidth (goal >= 50 %): "
                     f"{'met' if share >= 0.5 else 'NOT met'}; vs PyTorch fwd {p_['fwd_ms'] / t_['fwd_ms']:.2f}x "
                     f"bwd {p_['bwd_ms'] / t_['bwd_ms']:.2f}x faster (goal >= 1): {'met' if faster else 'NOT met'}")
    return lines


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    steps = results.get("steps", {})
    base = steps.get("vanilla", {})
    names = [m for m in METHODS if "seconds" in steps.get(m, {})]
    if "seconds" in base:
        x = range(len(names))
        axes[0].bar([i - 0.2 for i in x], [steps[m]["seconds"] / base["seconds"] for m in names], 0.4,
                    label="step time")
        axes[0].bar([i + 0.2 for i in x], [steps[m]["peak_bytes"] / base["peak_bytes"] for m in names], 0.4,
                    label="peak memory")
        axes[0].set_xticks(list(x), names, rotation=20)
        axes[0].axhline(1.15, color="gray", lw=0.8, ls="--")
        axes[0].set_ylabel("x vanilla")
        axes[0].legend()
    rows = results.get("attention", [])
    labels = [f"n={r['n']}\nG={r['G']}" for r in rows]
    cands = [k for k in (rows[0] if rows else {}) if k not in ("n", "G", "sdpa_ms")]
    for i, name in enumerate(cands):
        axes[1].bar([j + (i - len(cands) / 2) * 0.8 / len(cands) for j in range(len(rows))],
                    [(r[name] or 0) / r["sdpa_ms"] for r in rows], 0.8 / len(cands), label=name)
    axes[1].set_xticks(range(len(rows)), labels)
    axes[1].axhline(1.25, color="gray", lw=0.8, ls="--")
    axes[1].set_ylabel("DMC attention fwd+bwd / SDPA")
    axes[1].set_yscale("log")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"DMC training on {results.get('device', 'GPU')} (bf16; one run)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--parts", nargs="+", default=["steps", "attention", "accumulation"],
                        choices=["steps", "attention", "accumulation"])
    parser.add_argument("--out", default="runs/gpu_train")
    parser.add_argument("--timeout", type=int, default=180, help="seconds for one method's process")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: benchmarks/gpu_train.py needs a CUDA GPU; none is visible to torch")
    if args.worker:
        print(json.dumps(worker(args.worker, args.layers, args.seq, args.steps)))
        return
    os.makedirs(args.out, exist_ok=True)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args)}
    print(f"device: {results['device']}, torch {torch.__version__}", flush=True)
    if "attention" in args.parts:
        print("DMC attention, forward + backward, [1, 32, n, 128] bf16:", flush=True)
        candidates = attention_candidates()
        results["attention_errors"] = attention_errors(candidates)
        results["attention"] = attention_times(candidates, args.lengths)
    if "accumulation" in args.parts:
        results["copy_bytes_per_s"] = copy_bandwidth(1024, 5, "cuda")  # 1 GiB, device to device
        print(f"partial accumulation, [1, 32, n, 128] bf16 (copy bandwidth {results['copy_bytes_per_s'] / 1e9:.0f} "
              f"GB/s):", flush=True)
        results["accumulation"] = accumulation_times(args.lengths)
    if "steps" in args.parts:
        print(f"training steps ({args.layers} Llama-2-7B layers, seq {args.seq}, bf16):", flush=True)
        results["steps"] = training_steps(args)
    with open(os.path.join(args.out, "gpu_train.json"), "w") as f:
        json.dump(results, f, indent=1)
    try:
        plot(results, os.path.join(args.out, "gpu_train.png"))
    except Exception as e:  # the numbers matter more than the figure
        print(f"plot failed: {e}")
    print(f"\ngoals ({results['device']}):")
    for line in report(results):
        print("  " + line)


if __name__ == "__main__":
    main()
