"""Checks of the Hugging Face importer, run in subprocesses (building megatron models installs the CPU
compatibility layer process-wide).

    python tests/scripts/hf_import_checks.py make <dir> <kind>            # tiny random HF Llama (+ tokenizer)
    python tests/scripts/hf_import_checks.py imports <out.json> <hf> <out> [<hf> <out> ...]
        import each at TP=1 and compare our logits with HF's on a ragged batch
    python tests/scripts/hf_import_checks.py errors <out.json> <case>=<hf dir> ...   # one-line errors
    torchrun --nproc_per_node=2 tests/scripts/hf_import_checks.py layouts <out.json> <ckpt> <hf> <run_dir>
        logits of the imported checkpoint at TP=1/TP=2/PP=2, load_hf_into_model's shards vs megatron's
        resharding at those layouts and PP=2+VPP=2, megatron's own save at TP=2 and PP=2 vs the import's
        .metadata, and a TP=2 training run with checkpoint.init_from=<hf>

Kinds: ``gqa`` (4 groups, untied, one safetensors file, HF tokenizer), ``mha_tied`` (MHA, tied
embeddings, sharded safetensors, sentencepiece ``tokenizer.model``), ``gqa_bin`` (sharded
``pytorch_model.bin`` + index, no tokenizer).
The tiny shapes are those of ``recipes/model/tiny.yaml`` so ``+recipe=tiny_pretrain`` fits them.
"""

import json
import os
import sys

import torch

PROMPT_LENGTHS = (11, 16, 5)  # a ragged batch, right-padded to 16


