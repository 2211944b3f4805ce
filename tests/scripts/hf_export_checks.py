"""Hugging Face export checks in one process; writes the observations as JSON for the test to assert.

    python tests/scripts/hf_export_checks.py OUT.json WORKDIR

- mha, gqa: a tiny model trained 2 steps, exported (fp32, small shards); reloaded with
  LlamaForCausalLM: logits on ragged prompts (right-padded batch) against ours, greedy generate
  (left-padded batch) against greedy decoding with our model (full forward per step).
- roundtrip_untied / roundtrip_tied: a random HF Llama -> hf_to_megatron -> save_weights -> export:
  every tensor bitwise equal to the original, tie_word_embeddings preserved. The untied one names a
  sentencepiece tokenizer (data.tokenizer): AutoTokenizer loads the export's and encodes as ours.
"""

import json
import os
import sys

import torch

COMMON = ["+recipe=tiny_pretrain", "train.max_steps=2", "train.eval_interval=0", "logging.progress=false",
          "checkpoint.save_interval=0"]
PROMPT_LENGTHS = (5, 17, 32)
NEW_TOKENS = 8


def prompts(vocab):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g) for n in PROMPT_LENGTHS]


def ours_greedy(model, prompt):
    from dmc_train.training.forward import logits

    tokens = prompt.clone()
    for _ in range(NEW_TOKENS):
        nxt = logits(model, tokens[None])[0, -1].argmax()
        tokens = torch.cat([tokens, nxt[None]])
    return tokens[len(prompt):].tolist()


def compare_with_hf(run_dir, out):
    from transformers import LlamaForCausalLM

    from dmc_train.training.forward import logits
    from dmc_train.training.model_loading import load_model

    loaded = load_model(run_dir)
    hf = LlamaForCausalLM.from_pretrained(out, local_files_only=True).eval()
    ps = prompts(loaded.cfg.model.vocab_size)
    longest = max(PROMPT_LENGTHS)
    right = torch.zeros(len(ps), longest, dtype=torch.long)
    left = torch.zeros_like(right)
    right_mask, left_mask = torch.zeros_like(right), torch.zeros_like(right)
    for i, p in enumerate(ps):
        right[i, :len(p)], right_mask[i, :len(p)] = p, 1
        left[i, longest - len(p):], left_mask[i, longest - len(p):] = p, 1
    with torch.no_grad():
        theirs = hf(input_ids=right, attention_mask=right_mask).logits
        generated = hf.generate(input_ids=left, attention_mask=left_mask, max_new_tokens=NEW_TOKENS,
                                do_sample=False, pad_token_id=0)[:, longest:]
    diff = max(float((theirs[i, :len(p)] - logits(loaded.model, p[None])[0]).abs().max()) for i, p in enumerate(ps))
    with open(os.path.join(out, "manifest.json")) as f:
        manifest = json.load(f)
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        shards = len(set(json.load(f)["weight_map"].values()))
    return {"max_logit_diff": diff, "hf_tokens": generated.tolist(),
            "our_tokens": [ours_greedy(loaded.model, p) for p in ps], "manifest": manifest, "shards": shards,
            "files": sorted(os.listdir(out)), "config": json.load(open(os.path.join(out, "config.json")))}


TEXTS = ["To be, or not to be, that is the question:", " Whether 'tis nobler in the mind to suffer\n",
         "  The slings and arrows of outrageous fortune 1604", "naïve café, 日本語"]


def sentencepiece_model(work):
    from dmc_train.data.tokenizer import train_sentencepiece

    docs = [" ".join(TEXTS) * 5, "Or to take arms against a sea of troubles\nAnd by opposing end them.\n" * 5] * 10
    return train_sentencepiece(docs, f"{work}/sp/tokenizer.model", vocab_size=320).path


def tokenizer_facts(out, sp_path):
    from transformers import AutoTokenizer

    from dmc_train.data.tokenizer import load_tokenizer

    ours, theirs = load_tokenizer(sp_path), AutoTokenizer.from_pretrained(out, local_files_only=True)
    generation = json.load(open(os.path.join(out, "generation_config.json")))
    return {"same_ids": all(ours.encode(t) == theirs.encode(t, add_special_tokens=False) for t in TEXTS),
            "same_text": all(theirs.decode(ours.encode(t)) == t for t in TEXTS),
            "eos": [ours.eos_id, theirs.eos_token_id, generation.get("eos_token_id")]}


