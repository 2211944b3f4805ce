"""Under torchrun (2 ranks): load a checkpoint model-only at TP=1 (x DP=2) and at TP=2, and return
the logits of a fixed batch for both, plus what was built (eval mode, no optimizer state).

    torchrun --nproc_per_node=2 tests/scripts/model_loading_checks.py <out.json> <run_dir>
"""

import json
import sys

import torch


def main(out_path: str, run_dir: str) -> None:
    from dmc_train import distributed
    from dmc_train.training.forward import logits
    from dmc_train.training.model_loading import load_model

    res = {}
    for name, overrides in (("tp1", []), ("tp2", ["parallel.tensor=2"])):
        loaded = load_model(run_dir, overrides)
        tokens = torch.arange(32).reshape(2, 16) * 7 % loaded.cfg.model.vocab_size
        out = logits(loaded.model, tokens)
        res[name] = {"logits": out.tolist(), "training": any(c.training for c in loaded.model),
                     "method": loaded.cfg.method.name, "step": loaded.meta["step"],
                     "attention": type(loaded.model[0].decoder.layers[0].self_attention).__name__}
    if distributed.is_rank0():
        with open(out_path, "w") as f:
            json.dump(res, f)
    distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
