"""Time and peak memory per GB of weights of the Hugging Face import and export, measured in one run.

    python benchmarks/convert.py [--params 220M] [--hidden 1024] [--shard-size 200MB] [--keep DIR]

A synthetic Llama (``LlamaConfig``: hidden ``--hidden``, FFN 8/3 x hidden rounded to 256, heads of 64
channels, MHA, vocab 32000, untied embeddings; the layer count chosen so the model has about ``--params``
parameters; random weights) is saved with ``save_pretrained`` as sharded safetensors. Then, each in a
fresh process:

- ``python -m checkpoints_tools.import_hf --input <hf> --output <ours>`` (streaming: the checkpoint is
  written tensor by tensor without building the model, and verified by a layer-by-layer forward of the
  HF tensors against the written ones)
- the import's previous method, from the same library functions, for the comparison: the whole TP=1
  model built and filled (``load_hf_into_model``), ``save_weights``, then transformers' model against
  our reloaded one (``verify_import(verify="full")``)
- what ``checkpoint.init_from=<hf>`` does at TP=1: build the model, ``load_hf_into_model``
- ``python -m checkpoints_tools.export_hf --input <ours> --output <hf2>``

Both tools verify their output before publishing it, and neither has a switch to skip it, so the
verification is part of the measured cost. Three more fresh processes measure parts: the imports
alone (torch, transformers, megatron-core, dmc_train), ``LlamaForCausalLM.from_pretrained`` of the HF
directory plus one forward, and ``load_model`` of our checkpoint plus one forward (the export's
verification loads both).

Wall time is measured around each process (start-up included). Peak memory is the ``ru_maxrss`` that
``os.wait4`` returns for that one child: its maximum resident set, which counts the pages of the
memory-mapped safetensors shards it touched (while mapped) as well as its private memory; the last two
columns subtract the peak of the imports-only process (what scales with the model) and divide it by the
weights and by the largest tensor (the embedding) plus one layer, fp32. GB are 10^9 bytes; weights GB is
the fp32 size of all tensors in the safetensors files.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 32000
HEAD_DIM = 64
OLD = "import, whole-model method (before streaming)"


def parse_count(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMB]?)\s*", text.upper())
    if m is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count; use e.g. 220M, 1.5B or 300000000")
    return int(float(m.group(1)) * {"": 1, "K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9}[m.group(2)])


def llama_shape(params: int, hidden: int) -> dict:
    """LlamaConfig kwargs of about ``params`` parameters at ``hidden`` (at least one layer)."""
    ffn = int(round(8 * hidden / 3 / 256)) * 256
    per_layer = 4 * hidden * hidden + 3 * hidden * ffn + 2 * hidden
    layers = max(1, round((params - 2 * VOCAB * hidden - hidden) / per_layer))
    heads = max(1, hidden // HEAD_DIM)
    return dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=2048,
                rms_norm_eps=1e-5, tie_word_embeddings=False)


# ----------------------------------------------------------------------------------------------
# Child processes (python benchmarks/convert.py --child WHAT ...)
# ----------------------------------------------------------------------------------------------
def child_make(out: str, shape: dict, shard_size: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**shape))
    model.save_pretrained(out, max_shard_size=shard_size, safe_serialization=True)


def _tokens(vocab: int):
    import torch

    return (torch.arange(64).reshape(2, 32) * 7919 + 13) % vocab


def child_imports() -> None:
    import transformers  # noqa: F401

    import dmc_train.conversion.hf_export  # noqa: F401
    import dmc_train.conversion.hf_import  # noqa: F401
    import dmc_train.training.model_loading  # noqa: F401


def child_old_import(hf_dir: str, out: str) -> None:
    """The import as it was before streaming, from the same library functions: the whole TP=1 model
    built, filled by ``load_hf_into_model``, saved with ``save_weights``, then verified by transformers'
    model against our reloaded one (``verify_import(verify="full")``)."""
    child_imports()
    from dmc_train import distributed
    from dmc_train.conversion.hf_import import hf_run_config, verify_import
    from dmc_train.models.llama import build_model
    from dmc_train.training.checkpoint_save import save_weights
    from dmc_train.training.hf_loading import load_hf_into_model, read_hf_config

    cfg = hf_run_config(read_hf_config(hf_dir))
    distributed.initialize(1, 1, None, cfg.train.seed)
    chunks = build_model(cfg)
    load_hf_into_model(hf_dir, chunks, cfg)
    save_weights(cfg, chunks, out)
    del chunks
    verify_import(hf_dir, out, verify="full")
    distributed.shutdown()


def child_init_from(hf_dir: str) -> None:
    """What ``checkpoint.init_from=<HF dir>`` does in a run at TP=1: build the model, fill it from the shards."""
    child_imports()
    from dmc_train import distributed
    from dmc_train.conversion.hf_import import hf_run_config
    from dmc_train.models.llama import build_model
    from dmc_train.training.hf_loading import load_hf_into_model, read_hf_config

    cfg = hf_run_config(read_hf_config(hf_dir))
    distributed.initialize(1, 1, None, cfg.train.seed)
    load_hf_into_model(hf_dir, build_model(cfg), cfg)
    distributed.shutdown()


def child_hf_load(hf_dir: str) -> None:
    child_imports()
    import torch
    from transformers import LlamaForCausalLM

    t = time.perf_counter()
    model = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, local_files_only=True).eval()
    loaded = time.perf_counter()
    with torch.no_grad():
        model(input_ids=_tokens(model.config.vocab_size), use_cache=False)
    print(json.dumps({"load_s": loaded - t, "forward_s": time.perf_counter() - loaded}))


def child_our_load(ckpt: str) -> None:
    child_imports()
    from dmc_train import distributed
    from dmc_train.training.forward import logits
    from dmc_train.training.model_loading import load_model

    t = time.perf_counter()
    loaded = load_model(ckpt)
    done = time.perf_counter()
    logits(loaded.model, _tokens(loaded.cfg.model.vocab_size))
    print(json.dumps({"load_s": done - t, "forward_s": time.perf_counter() - done}))
    distributed.shutdown()


# ----------------------------------------------------------------------------------------------
# Parent
# ----------------------------------------------------------------------------------------------
def measure(cmd: list[str], workdir: str, name: str) -> dict:
    """Run ``cmd`` in a fresh process; its wall time, its own peak RSS (bytes) and its stdout."""
    out_path, err_path = os.path.join(workdir, f"{name}.out"), os.path.join(workdir, f"{name}.err")
    with open(out_path, "w") as out, open(err_path, "w") as err:
        t = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t
    proc.returncode = os.waitstatus_to_exitcode(status)
    with open(out_path) as f:
        stdout = f.read()
    if proc.returncode != 0:
        with open(err_path) as f:
            sys.exit(f"error: {' '.join(cmd)} failed ({proc.returncode}):\n{f.read()[-3000:]}")
    return {"s": wall, "rss": usage.ru_maxrss * 1024, "stdout": stdout}


def tensor_bytes(path: str) -> int:
    """Bytes of the tensors of one safetensors file (from its header)."""
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")


def self_cmd(*args: str) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), *args]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=parse_count, default=parse_count("220M"),
                    help="approximate parameter count of the synthetic Llama (default 220M)")
    ap.add_argument("--hidden", type=int, default=1024, help="hidden size (default 1024)")
    ap.add_argument("--shard-size", default="200MB", help="max_shard_size of save_pretrained (default 200MB)")
    ap.add_argument("--keep", default=None, help="work in this new directory and keep it (default: a temp dir)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--path", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    shape = llama_shape(args.params, args.hidden)

    if args.child == "make":
        return child_make(args.path, shape, args.shard_size)
    if args.child == "imports":
        return child_imports()
    if args.child == "old_import":
        return child_old_import(args.path, args.path + "_old_import")
    if args.child == "init_from":
        return child_init_from(args.path)
    if args.child == "hf_load":
        return child_hf_load(args.path)
    if args.child == "our_load":
        return child_our_load(args.path)

    if args.keep:
        os.makedirs(args.keep)
    work = args.keep or tempfile.mkdtemp(prefix="bench_convert_")
    hf, ours, hf2 = (os.path.join(work, n) for n in ("hf", "ours", "hf2"))
    try:
        shape_args = ["--params", str(args.params), "--hidden", str(args.hidden), "--shard-size", args.shard_size]
        make = measure(self_cmd("--child", "make", "--path", hf, *shape_args), work, "make")
        shards = [os.path.join(hf, n) for n in os.listdir(hf) if n.endswith(".safetensors")]
        weights = sum(tensor_bytes(p) for p in shards) / 1e9
        rows = {
            "imports only (torch, transformers, megatron, dmc_train)": measure(self_cmd("--child", "imports"),
                                                                               work, "imports"),
            "import_hf (whole tool)": measure([sys.executable, "-m", "checkpoints_tools.import_hf", "--input", hf,
                                               "--output", ours], work, "import"),
            OLD: measure(self_cmd("--child", "old_import", "--path", hf, *shape_args), work, "old_import"),
            "init_from=<HF dir> (build + load_hf_into_model, TP=1)": measure(
                self_cmd("--child", "init_from", "--path", hf, *shape_args), work, "init_from"),
            "export_hf (whole tool)": measure([sys.executable, "-m", "checkpoints_tools.export_hf", "--input", ours,
                                               "--output", hf2], work, "export"),
            "HF from_pretrained + forward": measure(self_cmd("--child", "hf_load", "--path", hf), work, "hf_load"),
            "our load_model + forward": measure(self_cmd("--child", "our_load", "--path", ours), work, "our_load"),
        }
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    n_params = int(weights * 1e9 / 4)
    print(f"synthetic Llama: {shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, "
          f"ffn {shape['intermediate_size']}, {shape['num_attention_heads']} heads (MHA), vocab {VOCAB}, untied; "
          f"{n_params / 1e6:.0f}M parameters, {weights:.3f} GB fp32 in {len(shards)} safetensors shards "
          f"(built and saved in {make['s']:.1f} s)")
    floor = rows["imports only (torch, transformers, megatron, dmc_train)"]["rss"] / 1e9
    h, f = shape["hidden_size"], shape["intermediate_size"]
    largest = 4 * VOCAB * h / 1e9  # the embedding (and lm_head), fp32
    layer = 4 * (4 * h * h + 3 * h * f + 2 * h) / 1e9
    unit = largest + layer
    print(f"largest tensor {largest:.3f} GB + one layer {layer:.3f} GB = {unit:.3f} GB")
    print(f"{'what':<56} {'weights GB':>10} {'s':>7} {'s/GB':>7} {'peak RSS GB':>12} {'RSS/weights':>12} "
          f"{'(RSS-imports)/weights':>22} {'(RSS-imports)/(largest+layer)':>30}")
    for name, r in rows.items():
        rss = r["rss"] / 1e9
        print(f"{name:<56} {weights:>10.3f} {r['s']:>7.1f} {r['s'] / weights:>7.1f} {rss:>12.2f} "
              f"{rss / weights:>11.2f}x {(rss - floor) / weights:>21.2f}x {(rss - floor) / unit:>29.2f}x")
    new, old = rows["import_hf (whole tool)"], rows[OLD]
    above = (new["rss"] / 1e9 - floor) / (old["rss"] / 1e9 - floor)
    print(f"\nimport, streaming vs whole-model method: peak RSS {new['rss'] / 1e9:.2f} vs {old['rss'] / 1e9:.2f} GB "
          f"({new['rss'] / old['rss']:.2f}x; above the imports {above:.2f}x), "
          f"time {new['s']:.1f} vs {old['s']:.1f} s ({new['s'] / old['s']:.2f}x)")

    base = rows["imports only (torch, transformers, megatron, dmc_train)"]["s"]
    hf_in = json.loads(rows["HF from_pretrained + forward"]["stdout"].strip().splitlines()[-1])
    our_in = json.loads(rows["our load_model + forward"]["stdout"].strip().splitlines()[-1])
    hf_part, our_part = hf_in["load_s"] + hf_in["forward_s"], our_in["load_s"] + our_in["forward_s"]
    exp = rows["export_hf (whole tool)"]["s"]
    print(f"\nparts (timed inside the processes): HF from_pretrained {hf_in['load_s']:.1f} s + forward "
          f"{hf_in['forward_s']:.1f} s; our load_model {our_in['load_s']:.1f} s + forward {our_in['forward_s']:.1f} s; "
          f"start-up (imports) {base:.1f} s")
    print(f"export: HF reload (verification) ~{hf_part:.1f} s of {exp:.1f} s ({hf_part / exp:.0%}); loading ours "
          f"~{our_part:.1f} s ({our_part / exp:.0%}); start-up ~{base / exp:.0%}; the rest "
          f"(~{exp - hf_part - our_part - base:.1f} s) is writing the shards")
    print("neither tool can skip its verification (no flag); peak RSS of the whole tools vs one model loaded "
          f"alone: import {rows['import_hf (whole tool)']['rss'] / 1e9:.2f} GB (streaming), export "
          f"{rows['export_hf (whole tool)']['rss'] / 1e9:.2f} GB, HF model alone "
          f"{rows['HF from_pretrained + forward']['rss'] / 1e9:.2f} GB, ours alone "
          f"{rows['our load_model + forward']['rss'] / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
