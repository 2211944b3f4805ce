"""Bytes one transformer layer saves for backward, measured with saved_tensors_hooks (1 CPU process).

    python tests/scripts/saved_activations.py <out.json> <hydra overrides...>

For bf16 and fp32, builds the model with 1 and 2 layers, runs one training-mode forward with labels
and sums the unique storages saved for backward (parameters excluded); the difference is one layer. Checks
dmc_train.cluster.memory.layer_activation_bytes against what the modules really keep, and what a DMC
layer keeps (``method=dmc``: the method's attention, at step 0) against a vanilla one.
"""

import json
import os
import sys


def saved_bytes(cfg) -> int:
    import torch

    from dmc_train import distributed
    from dmc_train.methods import build_method
    from dmc_train.models.llama import build_model

    distributed.initialize(1, 1, None, cfg.train.seed, 5)
    method = build_method(cfg)  # method=none: stock attention
    model = method.prepare_model(build_model(cfg, attention=method.attention()))[0]
    method.before_step(0, [model])
    model.train()
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    s, b = cfg.train.seq_length, cfg.train.micro_batch_size
    ids = torch.randint(0, cfg.model.vocab_size, (b, s))
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, pos, None, labels=ids)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in params)


def main(out_path: str, overrides: list[str]) -> None:
    from dmc_train.recipes import load_config

    result = {}
    for precision in ("bf16", "fp32"):
        one, two = (saved_bytes(load_config([*overrides, f"train.precision={precision}", f"model.num_layers={n}"]))
                    for n in (1, 2))
        result[precision] = two - one
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    main(sys.argv[1], sys.argv[2:])
