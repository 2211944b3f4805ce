"""Llama 3.x RoPE scaling end to end, in one process (megatron's CPU layer stays out of pytest):

    python tests/scripts/rope_scaling_checks.py <out.json> <work dir>

- ``llama3`` / ``linear``: a tiny random Llama built by transformers with that ``rope_parameters``
  (head_dim 16, so the llama3 frequencies fall in all three bands) is imported with
  ``checkpoints_tools``' default streaming verification; our megatron model's logits on 96 tokens
  (past ``original_max_position_embeddings`` = 32) against transformers'; the frequencies megatron's
  RoPE uses; the inference engine's forward against transformers' and (llama3) its greedy tokens against
  transformers' ``generate``; the same model
  without scaling (how far off the unscaled RoPE is); the export back to a ``LlamaForCausalLM``
  directory, whose transformers logits must equal ours.
- ``mixed``: the llama3 directory with the hand-edited ``config.json`` of the issue (``rope_parameters``
  of type default with theta 500000 next to a llama3 ``rope_scaling``), which transformers reads as
  llama3 with theta 10000 (``rope_scaling`` replaces ``rope_parameters``): imported and compared likewise.
- ``megatron_llama31``: megatron-core's own ``rope_scaling=True`` frequencies against the project's.
- ``dmc``: a tiny DMC model (``rope_order=pre``, llama3 scaling over 16 original positions) trained 2
  steps, exported (the exporter checks the ``trust_remote_code`` model's logits against ours), its
  cached greedy ``generate`` against the engine's DMC cache, and the engine's teacher-forced forward
  against the training model over 64 positions.
"""

import json
import os
import shutil
import sys

import torch

SEQ = 96
ORIGINAL = 32
SCALING = {
    "llama3": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
}
MIXED = {"rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
         "rope_scaling": {k: v for k, v in SCALING["llama3"].items() if k != "rope_theta"}}
DMC_TRAIN = ["+recipe=tiny_pretrain", "method=dmc", "method.init_offset=0.0", "method.rope_order=pre",
             "model.num_query_groups=4", "train.max_steps=2", "logging.progress=false",
             "model.rope_scaling={type:llama3,factor:4.0,original_max_position_embeddings:16}"]


def make(path: str, kind: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         rms_norm_eps=1e-5, rope_parameters=dict(SCALING[kind]))
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # logits of order 1 and more: differences show
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    model.save_pretrained(path)


def hf_model(path: str, remote: bool = False):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    if remote:
        return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, local_files_only=True).eval()
    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()


def prompt(vocab: int, n: int, rows: int = 2) -> torch.Tensor:
    return (torch.arange(rows * n).reshape(rows, n) * 7919 + 11) % vocab


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """check_logits' measure: max |a - b| / max(1, max |b|)."""
    return float((a - b).abs().max()) / max(1.0, float(b.abs().max()))


