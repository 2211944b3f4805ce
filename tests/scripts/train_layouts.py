"""Train the tiny model for a few steps under several parallel layouts in one launch; write losses as JSON.

    torchrun --nproc_per_node=2 tests/scripts/train_layouts.py OUT.json tp2 pp2 vpp2 dp2_distopt
    python tests/scripts/train_layouts.py OUT.json ref dmc_ref  # single process references

Each layout's result: {"lm_loss": [...], "cr_loss": [...], "cr": [...]} per step (None where absent).

Run by tests/test_parallel_equivalence.py.
"""

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

LAYOUTS = {
    "ref": [],
    "tp2": ["parallel.tensor=2"],
    "tp2_sp": ["parallel.tensor=2", "parallel.sequence_parallel=true"],
    "pp2": ["parallel.pipeline=2"],
    "vpp2": ["parallel.pipeline=2", "parallel.virtual_pipeline=2"],
    "dp2": [],
    "dp2_distopt": ["parallel.distributed_optimizer=true"],
}
# DMC at a fixed target CR of 2 from the first step (the CR hinge is active, so its gradient flows),
# with a small logit offset so that decisions vary; GQA (4 KV heads) so omega averages a group.
DMC = ["method.name=dmc", "dmc.target_cr=2", "dmc.init_offset=0.5", "model.num_query_groups=4"]
LAYOUTS.update({f"dmc_{name}": DMC + LAYOUTS[name] for name in ("ref", "tp2", "pp2", "vpp2")})
COMMON = ["+recipe=tiny_pretrain", "train.max_steps=3", "train.eval_interval=0", "checkpoint.save_at_end=false",
          "checkpoint.resume=none", "logging.progress=false", "optim.warmup_steps=0"]


def main(out_path: str, names: list[str]) -> None:
    from dmc_train import distributed
    from dmc_train.config import load_config
    from dmc_train.training.loop import train

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            cfg = load_config(COMMON + LAYOUTS[name] + [f"run_dir={tmp}/{name}"])
            summary = train(cfg)
            results[name] = {key: [h.get(key) for h in summary["history"]] for key in ("lm_loss", "cr_loss", "cr")}
    if distributed.is_rank0():
        with open(out_path, "w") as f:
            json.dump(results, f)
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
