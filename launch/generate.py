"""Generate text from a checkpoint with the inference engine (paged KV cache, continuous batching).

    python launch/generate.py --checkpoint runs/dmc_tiny_cr2.0 --prompt "To be, or not to be"
    python launch/generate.py --checkpoint CKPT --prompts-file prompts.txt --max-new-tokens 100 \
        --temperature 0.8 --top-p 0.95 --seed 1 --kv-bytes 64MB --max-batch 8
    python launch/generate.py --checkpoint CKPT --prompt "5 17 42" --token-ids   # prompts as token ids
    python -m launch.generate ...        # same, from an installed package
    torchrun --nproc_per_node=2 launch/generate.py --checkpoint CKPT --prompt "To be" --tensor-parallel 2

One prompt streams its tokens to the terminal; several print each output when it finishes. The
end shows throughput, the KV bytes held, and the achieved compression per layer (DMC: tokens per
cache slot). The cache follows the checkpoint (``--cache auto``: DMC checkpoints use the DMC cache);
an eviction policy keeps a fixed budget per (sequence, layer, KV head) on vanilla and GQA checkpoints:

    python launch/generate.py --checkpoint runs/base_tiny --prompt "To be" --cache h2o --budget 128
    python launch/generate.py --checkpoint runs/base_tiny --prompt "To be" --cache tova --budget 0.25 \
        --schedule prefill --compression-ratio 0.5 --policy-option aggregate=kv_head

Logic: ``dmc_train/inference/``, ``dmc_train/policies/``.
"""

import argparse
import json
import os
import sys


def parse_args(argv=None):
    from dmc_train.policies import POLICIES

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, help="checkpoint, run directory or checkpoints root")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    src.add_argument("--prompts-file", help="a text file with one prompt per line")
    p.add_argument("--token-ids", action="store_true", help="prompts are whitespace-separated token ids")
    p.add_argument("--tokenizer", help="tokenizer (default: the run's data.tokenizer)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--cache", default="auto",
                   help=f"auto | full | dmc | an eviction policy: {', '.join(POLICIES)}")
    p.add_argument("--budget", type=_number, help="policy budget per (sequence, layer, KV head): entries (e.g. 128) "
                   "or a fraction in (0, 1] of the context: the longest prompt + --max-new-tokens (e.g. 0.25)")
    p.add_argument("--schedule", choices=("decode", "prefill"), help="policy schedule (default decode)")
    p.add_argument("--compression-ratio", type=float, help="prefill schedule: fraction of the prompt removed")
    p.add_argument("--policy-option", action="append", default=[], metavar="KEY=VALUE",
                   help="another policy option, e.g. recent_fraction=0.3 (repeatable)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-bytes", default=None, help="KV page budget, e.g. 64MB (default: max-batch full-length rows, "
                                                    "within 90%% of a GPU's free memory or 20%% of the CPU's)")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--dtype", default=None, choices=("fp32", "bf16", "fp16"), help="default: the checkpoint's")
    p.add_argument("--device", default="cpu", help="where the model and its cache live: cpu (default), cuda, cuda:1")
    p.add_argument("--tensor-parallel", type=int, default=1,
                   help="split heads and MLP over this many ranks: run under torchrun --nproc_per_node=N (full and "
                        "dmc caches; --kv-bytes is per rank; rank 0 prints)")
    p.add_argument("--json", help="also write the outputs and the summary to this file")
    return p.parse_args(argv)


def read_prompts(args) -> list:
    from dmc_train.errors import InferenceError

    if args.prompts_file:
        try:
            with open(args.prompts_file) as f:
                prompts = [line.rstrip("\n") for line in f if line.strip()]
        except OSError as e:
            raise InferenceError(f"cannot read --prompts-file {args.prompts_file}: {e.strerror}") from None
    else:
        prompts = args.prompt
    if args.token_ids:
        try:
            return [[int(t) for t in p.split()] for p in prompts]
        except ValueError:
            raise InferenceError("--token-ids: prompts must be whitespace-separated integers") from None
    return prompts


def cache_options(args) -> dict:
    """The cache's options from the command line (only those given)."""
    from dmc_train.errors import InferenceError

    options = {k: v for k, v in (("budget", args.budget), ("schedule", args.schedule),
                                 ("compression_ratio", args.compression_ratio)) if v is not None}
    for item in args.policy_option:
        key, sep, value = item.partition("=")
        if not sep:
            raise InferenceError(f"--policy-option {item!r} must be KEY=VALUE, e.g. recent_fraction=0.3")
        options[key] = _number(value)
    return options


