"""Decode throughput at one KV byte budget on one device: the full cache against DMC's cache (fixed pooling 2x and
4x), GQA (2x, 4x) and the eviction policies (H2O, TOVA, StreamingLLM at 1/2 and 1/4 of the entries), each at the
largest batch its cache fits in the budget, and the engine against transformers' ``generate`` on the same model.

    python benchmarks/gpu_decode.py --device cuda                                  # Llama-2-7B shape, 4 layers
    python benchmarks/gpu_decode.py --device cuda --layers 32 --kv-gib 40
    python benchmarks/gpu_decode.py --device cpu --shape tiny --prompt 64 --new 32 --kv-mib 16   # a quick check

The models have random weights (speed does not depend on what they learned): ``--shape llama2_7b`` (hidden 4096, 32
heads of 128, FFN 11008, vocabulary 32000; ``--layers`` of them) or ``tiny`` (base_tiny's: 4 layers, hidden 256, 8
heads of 32); GQA 2x / 4x are the same shape with a half / a quarter of the KV heads; DMC's cache runs the full
model with Fixed Memory Pooling's decisions (``DMCInference`` with ``pool``: every ``pool`` tokens merged into one
slot, DMC's compression without a retrofit). ``--dtype`` (default bf16 on CUDA, fp32 on CPU).

Each cache gets the same KV budget (``--kv-gib`` / ``--kv-mib``; default: 16 full-cache sequences); its batch is
the sequences of ``--prompt`` + ``--new`` tokens whose pages and per-row state fit it (at most ``--max-batch``).
Per cache, one untimed short generation (compiles, warms up), then ``--rounds`` generations of ``batch`` prompts of
random token ids, ``--new`` tokens each, greedy: decode tokens/s (the engine's decode forwards,
``Engine.stats``), whole-generation tokens/s, the bytes a decode step reads (the weights, LM head included, and
the KV held at the middle of the generation) over its time against the device's copy bandwidth (``dst.copy_(src)``
of 1 GiB, 2 x bytes / time). transformers' ``LlamaForCausalLM`` with the same weights (SDPA, its DynamicCache)
generates the same prompts at the full cache's batch (``--no-hf`` skips it). Each cache's per-token latency at
equal batch: milliseconds per decode step of a 64-token generation at the full cache's batch. The full cache's time
to first token of its batch's prompts: in one ``generate`` (their prefills batched) and one prompt at a time.

Prints the table and the goals met / NOT met (the DMC paper's H100 numbers for Llama 2: fixed pooling 2x >= 1.8x and
4x >= 3.4x the full cache's tokens/s; every policy at 1/4 >= 3x; the engine >= 3x transformers at equal batch; the
largest batch's step >= 70 % of the copy bandwidth); writes ``gpu_decode.json`` and ``gpu_decode.png`` (tokens/s
per cache, its batch on the bar) to ``--out`` (default ``runs/gpu_decode``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import torch
from inference import copy_bandwidth, synchronize, weight_bytes  # benchmarks/inference.py (this directory)

from dmc_train.inference.model import DTYPES

SHAPES = {  # (layers, hidden, ffn, heads, vocab, rope base)
    "llama2_7b": (32, 4096, 11008, 32, 32000, 10000.0),
    "tiny": (4, 256, 688, 8, 4096, 10000.0),
}
# name -> (KV heads divisor (GQA), fixed pooling factor, eviction policy, fraction of the entries it keeps)
CACHES = {
    "full": (1, None, None, 1.0), "pool2": (1, 2, None, 1.0), "pool4": (1, 4, None, 1.0),
    "gqa2": (2, None, None, 1.0), "gqa4": (4, None, None, 1.0),
    "h2o_1of2": (1, None, "h2o", 0.5), "h2o_1of4": (1, None, "h2o", 0.25),
    "tova_1of2": (1, None, "tova", 0.5), "tova_1of4": (1, None, "tova", 0.25),
    "streaming_llm_1of2": (1, None, "streaming_llm", 0.5), "streaming_llm_1of4": (1, None, "streaming_llm", 0.25),
}


def model_for(name: str, args) -> "LlamaForInference":  # noqa: F821
    from dmc_train.inference.dmc_decisions import DMCInference
    from dmc_train.inference.model import LlamaForInference, ModelShape, random_weights
    from dmc_train.models.dmc_settings import DMCSettings

    layers, hidden, ffn, heads, vocab, base = SHAPES[args.shape]
    divisor, pool, _, _ = CACHES[name]
    shape = ModelShape(args.layers or layers, hidden, ffn, heads, heads // divisor, vocab, rope_base=base,
                       max_positions=args.prompt + args.new)
    method = None if pool is None else DMCInference(DMCSettings(channel=None, pool=pool))
    if shape not in _WEIGHTS:  # one set per shape: the full model's serves DMC's cache and the policies too
        _WEIGHTS[shape] = random_weights(shape, seed=0, std=0.02)
    return LlamaForInference(shape, _WEIGHTS[shape], method, dtype=DTYPES[args.dtype], device=args.device)


_WEIGHTS: dict = {}  # ModelShape -> its random weights (HF names, CPU)


def sequence_bytes(engine, tokens: int) -> int:
    """Bytes one sequence of ``tokens`` tokens holds in ``engine``'s cache: its pages (the entries its cache keeps at
    that length: every token, ``ceil(tokens / pool) + 1`` slots, or the policy's budget) and its per-row state."""
    cache, pool, s = engine.cache, engine.pool, engine.model.shape
    settings = getattr(engine.model.method, "settings", None)
    budget = getattr(cache, "budget", None)
    entries = tokens if settings is None and budget is None else \
        -(-tokens // settings.pool) + 1 if settings is not None else budget
    rows = s.num_layers * s.num_kv_heads
    cache.add(-1)
    state = cache.state_bytes(-1)
    cache.release(-1)
    return rows * -(-entries // pool.page_size) * pool.page_bytes + state


def timed(fn, device) -> float:
    """Seconds of ``fn()``, the device's queued work included."""
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


def step_ms(engine, prompts: list[list[int]], new: int) -> float:
    """Milliseconds per decode step (each sequence's per-token latency) of a generation of ``prompts``, ``new``
    tokens each (the engine's decode forwards)."""
    from dmc_train.inference.sampling import SamplingParams

    before = dict(engine.stats)
    engine.generate(prompts, SamplingParams(max_new_tokens=new, ignore_eos=True))
    steps = (engine.stats["decode_tokens"] - before["decode_tokens"]) / len(prompts)
    return 1e3 * (engine.stats["decode_s"] - before["decode_s"]) / steps


def first_token_seconds(engine, prompts: list[list[int]], device) -> tuple[float, float]:
    """Seconds until every prompt has its first token: all of them in one ``generate`` (their prefills batched) and
    one ``generate`` per prompt in turn."""
    from dmc_train.inference.sampling import SamplingParams

    one = SamplingParams(max_new_tokens=1, ignore_eos=True)
    return (timed(lambda: engine.generate(prompts, one), device),
            timed(lambda: [engine.generate([p], one) for p in prompts], device))


def measure(name: str, args, kv_bytes: int, equal_batch: int | None) -> dict:
    """One cache's batch, decode and whole-generation tokens/s, its per-token latency at ``equal_batch`` sequences
    (the full cache's batch; None: the cache is the full one, measured at its own), and for the full cache the time
    to first token batched and serial (module docstring)."""
    from dmc_train.inference.engine import Engine
    from dmc_train.inference.sampling import SamplingParams

    model = model_for(name, args)
    _, _, policy, fraction = CACHES[name]
    tokens = args.prompt + args.new
    options = {} if policy is None else {"budget": max(1, int(fraction * tokens))}
    engine = Engine(model, cache=policy or "auto", kv_bytes=kv_bytes, max_batch=args.max_batch, **options)
    per_seq = sequence_bytes(engine, tokens)
    batch = min(args.max_batch, kv_bytes // per_seq)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.shape.vocab_size, (batch, args.prompt), generator=g).tolist()
    engine.generate(prompts, SamplingParams(max_new_tokens=min(8, args.new), ignore_eos=True))  # warm-up
    decode, wall = [], []
    for _ in range(args.rounds):
        before = dict(engine.stats)
        synchronize(model.device)
        t0 = time.perf_counter()
        engine.generate(prompts, SamplingParams(max_new_tokens=args.new, ignore_eos=True))
        synchronize(model.device)
        wall.append(batch * args.new / (time.perf_counter() - t0))
        decode.append((engine.stats["decode_tokens"] - before["decode_tokens"])
                      / (engine.stats["decode_s"] - before["decode_s"]))
    read = weight_bytes(model) + batch * sequence_bytes(engine, args.prompt + args.new // 2)  # the KV at mid-generation
    result = {"name": name, "batch": batch, "bytes_per_seq": per_seq, "decode_tps": statistics.median(decode),
              "wall_tps": statistics.median(wall), "step_read_bytes": read,
              "preemptions": engine.stats["preemptions"]}
    result["read_per_s"] = read * result["decode_tps"] / batch
    result["equal_batch"] = min(equal_batch or batch, batch)
    result["step_ms_equal_batch"] = step_ms(engine, prompts[: result["equal_batch"]], min(args.new, 64))
    if name == "full":
        result["ttft_batched_s"], result["ttft_serial_s"] = first_token_seconds(engine, prompts, model.device)
        if args.hf:
            result["hf_tps"] = hf_generate(model, prompts, args)
    del engine, model
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return result


def hf_generate(model, prompts: list[list[int]], args) -> float:
    """transformers ``generate`` tokens/s (greedy, SDPA, its default cache) of the same weights, prompts and batch."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaForCausalLM(LlamaConfig(**model.shape.hf_config(attn_implementation="sdpa")))
    hf = hf.to(device=args.device, dtype=model.dtype).eval()
    hf.load_state_dict(_WEIGHTS[model.shape])
    ids = torch.tensor(prompts, device=args.device)
    run = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        hf.generate(ids, **{**run, "max_new_tokens": min(8, args.new), "min_new_tokens": min(8, args.new)})
        times = []
        for _ in range(args.rounds):
            synchronize(ids.device)
            t0 = time.perf_counter()
            hf.generate(ids, **run)
            synchronize(ids.device)
            times.append(time.perf_counter() - t0)
    del hf
    return len(prompts) * args.new / statistics.median(times)


def report(results: list[dict], bandwidth: float, args) -> None:
    by = {r["name"]: r for r in results}
    full = by.get("full")
    print(f"\n{args.shape} shape, {args.layers or SHAPES[args.shape][0]} layers, {args.dtype}, {args.device}; prompt "
          f"{args.prompt}, {args.new} generated; KV budget {args.kv_bytes / 2 ** 20:,.0f} MiB; copy bandwidth "
          f"{bandwidth / 1e9:.0f} GB/s; median of {args.rounds} generations")
    print("cache | batch | MiB/seq | decode tok/s | x full | whole generation tok/s | step reads / copy bandwidth | "
          "ms per step at equal batch")
    for r in results:
        x = f"{r['decode_tps'] / full['decode_tps']:.2f}" if full else "-"
        print(f"{r['name']:18s} | {r['batch']:5d} | {r['bytes_per_seq'] / 2 ** 20:8.1f} | {r['decode_tps']:9.0f} | "
              f"{x:>5s} | {r['wall_tps']:9.0f} | {r['read_per_s'] / bandwidth:4.0%} | "
              f"{r['step_ms_equal_batch']:7.2f} (batch {r['equal_batch']})"
              + (f" | {r['preemptions']} preemptions (the batch did not fit)" if r["preemptions"] else ""))
    if full:
        print(f"time to first token of {full['batch']} prompts: {full['ttft_batched_s']:.2f} s batched, "
              f"{full['ttft_serial_s']:.2f} s one at a time ({full['ttft_serial_s'] / full['ttft_batched_s']:.1f}x)")
    print("\ngoals:")
    if full:
        for name, goal in [("pool2", 1.8), ("pool4", 3.4)] + [(n, 3.0) for n in by if n.endswith("_1of4")]:
            if name in by:
                x = by[name]["decode_tps"] / full["decode_tps"]
                print(f"  {name}: {x:.2f}x the full cache's decode tokens/s (goal >= {goal}): "
                      f"{'met' if x >= goal else 'NOT met'}")
        if "hf_tps" in full:
            x = full["wall_tps"] / full["hf_tps"]
            print(f"  engine vs transformers generate at batch {full['batch']}: {x:.2f}x (goal >= 3): "
                  f"{'met' if x >= 3 else 'NOT met'}")
    largest = max(results, key=lambda r: r["batch"])
    share = largest["read_per_s"] / bandwidth
    print(f"  {largest['name']} (batch {largest['batch']}): a decode step reads at {share:.0%} of the copy bandwidth "
          f"(goal >= 70 %): {'met' if share >= 0.7 else 'NOT met'}")


def plot(results: list[dict], args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(max(6, len(results) * 0.9), 4.5))
    names = [r["name"] for r in results]
    axis.bar(names, [r["decode_tps"] for r in results], color="tab:blue")
    for i, r in enumerate(results):
        axis.text(i, r["decode_tps"], f"batch {r['batch']}", ha="center", va="bottom", fontsize=8)
    axis.set_ylabel("decode tokens/s (all sequences)")
    axis.set_title(f"Decode at one KV budget ({args.shape}, {args.device}, {args.dtype})")
    axis.tick_params(axis="x", labelrotation=30)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "gpu_decode.png"), dpi=120)



def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", default="llama2_7b", choices=list(SHAPES))
    p.add_argument("--layers", type=int, default=None, help="default: 4 of llama2_7b, every layer of tiny")
    p.add_argument("--dtype", default=None, choices=list(DTYPES), help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--new", type=int, default=2048)
    p.add_argument("--kv-gib", type=float, default=None)
    p.add_argument("--kv-mib", type=float, default=None)
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--caches", nargs="+", default=list(CACHES), choices=list(CACHES))
    p.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--out", default="runs/gpu_decode")
    args = p.parse_args()
    if args.layers is None and args.shape == "llama2_7b":
        args.layers = 4
    args.dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but no GPU is visible here; run on a GPU machine or pass --device cpu")
    if args.kv_gib is not None or args.kv_mib is not None:
        args.kv_bytes = int((args.kv_gib or 0) * 2 ** 30 + (args.kv_mib or 0) * 2 ** 20)
    else:  # 16 full-cache sequences
        layers, hidden, _, heads, _, _ = SHAPES[args.shape]
        per_token = 2 * (args.layers or layers) * hidden * DTYPES[args.dtype].itemsize
        args.kv_bytes = 16 * per_token * (args.prompt + args.new)
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    bandwidth = copy_bandwidth(1024, 5, device)
    results = []
    for name in sorted(args.caches, key=list(CACHES).index):  # the full cache first: its batch is the equal batch
        equal = next((r["batch"] for r in results if r["name"] == "full"), None)
        results.append(measure(name, args, args.kv_bytes, equal))
        r = results[-1]
        print(f"{name}: batch {r['batch']}, decode {r['decode_tps']:.0f} tok/s", flush=True)
    with open(os.path.join(args.out, "gpu_decode.json"), "w") as f:
        json.dump({"args": {k: v for k, v in vars(args).items()}, "bandwidth": bandwidth, "results": results}, f,
                  indent=1)
    report(results, bandwidth, args)
    plot(results, args)
    print(f"\nwrote {args.out}/gpu_decode.json and gpu_decode.png")


if __name__ == "__main__":
    main()
