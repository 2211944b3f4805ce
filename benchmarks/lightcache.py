"""LightCache on base_tiny (or an imported model): the paper's two claims at this scale, and its ablation.

    python benchmarks/lightcache.py                                  # runs/base_tiny, 16 held-out texts
    python benchmarks/lightcache.py --texts 4 --steps 8              # quicker
    python benchmarks/lightcache.py --checkpoint runs/inits/smollm2 --lengths 8192 16384 --no-ablation \
        --texts 2 --batch 1 --steps 8 --threads 2 --out docs/lightcache_smollm2.png   # SmolLM2-135M past 8,192

base_tiny was trained on sequences of ``train.seq_length`` = 256 tokens (its RoPE table has 512
positions, 256..511 never trained). An imported model's trained length is its ``max_position_embeddings``
(``--trained`` sets another), and its held-out text is the one in its own tokenizer
(``launch/prepare_data.py --tokenizer``). The held-out texts are ``--texts`` windows of the longest length + 1
tokens spread evenly over the test split.

1. **Length extrapolation**: teacher-forced perplexity on texts of 1x, 2x, 4x and 8x the trained
   length for the full cache (RoPE past its trained range), StreamingLLM with positions kept (this
   project's and kvpress's) and with positions inside the cache (the original StreamingLLM, which is
   LightCache with ``top_k=0``), at the same window, and LightCache at the defaults scaled to the model
   (global 4, local = 256 / 2, top_k x segment = 8 x 8 = 256 / 4: a window of 196 <= 256). Attention is
   causal, so a text's first L tokens are the text of length L: one pass over the 8x texts gives every
   length (the mean loss over its first L positions).
2. **The paper's ablation**: k x 1/16 only, v x 1/2 only, both (the default), neither (selection only).
3. **Memory and speed**: through the engine's caches, the bytes one sequence holds (pages + state +
   projections) after a prompt of each length, the reduction against the full cache (the paper: about
   60 % at 32K with k x 1/16 and v x 1/2), and the median decode step of a batch of ``--batch`` sequences.

All ratios are measured in one run. ``--threads 1`` by default: the machine's two cores are shared.
"""

import argparse
import copy
import dataclasses
import json
import math
import os
import statistics
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = {  # name -> LightCache options on top of the scaled defaults (None: not LightCache)
    "full cache": None,
    "StreamingLLM (positions kept)": None,
    "StreamingLLM (positions in cache)": {"top_k": 0, "local": "window"},  # LightCache's local and selected entries
    "LightCache k/16 v/2": {},
    "LightCache k/16": {"r_v": "d"},
    "LightCache v/2": {"r_k": "d"},
    "LightCache uncompressed": {"r_k": "d", "r_v": "d"},
}
ABLATION = ("LightCache k/16", "LightCache v/2", "LightCache uncompressed")  # left out by --no-ablation