def make(path: str, kind: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed({"gqa": 0, "mha_tied": 1, "gqa_bin": 2}[kind])
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8 if kind == "mha_tied" else 4,
                         max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=kind == "mha_tied")
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # weights large enough for logits of order 1, norms away from 1
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    if kind == "gqa_bin":
        os.makedirs(path)
        config.save_pretrained(path)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        names = sorted(state)
        shards = {"pytorch_model-00001-of-00002.bin": names[: len(names) // 2],
                  "pytorch_model-00002-of-00002.bin": names[len(names) // 2:]}
        for shard, keys in shards.items():
            torch.save({k: state[k] for k in keys}, os.path.join(path, shard))
        with open(os.path.join(path, "pytorch_model.bin.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": {k: s for s, keys in shards.items() for k in keys}}, f)
    else:
        model.save_pretrained(path, max_shard_size="200KB" if kind == "mha_tied" else "50GB")
    if kind == "gqa":
        make_tokenizer(path, 300)
    if kind == "mha_tied":  # a sentencepiece tokenizer.model alone
        from dmc_train.data.tokenizer import train_sentencepiece

        docs = [" ".join(f"word{i % 50} token{i % 37} the quick brown fox" for i in range(j, j + 200))
                for j in range(0, 4000, 200)]
        train_sentencepiece(docs, os.path.join(path, "tokenizer.model"), 320)


def make_tokenizer(path: str, size: int) -> None:
    """A word-level HF tokenizer with ``size`` ids (``<unk>`` ``<s>`` ``</s>`` first)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", *[f"w{i}" for i in range(size - 3)]])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)


def ragged(vocab: int) -> tuple[torch.Tensor, list[int]]:
    s = max(PROMPT_LENGTHS)
    tokens = (torch.arange(len(PROMPT_LENGTHS) * s).reshape(-1, s) * 7919 + 11) % vocab
    for i, n in enumerate(PROMPT_LENGTHS):
        tokens[i, n:] = 0  # padding: causal attention keeps it out of the first n positions
    return tokens, list(PROMPT_LENGTHS)


@torch.no_grad()
def hf_logits(hf_dir: str, tokens: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    """HF logits of each sequence alone, without padding: ``[n_i, vocab]``."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, local_files_only=True).eval()
    return [model(input_ids=tokens[i: i + 1, :n]).logits[0] for i, n in enumerate(lengths)]


def max_diff(ours: torch.Tensor, theirs: list[torch.Tensor], lengths: list[int]) -> float:
    return max((ours[i, :n] - theirs[i]).abs().max().item() for i, n in enumerate(lengths))


def model_path_import(hf_dir: str, out: str, dtype: str) -> None:
    """The import as it was before streaming: the whole TP=1 model built, filled by load_hf_into_model
    and saved with save_weights (the files the streamed import must reproduce)."""
    from dmc_train import distributed
    from dmc_train.conversion.hf_import import hf_run_config
    from dmc_train.models.llama import build_model
    from dmc_train.training.checkpoint_save import save_weights
    from dmc_train.training.hf_loading import load_hf_into_model, read_hf_config

    cfg = hf_run_config(read_hf_config(hf_dir), dtype)
    distributed.initialize(1, 1, None, cfg.train.seed)
    chunks = build_model(cfg)
    load_hf_into_model(hf_dir, chunks, cfg)
    save_weights(cfg, chunks, out)


def compare_checkpoints(a: str, b: str) -> dict:
    """Same ``.metadata`` entries (keys, global shapes, dtypes, chunks) and bitwise equal tensors?"""
    from torch.distributed.checkpoint import FileSystemReader

    from dmc_train.training.streaming_checkpoint import CheckpointTensors, checkpoint_config

    meta_a, meta_b = (FileSystemReader(d).read_metadata().state_dict_metadata for d in (a, b))
    reader_a, reader_b = CheckpointTensors(a, checkpoint_config(a)), CheckpointTensors(b, checkpoint_config(b))
    names = list(reader_a.entries)
    ta, tb = reader_a.read(names), reader_b.read(names)
    return {"same_metadata": meta_a == meta_b, "keys": len(meta_a), "tensors": len(names),
            "unequal": [n for n in names if not (ta[n].dtype == tb[n].dtype and torch.equal(ta[n], tb[n]))],
            "dtypes": sorted({str(t.dtype) for t in tb.values()})}


def imports(out_path: str, *pairs: str) -> None:
    """Import each pair (streamed, verified); then, per model: our logits at TP=1 vs HF's on a ragged batch,
    the streamed files vs the model-based import's (fp32, and bf16 for the first), the layer-by-layer
    reference forward vs transformers, and the full verification (transformers vs our megatron model)."""
    from dmc_train.conversion import verification_tokens
    from dmc_train.conversion.hf_import import hf_fetch, import_hf, verify_import
    from dmc_train.models.llama_reference import streaming_logits
    from dmc_train.training.forward import logits
    from dmc_train.training.hf_loading import HFWeights, read_hf_config
    from dmc_train.training.model_loading import load_model

    res = {}
    for i, (hf_dir, out) in enumerate(zip(pairs[::2], pairs[1::2])):
        if not os.path.exists(os.path.join(out, "meta.json")):
            import_hf(hf_dir, out)
        loaded = load_model(out)
        tokens, lengths = ragged(loaded.cfg.model.vocab_size)
        ours = logits(loaded.model, tokens)
        theirs = hf_logits(hf_dir, tokens, lengths)
        kind = os.path.basename(hf_dir)
        res[kind] = {"max_diff": max_diff(ours, theirs, lengths),
                     "logit_scale": max(t.abs().max().item() for t in theirs),
                     "meta": {k: loaded.meta.get(k) for k in ("hf_source", "tie_word_embeddings", "tokenizer")},
                     "data_tokenizer": loaded.cfg.data.tokenizer}
        model_path_import(hf_dir, out + "_model_path", "fp32")
        res[kind]["model_path"] = compare_checkpoints(out + "_model_path", out)
        if i == 0:
            import_hf(hf_dir, out + "_bf16", dtype="bf16")
            model_path_import(hf_dir, out + "_bf16_model_path", "bf16")
            res[kind]["model_path_bf16"] = compare_checkpoints(out + "_bf16_model_path", out + "_bf16")
        m = loaded.cfg.model
        prompt = verification_tokens(m.vocab_size, m.max_position_embeddings)
        hf = read_hf_config(hf_dir)
        reference = streaming_logits(hf_fetch(HFWeights(hf_dir), bool(hf.get("tie_word_embeddings"))), m, prompt)
        transformers = hf_logits(hf_dir, prompt, [prompt.shape[1]] * prompt.shape[0])
        res[kind]["reference_vs_transformers"] = max((reference[j] - t).abs().max().item()
                                                     for j, t in enumerate(transformers))
        res[kind]["full_check"] = verify_import(hf_dir, out, verify="full")
    with open(out_path, "w") as f:
        json.dump(res, f)


def corrupt_tensor(ckpt: str, key: str, layer: int) -> None:
    """Flip bits in the middle of the stored bytes of one layer's chunk of ``key`` (a real on-disk
    corruption, found through the checkpoint's own ``.metadata``)."""
    from torch.distributed.checkpoint import FileSystemReader

    storage = FileSystemReader(ckpt).read_metadata().storage_data
    info = next(v for k, v in storage.items() if k.fqn == key and k.offset is not None and k.offset[0] == layer)
    with open(os.path.join(ckpt, info.relative_path), "r+b") as f:
        f.seek(info.offset + info.length // 2)
        data = f.read(8)
        f.seek(info.offset + info.length // 2)
        f.write(bytes(b ^ 0x40 for b in data))


def errors(out_path: str, *cases: str) -> None:
    from dmc_train import conversion
    from dmc_train.conversion import hf_import
    from dmc_train.errors import UserError

    res = {}
    fp32 = conversion.LOGIT_TOLERANCE["float32"]
    save_weights_streaming = hf_import.save_weights_streaming

    def corrupting(cfg, tensor_of, out, extra_meta):
        save_weights_streaming(cfg, tensor_of, out, extra_meta)
        corrupt_tensor(out, "decoder.layers.self_attention.linear_proj.weight", 2)

    def truncating(cfg, tensor_of, out, extra_meta):
        save_weights_streaming(cfg, tensor_of, out, extra_meta)
        for f in os.listdir(out):
            if f.endswith(".distcp"):
                os.truncate(os.path.join(out, f), 100)

    for case in cases:
        name, hf_dir = case.split("=", 1)
        out = hf_dir + "_out"
        # "verify": a good model with a tolerance no result meets, so the final logit check fails
        conversion.LOGIT_TOLERANCE["float32"] = -1.0 if name == "verify" else fp32
        # "corrupt": a good model whose written checkpoint gets one tensor corrupted before the verification
        # "truncated_written": its written shards are cut to 100 bytes before the verification reads them
        hf_import.save_weights_streaming = {"corrupt": corrupting, "truncated_written": truncating}.get(
            name, save_weights_streaming)
        try:
            hf_import.import_hf(hf_dir, out)
            res[name] = {"error": None}
        except UserError as e:
            res[name] = {"error": str(e), "type": type(e).__name__}
        parent = os.path.dirname(out)
        res[name]["left"] = sorted(f for f in os.listdir(parent) if f.startswith(os.path.basename(out)))
    with open(out_path, "w") as f:
        json.dump(res, f)


def checkpoint_layout_diff(a: str, b: str) -> dict:
    """How the ``.metadata`` of two checkpoints differ: keys, global shapes / dtypes, chunking."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    ma, mb = (FileSystemReader(d).read_metadata().state_dict_metadata for d in (a, b))
    tensors = [k for k, v in ma.items() if isinstance(v, TensorStorageMetadata)]
    return {"same_keys": sorted(ma) == sorted(mb), "keys": len(ma),
            "same_global_shapes": all(tuple(ma[k].size) == tuple(mb[k].size) and ma[k].properties.dtype
                                      == mb[k].properties.dtype for k in tensors),
            "same_chunks": all(ma[k].chunks == mb[k].chunks for k in tensors)}


def layouts(out_path: str, ckpt: str, hf_dir: str, run_dir: str) -> None:
    import torch.distributed as dist

    from dmc_train import distributed
    from dmc_train.models.llama import build_model
    from dmc_train.recipes import load_config
    from dmc_train.training.checkpoint_save import save_weights
    from dmc_train.training.forward import logits
    from dmc_train.training.hf_loading import load_hf_into_model
    from dmc_train.training.loop import Trainer
    from dmc_train.training.model_loading import load_model

    res = {}
    tokens, lengths = ragged(512)
    for name, overrides in (("tp1", []), ("tp2", ["parallel.tensor=2"]), ("pp2", ["parallel.pipeline=2"]),
                            ("pp2_vpp2", ["parallel.pipeline=2", "parallel.virtual_pipeline=2"])):
        loaded = load_model(ckpt, overrides)
        # forward.logits runs one micro-batch, which megatron's interleaved schedule refuses: no logits at VPP
        out = logits(loaded.model, tokens) if loaded.cfg.parallel.virtual_pipeline is None else None
        direct = build_model(loaded.cfg)  # the same layout filled straight from the HF directory
        load_hf_into_model(hf_dir, direct, loaded.cfg)
        shard_diff = max((a - b).abs().max().item() for x, y in zip(direct, loaded.model)
                         for a, b in zip(x.parameters(), y.parameters()))
        gathered = [None] * dist.get_world_size()
        params = sum(1 for c in direct for _ in c.parameters())
        dist.all_gather_object(gathered, (out.tolist() if out is not None else None, shard_diff, params))
        res[name] = {"logits": next((g[0] for g in gathered if g[0] is not None), None),
                     "shard_diff": max(g[1] for g in gathered), "params": [g[2] for g in gathered]}
        if name in ("tp2", "pp2"):  # saved by megatron at this layout: the same global tensors as the import?
            saved = f"{run_dir}_{name}_saved"
            save_weights(loaded.cfg, loaded.model, saved)
            if distributed.is_rank0():
                res[name]["saved_vs_import"] = checkpoint_layout_diff(saved, ckpt)
    cfg = load_config(["+recipe=tiny_pretrain", "model.num_query_groups=4", "parallel.tensor=2",
                       f"checkpoint.init_from={hf_dir}", f"run_dir={run_dir}", "train.max_steps=1",
                       "logging.progress=false", "checkpoint.save_at_end=false", "train.eval_interval=0"])
    trainer = Trainer(cfg)
    before = logits(trainer.model, tokens)
    metrics = trainer.train_step()
    res["train"] = {"logits": before.tolist(), "loss": metrics["lm_loss"]}
    if distributed.is_rank0():
        with open(out_path, "w") as f:
            json.dump(res, f)
    distributed.shutdown()


if __name__ == "__main__":
    {"make": make, "imports": imports, "errors": errors, "layouts": layouts}[sys.argv[1]](*sys.argv[2:])
