"""Evaluate a run's checkpoint: held-out perplexity beside the unigram baseline, or, with a cache of the
inference engine, the evaluation harness (perplexity, accuracy, KV bytes held, decode throughput).

    python launch/evaluate.py +recipe=base_tiny                       # the run's latest checkpoint
    python launch/evaluate.py +recipe=base_tiny checkpoint.resume=runs/base_tiny/checkpoints/iter_0000400
    python -m launch.evaluate +recipe=base_tiny                       # same, from an installed package
    python launch/evaluate.py +recipe=base_tiny eval.cache=h2o eval.budget=0.25 eval.max_sequences=64
    python launch/evaluate.py +recipe=dmc_tiny eval.cache=auto        # a DMC run with its own cache
    python launch/evaluate.py --compare runs/base_tiny/eval_full.json runs/base_tiny/eval_h2o_64.json

Writes <run_dir>/eval.json; with ``eval.cache`` (``auto`` = the checkpoint's own cache, ``full``, ``dmc``,
an eviction policy (a name of ``dmc_train.policies.POLICIES``) at ``eval.budget``,
``lightcache``, ``less``) <run_dir>/eval_<cache>[_<budget>].json and a markdown row (docs/EVALUATION.md).
``--compare`` prints the rows of several result files side by side (Δ against the first).

An imported checkpoint (``checkpoints_tools/import_hf.py``) needs no recipe: ``checkpoint.resume=<it>`` takes its
model, writes to ``runs/<its name>/`` and reads the held-out text in its own tokenizer
(``launch/prepare_data.py --tokenizer <it>/tokenizer``; ``dmc_train/evaluation/imported.py``). Without data
settings a checkpoint is evaluated on synthetic tokens only if it was trained on them.

    python launch/evaluate.py checkpoint.resume=runs/inits/smollm2 eval.cache=h2o train.seq_length=1024
"""

import sys

from dmc_train import cli


def evaluate_app(cfg) -> None:
    from dmc_train import distributed
    from dmc_train.evaluation.perplexity import evaluate_checkpoint

    def run():
        r = evaluate_checkpoint(cfg)
        if not distributed.is_rank0():
            return
        cache = f"; cache {r['cache']}, budget {r['budget']} ({r['schedule']})" if "cache" in r else ""
        print(f"checkpoint {r['checkpoint']} (step {r['step']}){cache}")
        if isinstance(r.get("test", r.get("valid")), dict):  # the harness: a table row
            from dmc_train.evaluation.report import markdown_table, run_name

            split = "test" if "test" in r else "valid"
            print(markdown_table([{**r, "name": run_name(r["checkpoint"])}], split))
        else:
            for split in ("valid", "test"):
                if f"{split}_ppl" in r:
                    uni = r.get(f"{split}_unigram_ppl")
                    cr = r.get(f"{split}_achieved_cr")
                    print(f"  {split}: loss {r[f'{split}_loss']:.4f}  perplexity {r[f'{split}_ppl']:.2f}"
                          + (f"  achieved CR {cr:.2f}" if cr else "")
                          + (f"  (unigram baseline {uni:.2f})" if uni else ""))

    cli.run_reporting_errors(run)
    distributed.shutdown()


def compare(paths: list[str]) -> None:
    from dmc_train.evaluation.report import load_result, markdown_table

    print(markdown_table([load_result(p) for p in paths]))


def main() -> None:
    if sys.argv[1:2] == ["--compare"]:
        if len(sys.argv) < 3:
            cli.fail("--compare needs result files: launch/evaluate.py --compare runs/a/eval_full.json ...")
        cli.run_reporting_errors(lambda: compare(sys.argv[2:]))
        return
    from dmc_train.evaluation.imported import imported_overrides

    sys.argv[1:] = cli.run_reporting_errors(lambda: imported_overrides(sys.argv[1:]))
    cli.hydra_main(evaluate_app)


if __name__ == "__main__":
    main()
