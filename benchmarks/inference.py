"""Inference at a fixed KV budget: how many sequences each model fits, decode throughput against the batch
ratio, per-token latency at equal batch, the fraction of the memory-bandwidth limit, prefill and time to
first token, and the engine against transformers ``generate`` on the same checkpoints.

    python benchmarks/inference.py              # the runs of README command 1 + retrofit_study.py --preset tiny
    python benchmarks/inference.py --models base=runs/base_tiny gqa2=runs/gqa_tiny_g4 dmc2=runs/dmc_tiny_cr2.0 \\
        --policies h2o@0.25 tova@0.25 --context 512 --rounds 5
    python benchmarks/inference.py --context 128 --rounds 2 --budget-seqs 2 --no-hf-peer     # a quick check

Models (``name=checkpoint``, default: every one of these that exists): vanilla ``runs/base_tiny`` (the
first model is the base: it sets the budget and the ratios), GQA ``runs/gqa_tiny_g4`` / ``runs/gqa_tiny_g2``
(or the untrained conversions ``runs/base_tiny_gqa4`` / ``gqa2``: same shapes, same cache cost), DMC
``runs/dmc_tiny_cr2.0`` / ``cr4.0``. ``--policies cache@fraction``: the base checkpoint with that eviction
policy keeping ``fraction x context`` entries per (sequence, layer, KV head). Prompts are held-out
Shakespeare text (``data_cache/shakespeare/texts/valid``), ``context / 2`` tokens, greedy decoding to
``--context`` tokens.

Set up once per model (untimed, it also warms up):

1. Bytes per sequence at full context: ``--probe`` requests run to ``--context`` tokens; the largest KV
   footprint (pages + per-row state) among them is the model's cost of one sequence.
2. The budget is ``--budget-seqs`` base sequences; each model's engine holds that many bytes
   (``kv_bytes``) and runs the batch that fits, all at once. Every engine is built before any timing.
3. The transformers peer (``--hf-peer``, default on): the checkpoint exported once with
   ``checkpoints_tools/export_hf.py`` to ``runs/bench/hf/<name>`` (kept when complete), loaded with
   ``AutoModelForCausalLM`` (``trust_remote_code``: DMC runs its own cache), a policy through
   ``dmc_train.inference.hf_policy_cache.PolicyCache``; a model whose peer fails prints why and goes on.

Timed in ``--rounds`` interleaved rounds (every model and mode once per round, the order reversed every
other round); the tables give median [min-max] over rounds:

- decode tokens/s at the budget (tokens / seconds in the decode forwards), against the batch ratio: a
  cache that fits k times the base's batch should decode about k times as many tokens/s (goal: x base /
  batch ratio >= 0.9);
- per-token latency at equal batch (``--probe`` sequences for every model): the seconds of a decode step,
  which is every sequence's wait for its next token (goal: DMC within 1.15x of the GQA model of the same
  compression, ``dmcN`` against ``gqaN``);
- the step's matmuls alone at each model's batch (:func:`matmul_seconds`, timed in the rounds): what a larger
  batch costs whatever the cache, so the bound they put on the batch-ratio goal on this machine;
- bytes a decode step reads (the weights, embedding excluded, + the KV pages and state held) / its time,
  and as a fraction of this machine's copy bandwidth (``dst.copy_(src)`` of a 256 MB fp32 tensor, counted
  2 x bytes / time as STREAM does, best of 5);
- whole-generation tokens/s (prefill included, wall clock) of the engine and of transformers ``generate``
  (greedy, same prompts, same batch), and their ratio (goal: >= 2x).

Then, untimed by rounds: prefill of a ``context - 1`` token prompt in one pass vs one token at a time; time to
first token of 8 prompts of mixed lengths (``context / 16`` to ``15 context / 16``) submitted at once,
prefilled in one forward vs one prompt per forward (``max_prefill_tokens=1``), in ``--ttft-rounds``
interleaved rounds; the paged decode op (``kernels.paged``) on rows holding n tokens, with a block table
sized for ``--paged-width`` tokens, against attention over the padded width.

Prints ratios measured in this run (this machine is noisy) and which goals are met; writes ``--out`` (PNG,
default under runs/).
"""

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from dmc_train.policies import Budget

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


