"""Import a Hugging Face Llama model directory as a weights-only checkpoint (with its tokenizer).

    python checkpoints_tools/import_hf.py --input llama-2-7b-hf --output runs/inits/llama2_7b
    python -m checkpoints_tools.import_hf ...                      # same, from an installed package
    python launch/pretrain.py ... checkpoint.init_from=runs/inits/llama2_7b

``--input``: a directory with ``config.json`` and ``model.safetensors`` (or sharded safetensors with
``model.safetensors.index.json``, or ``pytorch_model.bin`` [+ index]), plus its tokenizer files; or a Llama
``.gguf`` file (dequantised into a temporary Hugging Face directory first; ``launch/prepare_model.py`` keeps it).
``--output``: a checkpoint loadable at any TP/PP layout; its tokenizer is in ``<output>/tokenizer``.
Logic and checks: ``dmc_train/conversion/hf_import.py``.
"""

import argparse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="Hugging Face model directory (LlamaForCausalLM) or .gguf file")
    parser.add_argument("--output", required=True, help="directory for the weights-only checkpoint")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"),
                        help="parameter dtype of the checkpoint (train.precision of its config)")
    parser.add_argument("--verify", default="streaming", choices=("streaming", "full"),
                        help="streaming (default): layer-by-layer logits of the HF tensors vs the written ones; "
                             "full: transformers' model vs our reloaded model (memory: a whole model)")
    args = parser.parse_args()

    from dmc_train import cli, distributed

    distributed.silence_expected_warnings()
    from dmc_train.conversion.hf_import import import_hf, imported_meta_summary

    def run():
        out = import_hf(args.input, args.output, overwrite=args.overwrite, dtype=args.dtype, verify=args.verify,
                        log=lambda line: print(line, flush=True))
        print(imported_meta_summary(out), flush=True)

    cli.run_reporting_errors(run)
    distributed.shutdown()


if __name__ == "__main__":
    main()
