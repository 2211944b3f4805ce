"""Inference at a fixed KV budget: how many sequences each model fits, decode throughput and per-token
latency as the context grows, parallel vs token-by-token prefill, and the paged decode cost.

    python benchmarks/inference.py              # the runs of README command 1 + retrofit_study.py --preset tiny
    python benchmarks/inference.py --models base=runs/base_tiny dmc2=runs/dmc_tiny_cr2.0 --context 512

Models (``name=checkpoint``, default: every one of these that exists): vanilla ``runs/base_tiny``,
GQA ``runs/gqa_tiny_g4`` / ``runs/gqa_tiny_g2`` (or the untrained conversions ``runs/base_tiny_gqa4`` /
``gqa2``: same shapes, same cache cost), DMC ``runs/dmc_tiny_cr2.0`` / ``cr4.0``. Prompts are held-out
Shakespeare text (``data_cache/shakespeare/texts/valid``), greedy decoding to ``--context`` tokens.

1. Bytes per sequence at full context: ``--probe`` requests run to ``--context`` tokens; the largest
   KV footprint (pages + per-row state) among them is the model's cost of one sequence.
2. The budget is ``--budget-seqs`` vanilla sequences; each model runs as many sequences as fit in it,
   all at once (``kv_bytes`` = budget), from ``context / 2`` prompt tokens to ``context``. Decode
   throughput (tokens/s) and the per-token latency per context bucket come from this run.
3. Prefill of a ``context - 1`` token prompt: one parallel pass vs one token at a time.
4. Time to first token of 8 prompts of mixed lengths (``context / 16`` to ``15 context / 16``) submitted
   at once: admitted together and prefilled in one forward (packed, no padding) vs one prompt per
   forward (``max_prefill_tokens=1``), in ``--ttft-rounds`` interleaved rounds; medians and ranges.
5. The paged decode op (``kernels.paged``) on rows holding n tokens, with a block table sized for
   ``--paged-width`` tokens, against attention over the padded width.

Prints ratios measured in this run (this machine is noisy) and writes ``--out`` (PNG, default under runs/).
"""

import argparse
import glob
import os
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CANDIDATES = [("base", "runs/base_tiny"), ("gqa2", "runs/gqa_tiny_g4"), ("gqa2", "runs/base_tiny_gqa4"),
              ("gqa4", "runs/gqa_tiny_g2"), ("gqa4", "runs/base_tiny_gqa2"),
              ("dmc2", "runs/dmc_tiny_cr2.0"), ("dmc4", "runs/dmc_tiny_cr4.0")]


def default_models() -> dict[str, str]:
    found = {}
    for name, path in CANDIDATES:
        if name not in found and os.path.exists(os.path.join(ROOT, path)):
            found[name] = os.path.join(ROOT, path)
    return found


def prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens from different places of the held-out plays."""
    files = sorted(glob.glob(os.path.join(ROOT, "data_cache/shakespeare/texts/valid/*.txt")))
    if not files:
        raise SystemExit("error: data_cache/shakespeare/texts/valid is missing; run launch/prepare_data.py first")
    ids = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            ids += tokenizer.encode(f.read())
    stride = (len(ids) - length) // n
    return [ids[i * stride: i * stride + length] for i in range(n)]


def run_batch(engine, batch: list[list[int]], new_tokens: int, context_bucket: int) -> dict:
    """Run ``batch`` to completion; decode tokens/s and the per-token decode latency per context bucket."""
    from dmc_train.inference.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    for p in batch:
        engine.add_request(p, params)
    latency: dict[int, list[float]] = {}
    start_decode = engine.stats["decode_s"]
    decoded = engine.stats["decode_tokens"]
    while engine.has_work():
        before, n = engine.stats["decode_s"], len(engine.running)
        context = max((r.position for r in engine.running), default=0)
        engine.step()
        if n and engine.stats["decode_s"] > before:
            latency.setdefault(context // context_bucket * context_bucket, []).append(
                (engine.stats["decode_s"] - before) / n)
    outs = [engine.finished.pop(i) for i in list(engine.finished)]
    tokens = engine.stats["decode_tokens"] - decoded
    return {"tokens_per_s": tokens / (engine.stats["decode_s"] - start_decode),
            "latency": {c: sum(v) / len(v) for c, v in sorted(latency.items())},
            "failed": sum(o.error is not None for o in outs), "outputs": outs,
            "max_running": engine.stats["max_running"]}


def prefill_times(engine, prompt: list[int]) -> tuple[float, float]:
    """Seconds to prefill ``prompt`` in one pass, and one token at a time (prefill 1 + decode steps)."""
    model, tokens, times = engine.model, torch.tensor(prompt), []
    for stepwise in (False, True):
        cache = engine.new_cache()
        cache.add(0)
        t0 = time.perf_counter()
        model.prefill(cache, 0, tokens[:1] if stepwise else tokens)
        for t in range(1, len(prompt) if stepwise else 0):
            model.decode(cache, [0], tokens[t: t + 1], torch.tensor([t]))
        times.append(time.perf_counter() - t0)
        cache.release(0)
    return times[0], times[1]


def first_token_times(model, tokenizer, page_size: int, lengths: list[int], rounds: int) -> dict:
    """Seconds until every one of ``len(lengths)`` prompts (those lengths, submitted at once) has its first
    token: ``batched`` (the engine prefills what it admits in one forward) and ``serial`` (one prompt per
    forward), timed in ``rounds`` interleaved rounds whose order alternates; ``{mode: (median, min, max)}``."""
    import statistics

    from dmc_train.inference.engine import Engine
    from dmc_train.inference.sampling import SamplingParams

    batch = [p[:n] for p, n in zip(prompts(tokenizer, len(lengths), max(lengths)), lengths)]
    engines = {"batched": Engine(model, tokenizer, page_size=page_size, max_batch=len(lengths)),
               "serial": Engine(model, tokenizer, page_size=page_size, max_batch=len(lengths), max_prefill_tokens=1)}
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)  # each request ends at its first token
    times = {mode: [] for mode in engines}
    for r in range(rounds):
        for mode in (list(engines) if r % 2 == 0 else list(reversed(engines))):
            t0 = time.perf_counter()
            engines[mode].generate(batch, params)
            times[mode].append(time.perf_counter() - t0)
    return {mode: (statistics.median(t), min(t), max(t)) for mode, t in times.items()}


def paged_cost(rows: int, width: int, lengths: list[int], repeats: int = 5) -> list[tuple[int, float, float]]:
    """``(n, paged seconds, padded seconds)``: decode attention over rows holding n tokens each, with a
    block table of ``width`` tokens; padded = dense attention over all ``width`` slots with a mask."""
    from kernels.paged import paged_attention

    d, ps, g = 64, 16, 4
    pages = rows * width // ps
    k_pages, v_pages = torch.randn(pages, ps, d), torch.randn(pages, ps, d)
    table = torch.randperm(pages).view(rows, width // ps).int()
    q = torch.randn(rows, g, d)
    out = []
    for n in lengths:
        lens = torch.full((rows,), n, dtype=torch.int32)

        def padded():
            k = k_pages[table.long()].view(rows, width, d)
            v = v_pages[table.long()].view(rows, width, d)
            scores = torch.einsum("rgd,rld->rgl", q, k) / d ** 0.5
            scores = scores.masked_fill((torch.arange(width) >= lens[:, None])[:, None], float("-inf"))
            return torch.einsum("rgl,rld->rgd", scores.softmax(-1), v)

        times = []
        for fn in (lambda: paged_attention(q, k_pages, v_pages, table, lens), padded):
            fn()
            t0 = time.perf_counter()
            for _ in range(repeats):
                fn()
            times.append((time.perf_counter() - t0) / repeats)
        out.append((n, *times))
    return out


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(results)
    a.bar(names, [results[n]["batch"]["tokens_per_s"] for n in names], color="tab:blue")
    for i, n in enumerate(names):
        a.text(i, results[n]["batch"]["tokens_per_s"], f"batch {results[n]['fits']}", ha="center", va="bottom")
    a.set_ylabel("decode tokens/s (all sequences)")
    a.set_title("Decode throughput at one KV budget")
    for n in names:
        lat = results[n]["batch"]["latency"]
        b.plot(list(lat), [v * 1e3 for v in lat.values()], marker="o", label=f"{n} (batch {results[n]['fits']})")
    b.set_xlabel("context length (tokens)")
    b.set_ylabel("decode latency per token (ms)")
    b.set_title("Per-token latency as the context grows")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", help="name=checkpoint ... (default: the runs that exist)")
    parser.add_argument("--context", type=int, default=512, help="tokens per sequence at the end")
    parser.add_argument("--probe", type=int, default=6, help="sequences that measure the bytes per sequence")
    parser.add_argument("--budget-seqs", type=int, default=4, help="the KV budget, in vanilla sequences")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--paged-width", type=int, default=4096)
    parser.add_argument("--ttft-rounds", type=int, default=5, help="interleaved rounds of the time to first token")
    parser.add_argument("--out", default=os.path.join(ROOT, "runs/inference.png"))
    args = parser.parse_args()
    torch.manual_seed(0)

    from dmc_train.inference.engine import Engine, summarize

    models = dict(m.split("=", 1) for m in args.models) if args.models else default_models()
    if not models:
        raise SystemExit("error: no checkpoints found; run README command 1 and "
                         "benchmarks/retrofit_study.py --preset tiny")
    half = args.context // 2
    ttft_lengths = [max(1, args.context * f // 16) for f in (1, 15, 2, 8, 3, 12, 4, 6)]  # mixed, sum 4.5 contexts
    results, budget = {}, None
    for name, path in models.items():
        engine = Engine.from_checkpoint(path, page_size=args.page_size, max_batch=args.probe)
        probe = prompts(engine.tokenizer, args.probe, half)
        first = run_batch(engine, probe, args.context - half, 64)
        per_seq = max(o.kv_bytes["total"] for o in first["outputs"])
        compression = summarize(first["outputs"]).get("compression", 1.0)
        if budget is None:  # the first model (vanilla) sets the budget
            budget = args.budget_seqs * per_seq
        fits = budget // per_seq
        engine = Engine(engine.model, engine.tokenizer, page_size=args.page_size, kv_bytes=budget, max_batch=fits)
        batch = run_batch(engine, prompts(engine.tokenizer, fits, half), args.context - half, 64)
        prefill = prefill_times(engine, probe[0] + probe[1][: args.context - 1 - half])
        ttft = first_token_times(engine.model, engine.tokenizer, args.page_size, ttft_lengths, args.ttft_rounds)
        results[name] = {"per_seq": per_seq, "compression": compression, "fits": fits, "batch": batch,
                         "prefill": prefill, "ttft": ttft}
        print(f"{name}: {per_seq / 1024:.0f} KiB per sequence at {args.context} tokens (compression "
              f"{compression:.2f}x) -> {fits} sequences in {budget / 1024:.0f} KiB; decode "
              f"{batch['tokens_per_s']:.0f} tokens/s, failed {batch['failed']}; prefill {args.context - 1} tokens: "
              f"parallel {prefill[0] * 1e3:.0f} ms vs token by token {prefill[1] * 1e3:.0f} ms", flush=True)

    base = next(iter(results))
    print(f"\nKV budget {budget / 1024:.0f} KiB ({args.budget_seqs} x {base} at {args.context} tokens), "
          f"page size {args.page_size}")
    print("model | tokens per cache entry | KiB/seq | KV bytes vs base | batch that fits | decode tokens/s | x base "
          "| prefill parallel vs stepwise")
    base_tps, base_bytes = results[base]["batch"]["tokens_per_s"], results[base]["per_seq"]
    for name, r in results.items():
        tps, (par, step) = r["batch"]["tokens_per_s"], r["prefill"]
        print(f"{name:5s} | {r['compression']:22.2f} | {r['per_seq'] / 1024:7.0f} | "
              f"{base_bytes / r['per_seq']:15.2f}x | {r['fits']:15d} | {tps:15.0f} | {tps / base_tps:6.2f} | "
              f"{par * 1e3:.0f} ms vs {step * 1e3:.0f} ms ({step / par:.0f}x)")
    print(f"\ntime to first token of {len(ttft_lengths)} prompts of {min(ttft_lengths)}-{max(ttft_lengths)} tokens "
          f"(sum {sum(ttft_lengths)}) submitted at once, median [range] of {args.ttft_rounds} interleaved rounds:")
    for name, r in results.items():
        (b, b_lo, b_hi), (s, s_lo, s_hi) = r["ttft"]["batched"], r["ttft"]["serial"]
        print(f"  {name:5s} batched {b * 1e3:.0f} ms [{b_lo * 1e3:.0f}-{b_hi * 1e3:.0f}] vs one prompt per forward "
              f"{s * 1e3:.0f} ms [{s_lo * 1e3:.0f}-{s_hi * 1e3:.0f}]: {s / b:.2f}x")
    print("\nper-token decode latency (ms) by context:")
    for name, r in results.items():
        print(f"  {name:5s} " + " ".join(f"{c}:{v * 1e3:.2f}" for c, v in r["batch"]["latency"].items()))
    print(f"\npaged decode op: 64 rows, block table of {args.paged_width} tokens (seconds per call)")
    print("tokens held | paged | padded to the table | padded / paged")
    w = args.paged_width
    for n, paged, padded in paged_cost(64, w, [w // 32, w // 8, w // 2, w]):
        print(f"{n:11d} | {paged:.5f} | {padded:.5f} | {padded / paged:.2f}")
    plot(results, args.out)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