def round_trip(work, name, tie, tokenizer=None):
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from dmc_train import distributed
    from dmc_train.conversion.hf_export import export_hf
    from dmc_train.models.hf_config import model_config_from_hf
    from dmc_train.models.llama import build_model
    from dmc_train.models.llama_weights import hf_to_megatron
    from dmc_train.recipes import load_config
    from dmc_train.training.checkpoint_save import save_weights

    torch.manual_seed(1)
    hf_cfg = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
                         rms_norm_eps=1e-6, rope_theta=500000.0, tie_word_embeddings=tie)
    original = {k: v.clone() for k, v in LlamaForCausalLM(hf_cfg).state_dict().items()}
    node = model_config_from_hf(hf_cfg.to_dict(), name=name)
    rope = node.pop("rope_scaling")  # a node of its own: set field by field
    cfg = load_config(["+recipe=tiny_pretrain", f"run_dir={work}/{name}_run", f"data.tokenizer={tokenizer or 'null'}",
                       *[f"model.{k}={'null' if v is None else v}" for k, v in node.items()],
                       *[f"model.rope_scaling.{k}={v}" for k, v in rope.items()]])
    distributed.initialize(1, 1, None, cfg.train.seed)
    chunk = build_model(cfg)[0]
    stored = {k: v for k, v in original.items() if not (tie and k == "lm_head.weight")}  # tied: one matrix
    missing, unexpected = chunk.load_state_dict(hf_to_megatron(stored, 8, 2), strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    ckpt = save_weights(cfg, [chunk], f"{work}/{name}_ckpt")
    out = export_hf(ckpt, f"{work}/{name}_hf", max_shard_size="50KB")
    exported = {}
    for f in sorted(os.listdir(out)):
        if f.endswith(".safetensors"):
            exported.update(load_file(os.path.join(out, f)))
    expected = {k: v for k, v in original.items() if not (tie and k == "lm_head.weight")}
    return {"tokenizer": tokenizer_facts(out, tokenizer) if tokenizer else None,
            "files": sorted(os.listdir(out)),
            "names_equal": sorted(exported) == sorted(expected),
            "bitwise_equal": all(torch.equal(exported[k], v) for k, v in expected.items() if k in exported),
            "config_tie": json.load(open(os.path.join(out, "config.json")))["tie_word_embeddings"]}


def failed_verification(run_dir, work):
    """export() with a loader that cannot load / a model whose weights were altered: one-line
    CheckpointError, and neither the output nor its temporary directory left."""
    from dmc_train.conversion import load_llama
    from dmc_train.conversion.hf_export import export
    from dmc_train.errors import CheckpointError
    from dmc_train.training.model_loading import load_model

    def broken(directory):
        raise OSError("simulated failure\nsecond line")

    def altered(directory):
        model = load_llama(directory)
        with torch.no_grad():
            model.model.layers[0].self_attn.k_proj.weight.mul_(-1.0)
        return model

    res = {}
    loaded = load_model(run_dir)
    for name, loader in (("load_error", broken), ("logits_differ", altered)):
        out = f"{work}/failed_{name}"
        try:
            export(loaded, out, loader=loader)
            res[name] = {"error": None}
        except CheckpointError as e:
            res[name] = {"error": str(e)}
        res[name]["left"] = os.path.exists(out) or os.path.exists(out + ".tmp")
    return res


def main(out_path: str, work: str) -> None:
    from dmc_train import distributed
    from dmc_train.conversion.hf_export import export_hf
    from dmc_train.recipes import load_config
    from dmc_train.training.loop import train

    res = {}
    for name, extra in (("mha", []), ("gqa", ["model.num_query_groups=4"])):
        run_dir = f"{work}/{name}"
        train(load_config([*COMMON, *extra, f"run_dir={run_dir}"]))
        out = export_hf(run_dir, f"{work}/{name}_hf", max_shard_size="100KB")
        res[name] = compare_with_hf(run_dir, out)
    res["failed"] = failed_verification(f"{work}/mha", work)
    res["roundtrip_untied"] = round_trip(work, "rt_untied", tie=False, tokenizer=sentencepiece_model(work))
    res["roundtrip_tied"] = round_trip(work, "rt_tied", tie=True)
    with open(out_path, "w") as f:
        json.dump(res, f)
    distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
