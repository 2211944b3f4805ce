"""The ops of kernels/ timed by implementation: Triton vs PyTorch (CUDA), and the CPU paths.

    python benchmarks/kernel_ops.py                  # on a CUDA machine: Triton, PyTorch, SDPA, flash-attn
    python benchmarks/kernel_ops.py --peak-gbps 3350 # H100 SXM: report bandwidth as a fraction of peak

On CUDA (bf16):
- DMC training attention (forward + backward) at 4K/8K/16K tokens, its fused kernels (there is no Triton DMC
  attention; ``benchmarks/gpu_train.py`` compares its implementations) vs ``scaled_dot_product_attention``
  (causal).
- Partial accumulation (exact and window 12), forward + backward: Triton vs PyTorch.
- Paged decode over per-(sequence, KV head) rows: Triton vs PyTorch vs flash-attn's
  ``flash_attn_with_kvcache`` (page size 256, when installed), with the achieved memory bandwidth
  (K/V bytes read per second) and its fraction of ``--peak-gbps``.
On CPU (what runs here): the PyTorch paths' cost, paged decode time growing with the tokens
held (not with the block table's width), and paged decode at equal KV bytes with G = 1, 2, 4 query heads
per KV row (GQA), with and without the eviction policies' scores; a Llama layer's dense ops
(kernels/layer) and the eviction policies' victim choice (kernels/eviction): compiled vs their tensor ops.

Every line is a ratio measured in this run; timings are medians of ``--repeats`` calls.
"""

import argparse
import statistics
import time

import torch

from kernels import backend
from kernels.dmc import dmc_attention, partial_accumulation
from kernels.eviction import victims
from kernels.eviction.reference import victims_torch
from kernels.layer import layer_output, rms_norm_matmul
from kernels.layer.reference import layer_output_torch, rms_norm_matmul_torch
from kernels.paged import paged_attention, paged_attention_planned, paged_decode_plan


def timed(fn, repeats: int, device: torch.device) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def with_backend(name: str, fn):
    def run():
        backend.set_backend(name)
        try:
            return fn()
        finally:
            backend.set_backend("auto")
    return run


def attention_case(n: int, device, dtype, heads=32, groups=8, d=128):
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, heads, n, d, device=device, dtype=dtype, generator=g, requires_grad=True)
    k = torch.randn(1, groups, n, d, device=device, dtype=dtype, generator=g, requires_grad=True)
    v = torch.randn(1, groups, n, d, device=device, dtype=dtype, generator=g, requires_grad=True)
    alpha = torch.rand(1, groups, n, device=device, generator=g).requires_grad_(True)
    return q, k, v, alpha


def fwd_bwd(fn):
    def run():
        out = fn()
        out.float().sum().backward()
    return run