def context_budget(args, options: dict, prompts: list) -> dict:
    """``options`` with a fractional budget in entries: of the longest prompt (in the tokenizer that
    ``Engine.from_checkpoint`` takes) + ``--max-new-tokens``."""
    from dmc_train.policies import Budget

    if "budget" not in options or not Budget.of(options["budget"]).is_fraction:
        return options
    if prompts and isinstance(prompts[0], str):
        from dmc_train.data.tokenizer import load_tokenizer
        from dmc_train.training.checkpoint_dirs import find_checkpoint, read_meta

        path = args.tokenizer or read_meta(find_checkpoint(args.checkpoint))["config"]["data"].get("tokenizer")
        if path and os.path.exists(path):
            tok = load_tokenizer(path)
            prompts = [tok.encode(p) for p in prompts]
    longest = max(len(p) if isinstance(p, list) else len(p.split()) for p in prompts)
    return {**options, "budget": Budget.of(options["budget"]).entries(longest + args.max_new_tokens)}


def _number(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def report(engine, outputs, summary) -> None:
    st, mem = engine.stats, engine.memory()
    print("\n--- summary", flush=True)
    for o in outputs:
        status = o.error or o.finish_reason
        print(f"request {o.request_id}: {len(o.prompt_tokens)} prompt + {len(o.tokens)} new tokens ({status})")
    if st["prefill_s"]:
        print(f"prefill: {st['prefill_tokens']} tokens in {st['prefill_s']:.2f}s "
              f"({st['prefill_tokens'] / st['prefill_s']:.0f} tokens/s)")
    if st["decode_s"]:
        print(f"decode: {st['decode_tokens']} tokens in {st['decode_s']:.2f}s "
              f"({st['decode_tokens'] / st['decode_s']:.0f} tokens/s, up to {st['max_running']} sequences at once)")
    if st["preemptions"]:
        print(f"preempted {st['preemptions']} times for pages; {st['recomputed_tokens']} generated tokens recomputed")
    print(f"KV cache ({engine.cache_name}): peak {mem['peak'] / 2**20:.2f} MiB of a {mem['total'] / 2**20:.2f} MiB "
          f"pool ({mem['pages']} pages x {mem['page_bytes']} bytes) on {engine.device}, kernels {engine.kernels.name}")
    if summary.get("kv_bytes_at_end"):
        print(f"KV bytes held at the end (pages + state): {summary['kv_bytes_at_end'] / 2**20:.3f} MiB")
    if "compression" in summary:
        layers = " ".join(f"{c:.2f}" for c in summary["per_layer"])
        print(f"achieved compression: {summary['compression']:.2f}x (tokens per cache entry); per layer: {layers}")


def main(argv=None) -> None:
    args = parse_args(argv)

    from dmc_train import cli

    def run():
        import torch

        from dmc_train.errors import InferenceError
        from dmc_train.inference.engine import Engine, summarize
        from dmc_train.inference.sampling import SamplingParams

        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed, stop=tuple(args.stop))
        prompts = read_prompts(args)
        engine = Engine.from_checkpoint(args.checkpoint, dtype=args.dtype, tokenizer=args.tokenizer, cache=args.cache,
                                        page_size=args.page_size, kv_bytes=args.kv_bytes, max_batch=args.max_batch,
                                        tensor_parallel=args.tensor_parallel, device=args.device,
                                        **context_budget(args, cache_options(args), prompts))
        if engine.model.group is not None and torch.distributed.get_rank() != 0:
            sys.stdout = open(os.devnull, "w")  # every rank samples the same tokens; rank 0 prints them
            args.json = None
        if getattr(engine.cache, "note", None):
            print(f"note: {engine.cache.note}", file=sys.stderr)
        ids = [engine.add_request(p, params) for p in prompts]
        stream = len(prompts) == 1
        if stream and isinstance(prompts[0], str):
            print(prompts[0], end="", flush=True)
        for event in engine.run():
            if stream and event.token is not None:
                print(event.text if engine.tokenizer else f" {event.token}", end="", flush=True)
            elif not stream and event.finished:
                out = engine.finished[event.request_id]
                shown = out.text if engine.tokenizer else " ".join(map(str, out.tokens))
                print(f"[{event.request_id}] {shown if out.error is None else 'error: ' + out.error}", flush=True)
        outputs = [engine.finished[i] for i in ids]
        summary = summarize(outputs)
        report(engine, outputs, summary)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"outputs": [o.__dict__ for o in outputs], "summary": summary, "stats": engine.stats,
                           "memory": engine.memory()}, f, indent=1)
        failed = [o.error for o in outputs if o.error]
        if failed:  # a request the settings cannot serve (its pages): bad input, as every other InferenceError
            raise InferenceError(failed[0])

    try:
        cli.run_reporting_errors(run)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():  # tensor-parallel: the gloo group of the torchrun ranks
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