@torch.no_grad()
def hf_greedy(model, prompts: list[list[int]], new: int) -> list[list[int]]:
    return [model.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def engine_greedy(model, prompts: list[list[int]], new: int) -> list[list[int]]:
    from dmc_train.inference import Engine, SamplingParams

    return [o.tokens for o in Engine(model).generate(prompts, SamplingParams(max_new_tokens=new))]


@torch.no_grad()
def plain(hf_dir: str, out: str, work: str, greedy: bool) -> dict:
    """Import (streaming verification), logits, megatron's frequencies, engine greedy, export."""
    import dataclasses

    from dmc_train.config import RopeScalingConfig
    from dmc_train.conversion.hf_export import export_hf
    from dmc_train.conversion.hf_import import import_hf
    from dmc_train.inference.model import LlamaForInference
    from dmc_train.models.rope import model_inv_freq
    from dmc_train.training.forward import logits
    from dmc_train.training.model_loading import load_model

    import_hf(hf_dir, out)
    loaded = load_model(out)
    m = loaded.cfg.model
    tokens = prompt(m.vocab_size, SEQ)
    theirs_model = hf_model(hf_dir)
    theirs = theirs_model(tokens).logits
    ours = logits(loaded.model, tokens).float()
    res = {"rope_scaling": dict(m.rope_scaling), "rotary_base": m.rotary_base,
           "import_vs_transformers": rel(ours, theirs), "logit_scale": float(theirs.abs().max()),
           "past_original": rel(ours[:, ORIGINAL:], theirs[:, ORIGINAL:]),
           "megatron_inv_freq_equal": bool(torch.equal(loaded.model[0].rotary_pos_emb.inv_freq, model_inv_freq(m))),
           "transformers_inv_freq_equal": bool(torch.equal(theirs_model.model.rotary_emb.inv_freq,
                                                           model_inv_freq(m)))}
    engine, _ = LlamaForInference.from_checkpoint(out)
    res["engine_forward_vs_transformers"] = rel(engine.forward(tokens), theirs)
    unscaled = LlamaForInference(dataclasses.replace(engine.shape, rope_scaling=RopeScalingConfig()),
                                 theirs_model.state_dict())  # the same weights, unscaled RoPE
    res["unscaled_vs_transformers"] = rel(unscaled.forward(tokens), theirs)
    if greedy:  # 10 + 30 tokens: past the original positions
        prompts = [tokens[0, :10].tolist(), tokens[1, :7].tolist()]
        res["engine_greedy"] = engine_greedy(engine, prompts, 30)
        res["hf_greedy"] = hf_greedy(theirs_model, prompts, 30)
    back = os.path.join(work, os.path.basename(hf_dir) + "_export")
    export_hf(out, back)
    with open(os.path.join(back, "config.json")) as f:
        res["exported_rope_parameters"] = json.load(f)["rope_parameters"]
    res["export_vs_ours"] = rel(hf_model(back)(tokens).logits, ours)
    with open(os.path.join(back, "manifest.json")) as f:
        res["export_verification"] = json.load(f)["verification"]
    return res


@torch.no_grad()
def mixed(hf_dir: str, out: str) -> dict:
    from dmc_train.conversion.hf_import import import_hf
    from dmc_train.training.forward import logits
    from dmc_train.training.model_loading import load_model

    import_hf(hf_dir, out)
    loaded = load_model(out)
    m = loaded.cfg.model
    tokens = prompt(m.vocab_size, SEQ)
    theirs_model = hf_model(hf_dir)
    return {"rope_scaling": dict(m.rope_scaling), "rotary_base": m.rotary_base,
            "transformers_rope_parameters": dict(theirs_model.config.rope_parameters),
            "import_vs_transformers": rel(logits(loaded.model, tokens).float(), theirs_model(tokens).logits)}


def megatron_llama31() -> dict:
    """megatron-core's own llama3 switch (``rope_scaling=True``, low / high / original fixed at 1 / 4 / 8192)
    against the project's function with those parameters (Llama 3.1 8B's and 3.2 1B's heads)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from dmc_train.config import RopeScalingConfig
    from dmc_train.models.rope import rope_inv_freq

    out = {}
    for head_dim, factor in ((128, 8.0), (64, 32.0)):
        theirs = RotaryEmbedding(head_dim, 1.0, rotary_base=500000, rope_scaling=True, rope_scaling_factor=factor,
                                 use_cpu_initialization=True).inv_freq
        ours = rope_inv_freq(head_dim, 500000.0, RopeScalingConfig("llama3", factor, 1.0, 4.0, 8192))
        out[f"{head_dim}_{factor}"] = bool(torch.equal(theirs, ours))
    return out


def dmc(run_dir: str, hf_dir: str) -> dict:
    from dmc_train.conversion.hf_export import export_hf
    from dmc_train.inference.model import LlamaForInference
    from dmc_train.recipes import load_config
    from dmc_train.training.forward import logits
    from dmc_train.training.loop import train
    from dmc_train.training.model_loading import load_model

    train(load_config([*DMC_TRAIN, f"run_dir={run_dir}"]))
    torch.set_grad_enabled(False)
    export_hf(run_dir, hf_dir)
    loaded = load_model(run_dir)
    m = loaded.cfg.model
    tokens = prompt(m.vocab_size, 64)
    ours = logits(loaded.model, tokens).float()
    engine, _ = LlamaForInference.from_checkpoint(run_dir)
    model = hf_model(hf_dir, remote=True)
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    prompts = [tokens[0, :9].tolist(), tokens[1, :5].tolist()]  # + 24 tokens: past the 16 original positions
    return {"config": {k: config[k] for k in ("model_type", "dmc_rope_order", "rope_parameters")},
            "export_verification": json.load(open(os.path.join(hf_dir, "manifest.json")))["verification"],
            "remote_vs_ours": rel(model(tokens, use_cache=False).logits, ours),
            "engine_forward_vs_ours": rel(engine.forward(tokens), ours),
            "hf_greedy": hf_greedy(model, prompts, 24), "engine_greedy": engine_greedy(engine, prompts, 24)}


def main(out_path: str, work: str) -> None:
    import time

    from dmc_train import distributed

    res, start = {"seconds": {}}, time.time()
    for kind in SCALING:
        make(os.path.join(work, kind), kind)
        res[kind] = plain(os.path.join(work, kind), os.path.join(work, kind + "_ckpt"), work, kind == "llama3")
        res["seconds"][kind] = time.time() - start
    mixed_dir = os.path.join(work, "mixed")
    shutil.copytree(os.path.join(work, "llama3"), mixed_dir)
    with open(os.path.join(mixed_dir, "config.json")) as f:
        config = json.load(f)
    config.pop("rope_parameters")
    with open(os.path.join(mixed_dir, "config.json"), "w") as f:
        json.dump({**config, **MIXED}, f)
    res["mixed"] = mixed(mixed_dir, os.path.join(work, "mixed_ckpt"))
    res["megatron_llama31"] = megatron_llama31()
    res["seconds"]["mixed"] = time.time() - start
    res["dmc"] = dmc(os.path.join(work, "dmc_run"), os.path.join(work, "dmc_hf"))
    res["seconds"]["dmc"] = time.time() - start
    with open(out_path, "w") as f:
        json.dump(res, f)
    distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
