"""Export a checkpoint to a Hugging Face LlamaForCausalLM directory (verified against our model before it appears).

    python checkpoints_tools/export_hf.py --input runs/base_tiny --output hf/base_tiny
    python checkpoints_tools/export_hf.py --input CKPT --output DIR --dtype bfloat16 --max-shard-size 2GB --overwrite
    python -m checkpoints_tools.export_hf ...        # same, from an installed package

``--input``: a checkpoint directory, or a run directory / checkpoints root (its ``latest``), saved at
any TP/PP layout. Runs in one process. Logic: ``dmc_train/conversion/hf_export.py``.
"""

import argparse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="checkpoint (or run directory) to export")
    parser.add_argument("--output", required=True, help="directory for the Hugging Face model")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16", "float32", "bfloat16", "float16"),
                        help="dtype of the stored weights (default fp32)")
    parser.add_argument("--max-shard-size", default="5GB", help="byte budget of one safetensors shard (e.g. 2GB)")
    args = parser.parse_args()

    from dmc_train import cli

    def run():
        from dmc_train import distributed
        from dmc_train.conversion.hf_export import MANIFEST, dtype_name, export_hf

        out = export_hf(args.input, args.output, overwrite=args.overwrite, dtype=args.dtype,
                        max_shard_size=args.max_shard_size)
        print(f"wrote {out} ({dtype_name(args.dtype)}; verified, see {MANIFEST})", flush=True)
        distributed.shutdown()

    cli.run_reporting_errors(run)


if __name__ == "__main__":
    main()
