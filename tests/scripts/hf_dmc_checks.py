"""Record what the project computes for a trained tiny DMC checkpoint: eval logits of a batch, greedy
continuations of prompts (a full forward per step) and the number of cache slots per (layer, KV head)
that Algorithm 1 keeps for each sequence, and the inference engine's greedy tokens and slot counts
(the test exports it with ``checkpoints_tools/export_hf.py``).

    python tests/scripts/hf_dmc_checks.py <out.json> <run_dir>
"""

import json
import sys

import torch

PROMPT_LENGTHS = (9, 4, 13)
NEW_TOKENS = 16


def main(out_path: str, run_dir: str) -> None:
    from dmc_train import distributed
    from dmc_train.training.forward import logits
    from dmc_train.training.model_loading import load_model

    loaded = load_model(run_dir)
    model_cfg, chunk = loaded.cfg.model, loaded.model[0]

    alphas = {}  # layer -> hard alpha [b, groups, s] of the last forward
    for i, layer in enumerate(chunk.decoder.layers):
        handoff = layer.self_attention.handoff

        def put(value, _put=handoff.put, _i=i):
            if value is not None:
                alphas[_i] = value[0].detach().clone()
            _put(value)
        handoff.put = put

    vocab = model_cfg.vocab_size
    gen = torch.Generator().manual_seed(1)
    batch = torch.randint(0, vocab, (2, 24), generator=gen)
    res = {"batch": batch.tolist(), "logits": logits(loaded.model, batch).tolist(), "prompts": [], "greedy": [],
           "slots": [], "merge_fraction": []}
    for n in PROMPT_LENGTHS:
        seq = torch.randint(0, vocab, (n,), generator=gen)
        res["prompts"].append(seq.tolist())
        for _ in range(NEW_TOKENS):
            seq = torch.cat([seq, logits(loaded.model, seq[None])[0, -1].argmax()[None]])
        res["greedy"].append(seq[n:].tolist())
        logits(loaded.model, seq[None, :-1])  # the tokens generate() feeds through the model
        stacked = torch.stack([alphas[i][0] for i in range(len(alphas))])  # [layers, groups, s]
        res["slots"].append((stacked == 0).sum(-1).tolist())
        res["merge_fraction"].append((stacked == 1).double().mean().item())
    from dmc_train.inference import Engine, SamplingParams

    outs = Engine.from_checkpoint(run_dir).generate(res["prompts"], SamplingParams(max_new_tokens=NEW_TOKENS))
    res["engine_greedy"], res["engine_slots"] = [o.tokens for o in outs], [o.entries for o in outs]
    with open(out_path, "w") as f:
        json.dump(res, f)
    distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