def spread(values: list[float]) -> tuple[float, float, float]:
    """``(median, min, max)``."""
    return statistics.median(values), min(values), max(values)


def show(values: list[float], scale: float = 1.0, digits: int = 0) -> str:
    """``median [min-max]`` of ``values`` times ``scale``."""
    m, lo, hi = (v * scale for v in spread(values))
    return f"{m:.{digits}f} [{lo:.{digits}f}-{hi:.{digits}f}]"


# ---------------------------------------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------------------------------------
def weight_bytes(model) -> int:
    """Bytes of the weights a decode step reads: every layer, the final norm and the LM head (of the embedding,
    only the rows of the batch's tokens are read: not counted)."""
    tensors = [t for layer in model.layers for t in vars(layer).values() if isinstance(t, torch.Tensor)]
    tensors += [model.final_norm, model.lm_head]
    return sum(t.numel() * t.element_size() for t in tensors)


def copy_bandwidth(megabytes: int = 256, repeats: int = 5, device: str | torch.device = "cpu") -> float:
    """The memory bandwidth of ``device`` in bytes/s: ``dst.copy_(src)`` of a ``megabytes`` fp32 tensor, counted as
    STREAM's copy does (2 x bytes: read + write), best of ``repeats``."""
    src = torch.ones(megabytes * 2 ** 20 // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # the pages are touched once before timing
    best = float("inf")
    for _ in range(repeats):
        synchronize(src.device)
        t0 = time.perf_counter()
        dst.copy_(src)
        synchronize(src.device)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * src.element_size() / best


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a GPU's kernels run asynchronously; nothing to wait for on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_seconds(model, batch: int, repeats: int = 20) -> float:
    """Seconds of a decode step's matmuls alone at ``batch`` rows (every layer's four projections and the LM
    head, on random inputs, median of ``repeats``), by the engine's own products (``kernels.layer.rms_norm_matmul``,
    whose RMSNorm of the rows costs next to nothing): the part of a step that grows with the batch whatever the
    cache holds, the compute floor of the batch ratio on this machine."""
    from kernels.layer import rms_norm_matmul

    weights = [w for layer in model.layers for w in (layer.qkv_t, layer.o_t, layer.gate_up_t, layer.down_t)]
    weights.append(model.lm_head_t)
    inputs = [(torch.randn(batch, w.shape[0], dtype=w.dtype), torch.ones(w.shape[0], dtype=w.dtype)) for w in weights]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for (x, norm), w in zip(inputs, weights):
            rms_norm_matmul(x, norm, 1e-5, w)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_batch(engine, batch: list[list[int]], new_tokens: int, weights: int, bucket: int = 64) -> dict:
    """Run ``batch`` to completion (all admitted at once when they fit). Returns decode ``tokens_per_s`` (in
    the decode forwards), ``step_s`` (mean decode step), ``latency`` (step seconds by context, in buckets of
    ``bucket`` tokens), ``read_per_s`` (bytes a step reads: ``weights`` + KV held, over the step's time),
    ``wall_tokens_per_s`` (generated tokens / seconds in ``engine.step()``, prefill included, this function's
    bookkeeping not), ``outputs``, ``failed``."""
    from dmc_train.inference.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    for p in batch:
        engine.add_request(p, params)
    latency: dict[int, list[float]] = {}
    steps, read, wall, context = [], 0, 0.0, 0
    while engine.has_work():
        before, held = engine.stats["decode_s"], kv_held(engine)
        t0 = time.perf_counter()
        engine.step()
        wall += time.perf_counter() - t0
        seconds = engine.stats["decode_s"] - before
        if seconds > 0:
            steps.append(seconds)
            read += weights + max(held, kv_held(engine))  # before the step: 0 at the first, after: 0 at the last
            context = max((r.position for r in engine.running), default=context + 1)  # none left after the last
            latency.setdefault(context // bucket * bucket, []).append(seconds)
    outs = [engine.finished.pop(i) for i in sorted(engine.finished)]
    decoded = sum(len(o.tokens) - 1 for o in outs)  # the first token of each comes from the prefill
    return {"tokens_per_s": decoded / sum(steps), "step_s": sum(steps) / len(steps),
            "latency": {c: sum(v) / len(v) for c, v in sorted(latency.items())}, "read_per_s": read / sum(steps),
            "wall_tokens_per_s": sum(len(o.tokens) for o in outs) / wall, "outputs": outs,
            "failed": sum(o.error is not None for o in outs)}


def kv_held(engine) -> int:
    """KV bytes the engine holds now: pages allocated + per-row state of the running requests."""
    memory = engine.memory()
    return memory["allocated"] + memory["running_state"]


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


def first_token_times(engine, page_size: int, lengths: list[int], rounds: int) -> dict:
    """Seconds until every one of ``len(lengths)`` prompts (those lengths, submitted at once) has its first
    token with ``engine``'s model and cache: ``batched`` (the engine prefills what it admits in one forward)
    and ``serial`` (one prompt per forward), timed in ``rounds`` interleaved rounds whose order alternates;
    ``{mode: [seconds per round]}``."""
    from dmc_train.inference.engine import Engine
    from dmc_train.inference.sampling import SamplingParams

    batch = [p[:n] for p, n in zip(prompts(engine.tokenizer, len(lengths), max(lengths)), lengths)]
    common = dict(cache=engine.cache_name, page_size=page_size, max_batch=len(lengths), **engine.cache_options)
    engines = {"batched": Engine(engine.model, engine.tokenizer, **common),
               "serial": Engine(engine.model, engine.tokenizer, max_prefill_tokens=1, **common)}
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)  # each request ends at its first token
    times = {mode: [] for mode in engines}
    for r in range(rounds):
        for mode in (list(engines) if r % 2 == 0 else list(reversed(engines))):
            t0 = time.perf_counter()
            engines[mode].generate(batch, params)
            times[mode].append(time.perf_counter() - t0)
    return times


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


# ---------------------------------------------------------------------------------------------------------------
# The transformers peer
# ---------------------------------------------------------------------------------------------------------------
def export_once(checkpoint: str, directory: str) -> None:
    """Export ``checkpoint`` to ``directory`` with ``checkpoints_tools/export_hf.py`` unless a complete export of
    the same checkpoint is there (the exporter writes ``manifest.json`` last, renaming a finished directory)."""
    from dmc_train.training.checkpoint_dirs import find_checkpoint

    manifest = os.path.join(directory, "manifest.json")
    if os.path.exists(manifest):
        with open(manifest, encoding="utf-8") as f:
            if json.load(f).get("source_checkpoint") == os.path.abspath(find_checkpoint(checkpoint)):
                return
    command = [sys.executable, "-m", "checkpoints_tools.export_hf", "--input", checkpoint, "--output", directory]
    if os.path.exists(directory):  # another checkpoint's export: replaced
        command.append("--overwrite")
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        raise RuntimeError(f"export failed: {lines[-1] if lines else f'exit code {done.returncode}'}")


def hf_peer(checkpoint: str, directory: str, cache: str, options: dict):
    """``generate(batch, new_tokens) -> seconds``: transformers ``generate`` (greedy, exactly ``new_tokens``
    tokens per sequence) of ``checkpoint`` exported to ``directory``; an eviction policy ``cache`` runs
    through :class:`PolicyCache` with ``options``."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    export_once(checkpoint, directory)
    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # as the engine's ignore_eos: every sequence runs to the end

    def generate(batch: list[list[int]], new_tokens: int) -> float:
        ids = torch.tensor(batch)  # the prompts have one length: no padding
        kwargs = {}
        if cache not in ("full", "dmc"):
            from dmc_train.inference.hf_policy_cache import PolicyCache

            kwargs["past_key_values"] = PolicyCache(model, cache, max_new_tokens=new_tokens, **options)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 do_sample=False, **kwargs)
        seconds = time.perf_counter() - t0
        assert out.shape == (len(batch), ids.shape[1] + new_tokens), out.shape
        return seconds

    generate(batch=[[1] * 8], new_tokens=2)  # warm-up
    return generate


# ---------------------------------------------------------------------------------------------------------------
# Set-up, rounds, report
# ---------------------------------------------------------------------------------------------------------------
def model_specs(args) -> dict[str, dict]:
    """``{name: {"checkpoint", "cache", "options", "export"}}`` from ``--models`` and ``--policies`` (``export``:
    the name of its transformers export, the base's for a policy)."""
    models = dict(m.split("=", 1) for m in args.models) if args.models else default_models()
    if not models:
        raise SystemExit("error: no checkpoints found; run README command 1 and "
                         "benchmarks/retrofit_study.py --preset tiny")
    specs = {name: {"checkpoint": path, "cache": "auto", "options": {}, "export": name}
             for name, path in models.items()}
    base = next(iter(models))
    for policy in args.policies:
        cache, _, fraction = policy.partition("@")
        budget = Budget.of(float(fraction) if fraction else None).entries(args.context)
        specs[policy] = {"checkpoint": models[base], "cache": cache, "options": {"budget": budget}, "export": base}
    return specs


def set_up(specs: dict[str, dict], args) -> tuple[dict, int]:
    """Per model: the probe engine (``--probe`` sequences) and its bytes per sequence, the engine at the budget
    and the batch that fits, the transformers peer; returns ``(setups, budget)``."""
    from dmc_train.inference.engine import Engine, summarize

    half, setups, budget = args.context // 2, {}, None
    loaded = {}  # checkpoint -> (model, tokenizer): policies share the base's
    for name, spec in specs.items():
        if spec["checkpoint"] not in loaded:
            e = Engine.from_checkpoint(spec["checkpoint"], max_batch=1)
            loaded[spec["checkpoint"]] = (e.model, e.tokenizer)
        model, tokenizer = loaded[spec["checkpoint"]]
        common = dict(cache=spec["cache"], page_size=args.page_size, **spec["options"])
        probe = Engine(model, tokenizer, max_batch=args.probe, **common)
        probe_prompts = prompts(tokenizer, args.probe, half)
        first = run_batch(probe, probe_prompts, args.context - half, 0)
        per_seq = max(o.kv_bytes["total"] for o in first["outputs"])
        if budget is None:  # the first model (the base) sets the budget
            budget = args.budget_seqs * per_seq
        fits = budget // per_seq
        engine = Engine(model, tokenizer, kv_bytes=budget, max_batch=fits, **common)
        setups[name] = {"probe": probe, "probe_prompts": probe_prompts, "engine": engine, "fits": fits,
                        "prompts": prompts(tokenizer, fits, half), "per_seq": per_seq, "weights": weight_bytes(model),
                        "compression": summarize(first["outputs"]).get("compression", 1.0), "hf": None}
        run_batch(engine, setups[name]["prompts"], args.context - half, 0)  # warm-up at the batch that fits
        if args.hf_peer:
            try:
                directory = os.path.join(ROOT, "runs", "bench", "hf", spec["export"])  # not beside --out (docs/)
                setups[name]["hf"] = hf_peer(spec["checkpoint"], directory, probe.cache_name, spec["options"])
            except Exception as e:  # noqa: BLE001 -- the peer is optional: say why and go on
                print(f"{name}: no transformers peer: {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)
        print(f"{name}: {per_seq / 1024:.0f} KiB per sequence at {args.context} tokens -> batch {fits} in "
              f"{budget / 1024:.0f} KiB; cache {probe.cache_name} {spec['options'] or ''}", flush=True)
    return setups, budget


def timed_rounds(setups: dict, args) -> dict:
    """Every model's runs (engine at the budget, engine at the probe batch, transformers at the budget's batch)
    in ``--rounds`` rounds, the order reversed every other round; ``{name: {measure: [value per round]}}``."""
    new = args.context - args.context // 2
    tasks = [(name, mode) for name, s in setups.items() for mode in ("budget", "probe", "hf")
             if mode != "hf" or s["hf"] is not None]
    results = {name: {} for name in setups}

    def add(name, key, value):
        results[name].setdefault(key, []).append(value)

    for r in range(args.rounds):
        for name, mode in (tasks if r % 2 == 0 else tasks[::-1]):
            s = setups[name]
            if mode == "budget":
                run = run_batch(s["engine"], s["prompts"], new, s["weights"])
                for key in ("tokens_per_s", "step_s", "read_per_s", "wall_tokens_per_s", "failed"):
                    add(name, key, run[key])
                add(name, "matmul_s", matmul_seconds(s["engine"].model, s["fits"]))
            elif mode == "probe":
                run = run_batch(s["probe"], s["probe_prompts"], new, s["weights"], max(16, args.context // 8))
                add(name, "probe_step_s", run["step_s"])
                add(name, "latency", run["latency"])
            else:
                add(name, "hf_tokens_per_s", s["fits"] * new / s["hf"](s["prompts"], new))
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    return results


def latency_curve(rounds: list[dict]) -> dict[int, float]:
    """Median over rounds of the step seconds per context bucket."""
    return {c: statistics.median(r[c] for r in rounds if c in r) for c in sorted(set().union(*rounds))}


def peer_of(name: str, names) -> str | None:
    """The GQA model holding the bytes a DMC model aims for: ``dmcN`` -> ``gqaN`` (when both run)."""
    peer = "gqa" + name[3:]
    return peer if name.startswith("dmc") and peer in names else None


def report(setups: dict, results: dict, budget: int, bandwidth: float, ttft: dict, prefill: dict, args) -> None:
    """The tables and the goals, met or not."""
    base = next(iter(setups))
    med = {n: {k: statistics.median(v) for k, v in r.items() if k != "latency"} for n, r in results.items()}
    print(f"\nKV budget {budget / 1024:.0f} KiB ({args.budget_seqs} x {base} at {args.context} tokens), page size "
          f"{args.page_size}, {args.rounds} interleaved rounds, median [min-max]; copy bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s; latency at equal batch = decode step time at batch {args.probe}")
    print("model | tokens/entry | KiB/seq | batch | decode tokens/s | x base | batch ratio | x base / batch ratio "
          "(goal >= 0.9) | ms/token at batch " f"{args.probe} | read GB/s | of bandwidth | TTFT batched vs serial ms")
    for name, s in setups.items():
        r, m = results[name], med[name]
        x_base, batch_ratio = m["tokens_per_s"] / med[base]["tokens_per_s"], s["fits"] / setups[base]["fits"]
        batched, serial = (statistics.median(ttft[name][mode]) for mode in ("batched", "serial"))
        print(f"{name:10s} | {s['compression']:5.2f} | {s['per_seq'] / 1024:6.0f} | {s['fits']:3d} | "
              f"{show(r['tokens_per_s'])} | {x_base:.2f} | {batch_ratio:.2f} | {x_base / batch_ratio:.2f} | "
              f"{show(r['probe_step_s'], 1e3, 2)} | {show(r['read_per_s'], 1e-9, 2)} | "
              f"{m['read_per_s'] / bandwidth:.1%} | {batched * 1e3:.0f} vs {serial * 1e3:.0f} ({serial / batched:.2f}x)"
              + (f" | FAILED {max(r['failed'])}" if max(r["failed"]) else ""))
    print(f"\nengine vs transformers generate, same prompts and batch, whole generation (prefill + "
          f"{args.context - args.context // 2} tokens), tokens/s")
    print("model | batch | engine | transformers | engine / transformers (goal >= 2)")
    for name, s in setups.items():
        r = results[name]
        hf = f"{show(r['hf_tokens_per_s'])} | {med[name]['wall_tokens_per_s'] / med[name]['hf_tokens_per_s']:.2f}" \
            if "hf_tokens_per_s" in r else "- | -"
        print(f"{name:10s} | {s['fits']:3d} | {show(r['wall_tokens_per_s'])} | {hf}")
    print(f"\nprefill {args.context - 1} tokens, one pass vs token by token:")
    for name, (par, step) in prefill.items():
        print(f"  {name:10s} {par * 1e3:.0f} ms vs {step * 1e3:.0f} ms ({step / par:.0f}x)")
    print("\nper-token decode latency (ms, step time) at batch " f"{args.probe} by context:")
    for name, r in results.items():
        print(f"  {name:10s} " + " ".join(f"{c}:{v * 1e3:.2f}" for c, v in latency_curve(r["latency"]).items()))
    goals(setups, med, base)


def goals(setups: dict, med: dict, base: str) -> None:
    """Each goal, met or not, from the medians."""
    print("\ngoals (from the medians of this run):")
    for name, s in list(setups.items())[1:]:
        x_base = med[name]["tokens_per_s"] / med[base]["tokens_per_s"]
        ratio = x_base / (s["fits"] / setups[base]["fits"])
        print(f"  {name}: decode tokens/s {x_base:.2f}x base for {s['fits'] / setups[base]['fits']:.2f}x the batch = "
              f"{ratio:.2f} of the batch ratio (goal >= 0.9): {'met' if ratio >= 0.9 else 'NOT met'}")
    print("  (x base / batch ratio = base's decode step / this model's, each at its batch. The matmuls alone, timed "
          "at each batch in the rounds, bound it on this machine: if the rest of the step cost what the base's does, "
          "the ratio would be at most base step / (base step + matmuls here - matmuls at base's batch))")
    for name, s in list(setups.items())[1:]:
        m, b = med[name], med[base]
        bound = b["step_s"] / (b["step_s"] + m["matmul_s"] - b["matmul_s"])
        print(f"  {name}: matmuls {m['matmul_s'] * 1e3:.2f} ms at batch {s['fits']} vs {b['matmul_s'] * 1e3:.2f} ms at "
              f"{setups[base]['fits']}; base step {b['step_s'] * 1e3:.2f} ms, this step {m['step_s'] * 1e3:.2f} ms: "
              f"ratio {b['step_s'] / m['step_s']:.2f}, bound by the matmuls {min(bound, 1):.2f}")
    for name in setups:
        peer = peer_of(name, setups)
        if peer:
            ratio = med[name]["probe_step_s"] / med[peer]["probe_step_s"]
            print(f"  {name} vs {peer}: per-token latency at equal batch {ratio:.2f}x (goal <= 1.15): "
                  f"{'met' if ratio <= 1.15 else 'NOT met'}")
    for name, s in setups.items():
        if "hf_tokens_per_s" in med[name]:
            m = med[name]
            ratio = m["wall_tokens_per_s"] / m["hf_tokens_per_s"]
            # an engine whose every step were its matmuls alone (no prefill, no attention, no overhead)
            bound = s["fits"] / (m["hf_tokens_per_s"] * m["matmul_s"])
            print(f"  {name}: engine {ratio:.2f}x transformers (goal >= 2): {'met' if ratio >= 2 else 'NOT met'}; "
                  f"an engine whose steps were their matmuls alone would be {bound:.2f}x")
        else:
            print(f"  {name}: engine vs transformers not measured")


def plot(setups: dict, results: dict, args) -> None:
    """Decode tokens/s at the budget, engine vs transformers, per-token latency by context; range bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def bars(axis, x, values_per_name, **kw):
        stats = [spread(v) for v in values_per_name]
        axis.bar(x, [m for m, _, _ in stats], yerr=[[m - lo for m, lo, _ in stats], [hi - m for m, _, hi in stats]],
                 capsize=3, **kw)

    names = list(setups)
    x = list(range(len(names)))
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4.5))
    bars(a, x, [results[n]["tokens_per_s"] for n in names], color="tab:blue")
    for i, n in enumerate(names):
        a.text(i, 0, f"batch {setups[n]['fits']}", ha="center", va="bottom", color="white", fontsize=8)
    a.set_xticks(x, names)
    a.set_ylabel("decode tokens/s (all sequences)")
    a.set_title(f"Decode at one KV budget (median, range of {args.rounds})")
    w = 0.4
    bars(b, [i - w / 2 for i in x], [results[n]["wall_tokens_per_s"] for n in names], width=w, label="engine")
    with_hf = [i for i, n in enumerate(names) if "hf_tokens_per_s" in results[n]]
    if with_hf:
        bars(b, [i + w / 2 for i in with_hf], [results[names[i]]["hf_tokens_per_s"] for i in with_hf], width=w,
             label="transformers generate")
    b.set_xticks(x, names)
    b.set_ylabel("tokens/s, whole generation")
    b.set_title("Engine vs transformers, same batch")
    b.legend()
    for n in names:
        curve = latency_curve(results[n]["latency"])
        c.plot(list(curve), [v * 1e3 for v in curve.values()], marker="o", label=n)
    c.set_xlabel("context length (tokens)")
    c.set_ylabel("decode step (ms) = per-token latency")
    c.set_title(f"Per-token latency at batch {args.probe}")
    c.legend()
    for axis in (a, b):
        axis.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    fig.savefig(args.out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", help="name=checkpoint ... (default: the runs that exist); the "
                        "first is the base")
    parser.add_argument("--policies", nargs="*", default=[], help="cache@fraction ... (e.g. h2o@0.25): the base "
                        "checkpoint with that eviction policy keeping fraction x context entries per row")
    parser.add_argument("--context", type=int, default=512, help="tokens per sequence at the end")
    parser.add_argument("--probe", type=int, default=6, help="sequences that measure the bytes per sequence and "
                        "the latency at equal batch")
    parser.add_argument("--budget-seqs", type=int, default=4, help="the KV budget, in base sequences")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the timed runs")
    parser.add_argument("--hf-peer", action=argparse.BooleanOptionalAction, default=True,
                        help="time transformers generate on the exported checkpoints too")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--paged-width", type=int, default=4096)
    parser.add_argument("--ttft-rounds", type=int, default=5, help="interleaved rounds of the time to first token")
    parser.add_argument("--out", default=os.path.join(ROOT, "runs/inference.png"))
    args = parser.parse_args()
    torch.manual_seed(0)

    specs = model_specs(args)
    setups, budget = set_up(specs, args)
    bandwidth = copy_bandwidth()
    results = timed_rounds(setups, args)
    ttft_lengths = [max(1, args.context * f // 16) for f in (1, 15, 2, 8, 3, 12, 4, 6)]  # mixed, sum 4.5 contexts
    ttft = {n: first_token_times(s["probe"], args.page_size, ttft_lengths, args.ttft_rounds)
            for n, s in setups.items()}
    prefill = {n: prefill_times(s["probe"], s["probe_prompts"][0] + s["probe_prompts"][1][: args.context - 1
                                                                                        - args.context // 2])
               for n, s in setups.items()}
    report(setups, results, budget, bandwidth, ttft, prefill, args)
    print(f"\ntime to first token: {len(ttft_lengths)} prompts of {min(ttft_lengths)}-{max(ttft_lengths)} tokens "
          f"(sum {sum(ttft_lengths)}) submitted at once, median of {args.ttft_rounds} interleaved rounds (table)")
    print(f"\npaged decode op: 64 rows, block table of {args.paged_width} tokens (seconds per call)")
    print("tokens held | paged | padded to the table | padded / paged")
    w = args.paged_width
    for n, paged, padded in paged_cost(64, w, [w // 32, w // 8, w // 2, w]):
        print(f"{n:11d} | {paged:.5f} | {padded:.5f} | {padded / paged:.2f}")
    plot(setups, results, args)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