def paged_case(rows: int, tokens: int, width: int, page: int, device, dtype, g_heads=4, d=128):
    pages = rows * (width // page)
    k_pages = torch.randn(pages, page, d, device=device, dtype=dtype)
    v_pages = torch.randn(pages, page, d, device=device, dtype=dtype)
    table = torch.randperm(pages, device=device).view(rows, width // page).int()
    lens = torch.full((rows,), tokens, device=device, dtype=torch.int32)
    q = torch.randn(rows, g_heads, d, device=device, dtype=dtype)
    return q, k_pages, v_pages, table, lens


def gqa_case(groups: int, rows: int = 32, d: int = 32, page: int = 16, lo: int = 200, hi: int = 500):
    """``rows`` KV rows holding ``lo``-``hi`` entries each (pages shuffled in a pool), ``groups`` query heads per row:
    the same KV bytes for every ``groups``. Returns the query and the arguments of paged_attention_planned."""
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(lo, hi + 1, (rows,), generator=g, dtype=torch.int32)
    width = -(-hi // page)
    k_pages, v_pages = torch.randn(rows * width, page, d, generator=g), torch.randn(rows * width, page, d, generator=g)
    table = torch.randperm(rows * width, generator=g).view(rows, width).int()
    plan = paged_decode_plan(table, lens, page, 2 * page * d * 4, torch.float32)
    return torch.randn(rows, groups, d, generator=g), k_pages, v_pages, plan


def gqa_report(repeats: int) -> None:
    """Paged decode with G query heads per KV row at equal KV bytes: at equal KV bytes a GQA-4x model runs 4x the
    batch of the base, so its attention has 4x the (query head, entry) pairs. Single calls, the G values
    interleaved, medians."""
    print("\npaged decode at equal KV bytes, G query heads per row (32 rows of 200-500 entries, d 32, page 16)")
    print("threads | scores | G=1 ms | G=2 ms | G=4 ms | G=2 / G=1 | G=4 / G=1")
    cases = {G: gqa_case(G) for G in (1, 2, 4)}
    threads_before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for scores in (None, "probs", "logits"):
                times = {G: [] for G in cases}
                for _ in range(20 * repeats):
                    for G, (q, kp, vp, plan) in cases.items():
                        t0 = time.perf_counter()
                        paged_attention_planned(q, kp, vp, plan, 32 ** -0.5, scores=scores)
                        times[G].append(time.perf_counter() - t0)
                ms = {G: statistics.median(t) * 1e3 for G, t in times.items()}
                print(f"{threads:7d} | {str(scores):6s} | {ms[1]:6.3f} | {ms[2]:6.3f} | {ms[4]:6.3f} | "
                      f"{ms[2] / ms[1]:9.2f} | {ms[4] / ms[1]:9.2f}")
    finally:
        torch.set_num_threads(threads_before)


def interleaved(fns: dict, repeats: int) -> dict:
    """Median seconds per call of each of ``fns`` (name -> callable), the calls interleaved."""
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def decode_ops_report(repeats: int) -> None:
    """A decode step's ops outside the attention, compiled (``kernels/layer``, ``kernels/eviction``) vs their tensor
    ops, at base_tiny's shapes (hidden 256, 8 + 8 + 8 heads of 32, ffn 688) and a 7B layer's (hidden 4096, 32 + 8
    + 8 heads of 128, ffn 11008), for a decode step's rows; RoPE on q and k in the first op."""
    print("\na layer's dense ops, compiled vs tensor ops (fp32, RoPE of q and k in the first): microseconds per call")
    print("shape | rows | rms_norm_matmul | tensor ops | ratio | layer_output | tensor ops | ratio")
    g = torch.Generator().manual_seed(0)
    for name, hidden, (h, kv), d, ffn in (("tiny", 256, (8, 8), 32, 688), ("7B", 4096, (32, 8), 128, 11008)):
        qkv = torch.randn(hidden, (h + 2 * kv) * d, generator=g) * 0.02
        o, norm = torch.randn(h * d, hidden, generator=g) * 0.02, 1 + 0.1 * torch.randn(hidden, generator=g)
        gate_up, down = torch.randn(hidden, 2 * ffn, generator=g) * 0.02, torch.randn(ffn, hidden, generator=g) * 0.02
        for rows in (1, 4, 16, 32):
            x, attn = torch.randn(rows, hidden, generator=g), torch.randn(rows, h * d, generator=g)
            angles = torch.rand(rows, d, generator=g)
            rope = (angles.cos(), angles.sin()[:, None])
            t = interleaved({
                "in": lambda: rms_norm_matmul(x, norm, 1e-5, qkv, rope, h + kv, d),
                "in_torch": lambda: rms_norm_matmul_torch(x, norm, 1e-5, qkv, rope, h + kv, d),
                "out": lambda: layer_output(x, attn, o, norm, 1e-5, gate_up, down),
                "out_torch": lambda: layer_output_torch(x, attn, o, norm, 1e-5, gate_up, down)},
                repeats * (40 if name == "tiny" else 4))
            us = {k: v * 1e6 for k, v in t.items()}
            print(f"{name:5s} | {rows:4d} | {us['in']:15.1f} | {us['in_torch']:10.1f} | "
                  f"{us['in'] / us['in_torch']:5.2f} | {us['out']:12.1f} | {us['out_torch']:10.1f} | "
                  f"{us['out'] / us['out_torch']:5.2f}")
    print("\nthe eviction policies' victim choice over every layer's rows: microseconds per call")
    print("layers x rows x budget | compiled | tensor ops | ratio")
    for lead, n, budget in ((4, 120, 64), (32, 256, 512)):
        priority = torch.rand(lead, n, budget, generator=g)
        positions = torch.stack([torch.randperm(4 * budget, generator=g)[:budget] for _ in range(lead * n)])
        positions = positions.view(lead, n, budget)
        newest = torch.full((n,), 4 * budget, dtype=torch.int64)
        t = interleaved({"c": lambda: victims(priority, positions, newest, 4, 16),
                         "torch": lambda: victims_torch(priority, positions, newest, 4, 16)}, repeats * 20)
        print(f"{lead:6d} x {n:4d} x {budget:4d} | {t['c'] * 1e6:8.1f} | {t['torch'] * 1e6:10.1f} | "
              f"{t['c'] / t['torch']:5.2f}")


def cuda_report(args, device) -> None:
    dtype = torch.bfloat16
    print("DMC training attention, forward + backward (bf16, 32 query heads, 8 KV heads, d 128)")
    print("tokens | dmc_attention ms (fused kernels) | sdpa causal ms | dmc / sdpa")
    for n in (4096, 8192, 16384):
        q, k, v, alpha = attention_case(n, device, dtype)
        dmc = timed(fwd_bwd(lambda: dmc_attention(q, k, v, alpha)), args.repeats, device)
        sdpa = timed(fwd_bwd(lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True)), args.repeats, device)
        print(f"{n:6d} | {dmc * 1e3:32.2f} | {sdpa * 1e3:14.2f} | {dmc / sdpa:.2f}")
    print("\npartial accumulation, forward + backward (bf16, 8 KV heads, d 128)")
    print("tokens | mode | triton ms | pytorch ms | pytorch / triton")
    for n in (4096, 16384):
        _, k, v, alpha = attention_case(n, device, dtype)
        omega = torch.rand_like(alpha).add_(0.1).requires_grad_(True)
        for mode in ("exact", "window"):
            def acc():
                kt, vt = partial_accumulation(k, v, alpha, omega, mode=mode)
                return kt + vt
            tri = timed(with_backend("triton", fwd_bwd(acc)), args.repeats, device)
            pt = timed(with_backend("torch", fwd_bwd(acc)), args.repeats, device)
            print(f"{n:6d} | {mode:6s} | {tri * 1e3:9.2f} | {pt * 1e3:10.2f} | {pt / tri:.2f}")
    print("\npaged decode (bf16, 1024 rows x 4 query heads, d 128, page 256)")
    print("tokens/row | triton ms | pytorch ms | flash-attn ms | triton GB/s | of peak")
    from kernels.paged.flash import flash_fits, paged_attention_flash

    for tokens in (1024, 4096, 16384):
        q, kp, vp, table, lens = paged_case(1024, tokens, 16384, 256, device, dtype)
        tri = timed(with_backend("triton", lambda: paged_attention(q, kp, vp, table, lens)), args.repeats, device)
        pt = timed(with_backend("torch", lambda: paged_attention(q, kp, vp, table, lens)), args.repeats, device)
        fl = (timed(lambda: paged_attention_flash(q, kp, vp, table, lens, q.shape[-1] ** -0.5), args.repeats, device)
              if flash_fits(q, kp, vp, table, lens, q.shape[-1] ** -0.5) else float("nan"))
        gbps = 2 * 1024 * tokens * 128 * 2 / tri / 1e9
        peak = f"{gbps / args.peak_gbps:.0%}" if args.peak_gbps else "-"
        print(f"{tokens:10d} | {tri * 1e3:9.3f} | {pt * 1e3:10.3f} | {fl * 1e3:13.3f} | {gbps:11.0f} | {peak}")


def cpu_report(args) -> None:
    device = torch.device("cpu")
    print("No CUDA device: the PyTorch paths on CPU (fp32). Triton kernels run here only under the")
    print("interpreter (tests), which says nothing about their speed.\n")
    print("DMC training attention, forward + backward (8 query heads, 8 KV heads, d 32: base_tiny's shape)")
    print("tokens | dmc_attention ms | sdpa causal ms | dmc / sdpa")
    for n in (1024, 4096):
        q, k, v, alpha = attention_case(n, device, torch.float32, heads=8, groups=8, d=32)
        dmc = timed(fwd_bwd(lambda: dmc_attention(q, k, v, alpha)), args.repeats, device)
        sdpa = timed(fwd_bwd(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)),
                     args.repeats, device)
        print(f"{n:6d} | {dmc * 1e3:16.1f} | {sdpa * 1e3:14.1f} | {dmc / sdpa:.2f}")
    print("\npartial accumulation, forward + backward (8 KV heads, d 32)")
    print("tokens | exact ms | window-12 ms")
    for n in (1024, 4096):
        _, k, v, alpha = attention_case(n, device, torch.float32, heads=8, groups=8, d=32)
        omega = torch.rand_like(alpha).add_(0.1).requires_grad_(True)
        ms = [timed(fwd_bwd(lambda m=mode: sum(partial_accumulation(k, v, alpha, omega, mode=m))), args.repeats,
                    device) * 1e3 for mode in ("exact", "window")]
        print(f"{n:6d} | {ms[0]:8.1f} | {ms[1]:12.1f}")
    for rows, groups, d in ((256, 4, 128), (1024, 1, 32)):  # a 7B model's head size, base_tiny's
        print(f"\npaged decode: {rows} rows x {groups} query head(s), d {d}, block table of 4096 tokens per row (pages "
              "of 16 shuffled in a pool of 1 GB: read from memory)")
        print("tokens held | ms | ms per 1K tokens held | K/V GB/s")
        for tokens in (256, 1024, 4096):
            q, kp, vp, table, lens = paged_case(rows, tokens, 4096, 16, device, torch.float32, groups, d)
            t = timed(lambda: paged_attention(q, kp, vp, table, lens), args.repeats, device)
            kv_bytes = rows * tokens * 2 * d * 4
            print(f"{tokens:11d} | {t * 1e3:6.2f} | {t * 1e3 / (tokens / 1024):21.2f} | {kv_bytes / t / 1e9:8.1f}")
    gqa_report(args.repeats)
    decode_ops_report(args.repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--peak-gbps", type=float, default=0.0, help="device memory bandwidth (GB/s) for fractions")
    args = parser.parse_args()
    torch.manual_seed(0)
    if torch.cuda.is_available():
        cuda_report(args, torch.device("cuda"))
    else:
        cpu_report(args)


if __name__ == "__main__":
    main()
