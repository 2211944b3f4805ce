"""One process: the inference forward and engine against the training model on real checkpoints.

    python tests/scripts/inference_checks.py <out.json> <run_dir> [<run_dir> ...]

Per run: the training model's logits (megatron-core, eval mode: DMC with hard decisions) on a batch
of sequences; the inference model's no-cache forward on them; the engine's cache fed each sequence
as a prompt prefix + teacher-forced decode steps in one ragged batch; the training model's
decisions per layer (Algorithm 1 slot counts) and the cache's entries.
"""

import json
import sys

import torch

LENGTHS, PROMPTS = 48, [9, 1, 30]


def main(out_path: str, *run_dirs: str) -> None:
    from dmc_train.inference.caches import DMCCache, FullCache
    from dmc_train.inference.model import LlamaForInference
    from dmc_train.inference.pool import PagePool
    from dmc_train.models.dmc.attention import DMCCoreAttention
    from dmc_train.training.forward import logits as training_logits
    from dmc_train.training.model_loading import load_model

    res = {}
    for run_dir in run_dirs:
        model, saved = LlamaForInference.from_checkpoint(run_dir)  # read from the files, no process group
        loaded = load_model(run_dir)  # the training model (megatron-core, TP=1 whatever layout saved it)
        s = model.shape
        tokens = (torch.arange(len(PROMPTS) * LENGTHS).reshape(len(PROMPTS), LENGTHS) * 7919 + 11) % s.vocab_size
        alphas = []
        for module in loaded.model[0].modules():
            if isinstance(module, DMCCoreAttention):
                module.register_forward_pre_hook(lambda m, args: alphas.append(m.handoff._value[0].clone()))
        train = training_logits(loaded.model, tokens)  # [b, n, V]
        forward = model.forward(tokens)
        pool = PagePool(512, 16, s.head_dim, 8 * s.num_layers * s.num_kv_heads, s.max_positions)
        cache = (DMCCache(pool, s.num_layers, s.num_kv_heads, model.scale, model.method.settings)
                 if model.decisions is not None
                 else FullCache(pool, s.num_layers, s.num_kv_heads, model.scale))
        steps = [[model.prefill(cache, i, tokens[i, :p])] for i, (p) in enumerate(PROMPTS) if cache.add(i) is None]
        for t in range(min(PROMPTS), LENGTHS):
            active = [i for i, p in enumerate(PROMPTS) if p <= t]
            out = model.decode(cache, active, tokens[active, t], torch.full((len(active),), t))
            for row, i in enumerate(active):
                steps[i].append(out[row: row + 1])
        cached = torch.stack([torch.cat(parts) for parts in steps])
        entry = {"method": saved.cfg.method.name,
                 "forward_vs_training": (forward - train).abs().max().item(),
                 "engine_vs_training": (cached - train).abs().max().item(),
                 "entries": torch.stack([cache.entries(i) for i in range(len(PROMPTS))]).tolist()}
        if alphas:  # [b, H_kv, n] per layer: Algorithm 1 slot counts
            entry["algorithm1"] = torch.stack([1 + (a[:, :, 1:] == 0).sum(-1) for a in alphas], dim=1).tolist()
        res[run_dir] = entry
    with open(out_path, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
