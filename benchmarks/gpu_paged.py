"""Paged decode attention on one GPU: the Triton kernel against the device's copy bandwidth and against SDPA over a
dense cache of the same entries, and what the eviction policies' scores add.

    python benchmarks/gpu_paged.py                       # page size 16, G 1/4/8, head size 64/128
    python benchmarks/gpu_paged.py --batch 16 --tokens 2048 --out runs/gpu_paged

Per case (``--page-size``, G query heads per KV head, head size d; ``--batch`` sequences x ``--kv-heads`` KV heads =
R rows, bf16):

- **equal rows** of ``--tokens`` entries each, pages in shuffled order: the kernel as the engine calls it
  (``paged_attention_triton`` with the step's longest row known, the planned path), its bytes read (every
  entry's key and value once, plus q and the output) over its median time as a share of the copy bandwidth
  (``dst.copy_(src)`` of 1 GiB, 2 x bytes / time), and ``F.scaled_dot_product_attention`` of the same queries over
  the same entries in a dense contiguous ``[batch, kv_heads, tokens, d]`` cache (``enable_gqa``);
- **ragged rows** (lengths uniform in ``[tokens / 8, tokens]``, as a DMC model's heads differ): the share of the
  copy bandwidth;
- **scores**: the same equal rows with ``scores="probs"`` (H2O, TOVA) and ``"logits"`` against the plain call.

Times are medians of CUDA-event timings (``triton.testing.do_bench``). Prints the table and the goals met / NOT met
(issue "GPU decode at the paper's speed": >= 80 % of the copy bandwidth at page size 16, within 1.15x of SDPA,
scores <= 1.1x the plain attention); writes ``gpu_paged.json`` and ``gpu_paged.png`` to ``--out`` (default
``runs/gpu_paged``). Needs a CUDA GPU (``--device cpu`` runs the kernels under Triton's interpreter at a tiny size:
a check that the script works, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

CASES = [(g, d) for d in (64, 128) for g in (1, 4, 8)]  # (G, head size)


def paged_rows(lens: list[int], page_size: int, d: int, dtype, device, seed: int = 0):
    """``(k_pages, v_pages, block_table, seq_lens)`` of rows holding ``lens`` entries, their pages in shuffled
    order (as a pool hands them out over time), random values."""
    import torch

    g = torch.Generator().manual_seed(seed)
    per_row = [-(-n // page_size) for n in lens]
    order = torch.randperm(sum(per_row), generator=g)
    table = torch.full((len(lens), max(per_row)), -1, dtype=torch.int32)
    start = 0
    for r, n in enumerate(per_row):
        table[r, :n] = order[start: start + n]
        start += n
    k = torch.randn(sum(per_row), page_size, d, dtype=dtype, device=device)
    v = torch.randn(sum(per_row), page_size, d, dtype=dtype, device=device)
    return k, v, table.to(device), torch.tensor(lens, dtype=torch.int32, device=device)


def dense_of(k_pages, v_pages, table, lens: list[int], batch: int):
    """The rows' entries in a dense ``[batch, kv_heads, tokens, d]`` cache (equal rows only)."""
    page = k_pages.shape[1]
    n = lens[0]
    pages = table[:, : -(-n // page)].long()
    k = k_pages[pages].flatten(1, 2)[:, :n]
    v = v_pages[pages].flatten(1, 2)[:, :n]
    return (x.view(batch, -1, n, x.shape[-1]).contiguous() for x in (k, v))


def timer(device):
    """``ms(fn)``: median milliseconds of ``fn()``: CUDA events on a GPU; wall time of a few calls on CPU."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median")

    def wall(fn):
        fn()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return 1e3 * sorted(times)[1]

    return wall


def paged_call(q, pages, scale: float, scores=None):
    """The kernel as a decode step's plan calls it: ``pages`` from :func:`paged_rows`, the longest row given as the
    bound on the rows (the scores' width)."""
    from kernels.paged.triton_kernels import paged_attention_triton

    k, v, table, lens = pages
    longest = int(lens.max())
    return lambda: paged_attention_triton(q, k, v, table, lens, scale, scores, max_len=longest)


def measure_case(args, G: int, d: int, device, dtype, bandwidth: float) -> dict:
    """One (G, head size) case (module docstring)."""
    import torch
    import torch.nn.functional as F

    ms, scale, rows = timer(device), d ** -0.5, args.batch * args.kv_heads
    q = torch.randn(rows, G, d, dtype=dtype, device=device)
    equal = paged_rows([args.tokens] * rows, args.page_size, d, dtype, device)
    t = {kind or "plain": ms(paged_call(q, equal, scale, kind)) for kind in (None, "probs", "logits")}
    kd, vd = dense_of(*equal[:3], [args.tokens] * rows, args.batch)
    qd = q.view(args.batch, args.kv_heads * G, 1, d)

    def sdpa():
        return F.scaled_dot_product_attention(qd, kd, vd, scale=scale, enable_gqa=G > 1)

    t["sdpa"] = ms(sdpa)
    error = float((paged_call(q, equal, scale)().float().flatten() - sdpa().float().flatten()).abs().max())
    ragged = torch.randint(max(1, args.tokens // 8), args.tokens + 1, (rows,),
                           generator=torch.Generator().manual_seed(1)).tolist()
    t["ragged"] = ms(paged_call(q, paged_rows(ragged, args.page_size, d, dtype, device, seed=2), scale))
    size = torch.finfo(dtype).bits // 8

    def share(entries: int, millis: float) -> float:  # keys + values + q + output over the time, of the copy rate
        return (entries * 2 * d + 2 * rows * G * d) * size / (millis * 1e-3) / bandwidth

    row = {"G": G, "d": d, "rows": rows, "tokens": args.tokens, "paged_ms": t["plain"], "sdpa_ms": t["sdpa"],
           "probs_ms": t["probs"], "logits_ms": t["logits"], "ragged_ms": t["ragged"],
           "bandwidth_share": share(rows * args.tokens, t["plain"]), "ragged_share": share(sum(ragged), t["ragged"]),
           "max_error_vs_sdpa": error}
    print(f"G={G} d={d:>3}: paged {t['plain']:7.3f} ms ({row['bandwidth_share']:4.0%} of copy), SDPA dense "
          f"{t['sdpa']:7.3f} ms ({t['plain'] / t['sdpa']:.2f}x), ragged {row['ragged_share']:4.0%}, probs "
          f"{t['probs'] / t['plain']:.2f}x, logits {t['logits'] / t['plain']:.2f}x, max |paged - SDPA| {error:.1e}",
          flush=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def report(results: list[dict], page_size: int) -> list[str]:
    """The goals, one line each: met / NOT met with the numbers."""
    lines = []
    for r in results:
        case = f"page {page_size} G={r['G']} d={r['d']}"
        for rows, value in (("", r["bandwidth_share"]), (", ragged rows", r["ragged_share"])):
            lines.append(f"{case}{rows}: {value:.0%} of the copy bandwidth (goal >= 80 %): "
                         f"{'met' if value >= 0.8 else 'NOT met'}")
        ratio = r["paged_ms"] / r["sdpa_ms"]
        lines.append(f"{case}: {ratio:.2f}x SDPA over a dense cache (goal <= 1.15): "
                     f"{'met' if ratio <= 1.15 else 'NOT met'}")
        worst = max(r["probs_ms"], r["logits_ms"]) / r["paged_ms"]
        lines.append(f"{case}: scores {worst:.2f}x the plain attention (goal <= 1.1): "
                     f"{'met' if worst <= 1.1 else 'NOT met'}")
    return lines


def plot(results: list[dict], title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    labels = [f"G={r['G']}\nd={r['d']}" for r in results]
    x = range(len(results))
    axes[0].bar([i - 0.2 for i in x], [100 * r["bandwidth_share"] for r in results], 0.4, label="equal rows")
    axes[0].bar([i + 0.2 for i in x], [100 * r["ragged_share"] for r in results], 0.4, label="ragged rows")
    axes[0].axhline(80, color="gray", lw=0.8, ls="--")
    axes[0].set_ylabel("% of copy bandwidth")
    axes[0].set_xticks(list(x), labels)
    axes[0].legend(fontsize=8)
    for i, (key, name) in enumerate((("sdpa_ms", "paged / SDPA dense"), ("probs_ms", "probs / plain"),
                                     ("logits_ms", "logits / plain"))):
        values = [(r["paged_ms"] / r[key]) if key == "sdpa_ms" else r[key] / r["paged_ms"] for r in results]
        axes[1].bar([j + (i - 1) * 0.27 for j in x], values, 0.27, label=name)
    axes[1].axhline(1.15, color="gray", lw=0.8, ls="--")
    axes[1].set_ylabel("time ratio")
    axes[1].set_xticks(list(x), labels)
    axes[1].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--batch", type=int, help="default: 64 on a GPU, 2 on the CPU")
    parser.add_argument("--kv-heads", type=int, help="default: 8 on a GPU, 2 on the CPU")
    parser.add_argument("--tokens", type=int, help="default: 4096 on a GPU, 128 on the CPU")
    parser.add_argument("--out", default="runs/gpu_paged")
    args = parser.parse_args()
    sizes = {"batch": 64, "kv_heads": 8, "tokens": 4096} if args.device != "cpu" else \
        {"batch": 2, "kv_heads": 2, "tokens": 128}  # the CPU: a check of the script, not a measurement
    for option, size in sizes.items():
        setattr(args, option, getattr(args, option) or size)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton compiles anything
        args.dtype = "fp32"  # the interpreter's tl.dot on bf16 is not exact
    import torch

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("error: benchmarks/gpu_paged.py --device cuda needs a CUDA GPU; none is visible to torch "
                 "(--device cpu checks the script under Triton's interpreter)")
    from inference import copy_bandwidth  # benchmarks/inference.py (this script's directory is on sys.path)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    bandwidth = copy_bandwidth(1024 if device.type == "cuda" else 64, 5, device)
    print(f"device: {name}, torch {torch.__version__}; copy bandwidth {bandwidth / 1e9:.0f} GB/s; "
          f"{args.batch} x {args.kv_heads} rows of {args.tokens} entries, page size {args.page_size}, {args.dtype}",
          flush=True)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    results = [measure_case(args, G, d, device, dtype, bandwidth) for G, d in CASES]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_paged.json"), "w") as f:
        json.dump({"device": name, "torch": torch.__version__, "copy_bytes_per_s": bandwidth, "args": vars(args),
                   "cases": results}, f, indent=1)
    try:
        plot(results, f"paged decode attention on {name} ({args.dtype}, page size {args.page_size}; one run)",
             os.path.join(args.out, "gpu_paged.png"))
    except Exception as e:  # the numbers matter more than the figure
        print(f"plot failed: {e}")
    print(f"\ngoals ({name}):")
    for line in report(results, args.page_size):
        print("  " + line)
    print(f"wrote {args.out}/gpu_paged.json and gpu_paged.png")


if __name__ == "__main__":
    main()