def defaults(trained: int, head_dim: int) -> dict:
    """LightCache scaled to a model trained on ``trained`` tokens: local half of it, top_k x segment a quarter."""
    return {"global": 4, "local": trained // 2, "top_k": 8, "segment": trained // 4 // 8,
            "r_k": max(1, head_dim // 16), "r_v": head_dim // 2, "chunk": trained}


def options_of(name: str, trained: int, head_dim: int) -> dict:
    scaled = defaults(trained, head_dim)
    named = {"d": head_dim, "window": scaled["local"] + scaled["top_k"] * scaled["segment"]}
    return {**scaled, **{k: named.get(v, v) for k, v in METHODS[name].items()}}


def held_out_config(checkpoint: str, loaded) -> tuple:
    """``(config, trained length)`` of ``checkpoint``: its own config and ``train.seq_length``, or for an imported
    model (``launch/prepare_model.py``) its held-out text in its own tokenizer and its ``max_position_embeddings``."""
    from dmc_train.evaluation.imported import imported_checkpoint, imported_overrides
    from dmc_train.recipes import load_config

    resume = [f"checkpoint.resume={checkpoint}"]
    if imported_checkpoint(resume) is None:
        return loaded.cfg, loaded.cfg.train.seq_length
    cfg = load_config(imported_overrides(resume))
    return cfg, cfg.model.max_position_embeddings


def load_texts(cfg, count: int, length: int) -> torch.Tensor:
    """``[count, length + 1]`` token windows spread evenly over the test split."""
    from dmc_train.data.indexed import read_tokens

    stream = read_tokens(cfg.data.test_prefixes[0])
    starts = torch.linspace(0, len(stream) - length - 2, count).long().tolist()
    return torch.stack([torch.as_tensor(stream[s: s + length + 1].astype("int64")) for s in starts])


def token_losses(model, name: str, x: torch.Tensor, trained: int) -> torch.Tensor:
    """Per-position losses ``[b, n]`` of ``x [b, n + 1]`` under method ``name``."""
    import torch.nn.functional as F

    from dmc_train.inference.caches import causal_attention
    from dmc_train.inference.caches.lightcache import lightcache_for
    from dmc_train.policies import build_scorer
    from dmc_train.policies.parallel import run_policy

    s = model.shape
    tokens, labels = x[:, :-1], x[:, 1:]
    window = defaults(trained, s.head_dim)
    budget = window["global"] + window["local"] + window["top_k"] * window["segment"]

    def rotated(q, k, info):  # the model's RoPE at the tokens' own positions, however far
        return info.rotate(q, info.positions[:, None]), info.rotate(k, info.positions[:, None])

    if name == "full cache":
        def attend(layer, q, k, v, info):
            return causal_attention(*rotated(q, k, info), v, model.scale)
    elif name == "StreamingLLM (positions kept)":
        scorer = build_scorer("streaming_llm", {"budget": budget}, s.head_dim, s.num_heads // s.num_kv_heads,
                              model.scale)

        def attend(layer, q, k, v, info):
            return run_policy(scorer, *rotated(q, k, info), v, budget, layer, prompt_len=1).out
    else:
        attend = lightcache_for(model, options_of(name, trained, s.head_dim)).parallel_attention
    logits = model.forward_with_attention(tokens, attend, raw_qk=True)
    return F.cross_entropy(logits.float().transpose(1, 2), labels, reduction="none")


def perplexity(args, model, cfg, trained: int) -> dict:
    longest = max(args.lengths)
    texts = load_texts(cfg, args.texts, longest)
    results = {}
    for name in args.methods:
        start, losses = time.perf_counter(), []
        for first in range(0, len(texts), args.batch):
            losses.append(token_losses(model, name, texts[first: first + args.batch], trained))
            done = first + len(losses[-1])
            elapsed = time.perf_counter() - start
            print(f"  {name:34s} [{done}/{len(texts)}] {elapsed:.0f}s, eta {elapsed / done * (len(texts) - done):.0f}s",
                  end="\r", flush=True)
        loss = torch.cat(losses)  # [texts, longest]
        buckets = loss.view(len(texts), -1, trained).mean((0, 2))
        results[name] = {"ppl": {str(n): math.exp(float(loss[:, :n].mean())) for n in args.lengths},
                         "bucket_loss": buckets.tolist(), "seconds": time.perf_counter() - start}
        line = "  ".join(f"{n // trained}x {results[name]['ppl'][str(n)]:7.2f}" for n in args.lengths)
        print(f"  {name:34s} {line}   ({results[name]['seconds']:.0f}s)" + " " * 10, flush=True)
    return {"texts": len(texts), "tokens_per_text": longest, "methods": results}


def memory_and_speed(args, model, cfg, trained: int) -> dict:
    """Bytes one sequence holds after a prompt of each length, and the median decode step of a batch; the
    caches of one length decode in turns, step by step, so that load from other processes hits them alike."""
    from dmc_train.inference.caches import build_cache
    from dmc_train.inference.pool import PagePool

    longest = max(args.lengths)
    big = copy.copy(model)  # the same weights, positions enough for the full cache at the longest length
    big.shape = dataclasses.replace(model.shape, max_positions=longest + args.steps + 16)
    s = big.shape
    texts = load_texts(cfg, args.batch, longest + args.steps)
    rows = args.batch * s.num_layers * s.num_kv_heads
    names = [name for name in args.methods if name == "full cache" or "LightCache" in name]
    results = {name: {} for name in names}
    seqs = list(range(args.batch))
    for n in args.lengths:
        caches = {}
        for name in names:
            pool = PagePool(rows * -(-(n + args.steps) // 16) + rows, 16, s.head_dim, rows, s.max_positions)
            options = {} if name == "full cache" else options_of(name, trained, s.head_dim)
            caches[name] = build_cache("full" if name == "full cache" else "lightcache", pool, big, options)
            for i in seqs:
                caches[name].add(i)
                big.prefill(caches[name], i, texts[i, :n])
            results[name][str(n)] = {"bytes": caches[name].bytes_held(0)["total"]}
        times = {name: [] for name in names}
        for step in range(args.steps):
            for name, cache in caches.items():
                start = time.perf_counter()
                big.decode(cache, seqs, texts[:, n + step], torch.full((args.batch,), n + step))
                times[name].append(time.perf_counter() - start)
        for name in names:
            r = results[name][str(n)]
            r["step_ms"] = 1e3 * statistics.median(times[name][1:])
            print(f"  {name:22s} context {n:5d}: {r['bytes'] / 2**20:6.2f} MiB per sequence, decode step "
                  f"{r['step_ms']:6.1f} ms (batch {args.batch})", flush=True)
    return results


def report(ppl: dict, mem: dict, lengths: list[int], trained: int) -> None:
    methods = ppl["methods"]
    print(f"\nheld-out perplexity, {ppl['texts']} test texts, teacher-forced; length in units of the trained "
          f"{trained} tokens")
    print("| method | " + " | ".join(f"{n // trained}x ({n})" for n in lengths) + " |")
    print("|---|" + "---|" * len(lengths))
    for name, r in methods.items():
        print(f"| {name} | " + " | ".join(f"{r['ppl'][str(n)]:.2f}" for n in lengths) + " |")
    longest = str(max(lengths))
    full = methods["full cache"]["ppl"][longest]
    lc = methods["LightCache k/16 v/2"]["ppl"][longest]
    print(f"at {longest} tokens: full cache {full:.2f}, LightCache {lc:.2f} (full / LightCache {full / lc:.2f}), "
          f"StreamingLLM kept {methods['StreamingLLM (positions kept)']['ppl'][longest]:.2f}, in cache "
          f"{methods['StreamingLLM (positions in cache)']['ppl'][longest]:.2f}")
    base = mem["full cache"]
    print("\nKV bytes per sequence (pages + state + projections) and decode step (ms), vs the full cache")
    print("| cache | " + " | ".join(f"{n}" for n in lengths) + f" | reduction at {longest} | step at {longest} |")
    print("|---|" + "---|" * (len(lengths) + 2))
    for name, r in mem.items():
        cells = " | ".join(f"{r[str(n)]['bytes'] / 2**20:.2f} MiB" for n in lengths)
        reduction = 1 - r[longest]["bytes"] / base[longest]["bytes"]
        step = r[longest]["step_ms"] / base[longest]["step_ms"]
        print(f"| {name} | {cells} | {100 * reduction:.1f} % | {r[longest]['step_ms']:.1f} ms ({step:.2f}x) |")
    print("the paper's reductions at 32K (Table 1): k/16 v/2 60.07 %, k/16 43.07 %, v/2 17.00 %")


def plot(ppl: dict, mem: dict, lengths: list[int], trained: int, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ((a, b), (c, e)) = plt.subplots(2, 2, figsize=(12, 8.5))
    colour = {name: f"C{i}" for i, name in enumerate(METHODS)}
    for name, r in ppl["methods"].items():
        style = "--" if "StreamingLLM" in name else ":" if name == "full cache" else "-"
        a.plot([n / trained for n in lengths], [r["ppl"][str(n)] for n in lengths], style, marker="o", label=name,
               color=colour[name])
        x = [(i + 0.5) * trained for i in range(len(r["bucket_loss"]))]
        b.plot(x, [math.exp(v) for v in r["bucket_loss"]], style, marker=".", label=name, color=colour[name])
    a.set(xscale="log", yscale="log", xlabel=f"text length / trained length ({trained})",
          ylabel="held-out perplexity", title="Perplexity vs text length (teacher-forced)")
    a.set_xticks([n / trained for n in lengths], [f"{n // trained}x" for n in lengths])
    a.set_xticks([], minor=True)
    b.axvline(trained, color="grey", linewidth=0.8)
    b.set(yscale="log", xlabel="token position", ylabel=f"perplexity of {trained}-token spans",
          title=f"Where the loss goes ({max(lengths)}-token texts)")
    a.legend(fontsize=8)
    for ax in (a, b):  # plain numbers on the log axes
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ticks = (20, 30, 40, 50, 60, 70, 80, 100, 120, 150, 200, 300)
        ax.set_yticks([t for t in ticks if ax.get_ylim()[0] <= t <= ax.get_ylim()[1]])
    for name, r in mem.items():
        c.plot(lengths, [r[str(n)]["bytes"] / 2**20 for n in lengths], marker="o", label=name, color=colour[name])
        e.plot(lengths, [r[str(n)]["step_ms"] for n in lengths], marker="o", label=name, color=colour[name])
    c.set(xlabel="context (tokens)", ylabel="MiB per sequence", title="KV bytes held (pages + state + projections)")
    e.set(xlabel="context (tokens)", ylabel="ms", title="Decode step (batch of sequences)")
    c.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"plot: {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default=os.path.join(ROOT, "runs/base_tiny"))
    p.add_argument("--trained", type=int, help="the model's trained length (default: the checkpoint's "
                   "train.seq_length; an imported model's max_position_embeddings)")
    p.add_argument("--texts", type=int, default=16)
    p.add_argument("--batch", type=int, default=4, help="texts per forward; sequences per decode step")
    p.add_argument("--lengths", type=int, nargs="+", help="default: 1x, 2x, 4x, 8x the trained length")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per context")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-ablation", action="store_true", help="leave out the ablation (part 2): the full cache, "
                   "both StreamingLLMs and the default LightCache only")
    p.add_argument("--out", default=os.path.join(ROOT, "runs/lightcache.png"))
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    args.methods = [name for name in METHODS if not (args.no_ablation and name in ABLATION)]
    torch.set_num_threads(args.threads)

    from dmc_train.inference.model import LlamaForInference

    model, loaded = LlamaForInference.from_checkpoint(args.checkpoint)
    cfg, trained = held_out_config(args.checkpoint, loaded)
    trained = args.trained or trained
    args.lengths = sorted(args.lengths or [trained * f for f in (1, 2, 4, 8)])
    lc = options_of("LightCache k/16 v/2", trained, model.shape.head_dim)
    print(f"{args.checkpoint}: trained on {trained}-token sequences, head size {model.shape.head_dim}; LightCache "
          f"{lc} (window {lc['global'] + lc['local'] + lc['top_k'] * lc['segment']})", flush=True)
    print("1-2. perplexity", flush=True)
    ppl = perplexity(args, model, cfg, trained)
    print("3. memory and decode speed", flush=True)
    mem = memory_and_speed(args, model, cfg, trained)
    report(ppl, mem, args.lengths, trained)
    plot(ppl, mem, args.lengths, trained, args.out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"perplexity": ppl, "memory": mem, "lengths": args.lengths}, f, indent=1)


if __name__ == "__main__":
    main()
