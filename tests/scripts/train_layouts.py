"""Train the tiny model for a few steps under several parallel layouts in one launch; write losses as JSON.

    torchrun --nproc_per_node=2 tests/scripts/train_layouts.py OUT.json tp2 pp2 vpp2 dp2_distopt
    python tests/scripts/train_layouts.py OUT.json ref dmc_ref  # single process references

Each layout's result: {"lm_loss": [...], "cr_loss": [...], "cr": [...], "cr_c_loss": [...]} per step
(None where absent) and, with DMC, "cr_heads": the last step's achieved CR per [layer][KV head].

Run by tests/test_parallel_equivalence.py.
"""

import json
import sys
import tempfile

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
DMC = ["method=dmc", "method.target_cr=2", "method.init_offset=0.5", "model.num_query_groups=4"]
LAYOUTS.update({f"dmc_{name}": DMC + LAYOUTS[name] for name in ("ref", "tp2", "pp2", "vpp2")})
# Variants whose sums cross ranks in other ways: DMC-C and DMC-HardC (means over the heads of a layer,
# split by TP), the released CR loss (per-sequence sums over all layers and heads) and the
# per-(layer, head) CR loss (indexed by the global layer, split by PP).
# rope_order=pre accumulates in DMCSelfAttention (before RoPE), on each rank's slice of KV heads.
VARIANTS = {"dmcc": ["method.variant=c"], "hardc": ["method.variant=hardc"], "released": ["method.cr_loss=released"],
            "per_layer_head": ["method.cr_loss=per_layer_head"], "pre": ["method.rope_order=pre"]}
for variant, extra in VARIANTS.items():
    LAYOUTS[f"{variant}_ref"] = DMC + extra
    LAYOUTS[f"{variant}_tp2"] = DMC + extra + ["parallel.tensor=2"]
    LAYOUTS[f"{variant}_pp2"] = DMC + extra + ["parallel.pipeline=2"]
COMMON = ["+recipe=tiny_pretrain", "train.max_steps=3", "train.eval_interval=0", "checkpoint.save_at_end=false",
          "checkpoint.resume=none", "logging.progress=false", "optim.warmup_steps=0"]


def main(out_path: str, names: list[str]) -> None:
    from dmc_train import distributed
    from dmc_train.methods.dmc import achieved_cr
    from dmc_train.recipes import load_config
    from dmc_train.training.loop import train

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            cfg = load_config(COMMON + LAYOUTS[name] + [f"run_dir={tmp}/{name}"])
            summary = train(cfg)
            results[name] = {key: [h.get(key) for h in summary["history"]]
                             for key in ("lm_loss", "cr_loss", "cr", "cr_c_loss")}
            stats = getattr(summary["trainer"].method, "last_stats", None)  # DMC: last step's per-head counts
            if stats is not None:
                results[name]["cr_heads"] = achieved_cr(stats)["achieved_cr_per_head"]
    if distributed.is_rank0():
        with open(out_path, "w") as f:
            json.dump(results, f)
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
