"""Evaluate a run's checkpoint: held-out perplexity (valid/test) beside the unigram baseline.

    python launch/evaluate.py +recipe=base_tiny                       # the run's latest checkpoint
    python launch/evaluate.py +recipe=base_tiny checkpoint.resume=runs/base_tiny/checkpoints/iter_0000400
    python -m launch.evaluate +recipe=base_tiny                       # same, from an installed package
    python launch/evaluate.py +recipe=base_tiny eval.cache=h2o eval.budget=0.25 eval.max_sequences=64

Writes <run_dir>/eval.json; with an eviction policy (``eval.cache``: h2o, tova, streaming_llm, keyformer,
lsh_e, knorm) the perplexity of decoding every sequence token by token at ``eval.budget`` entries per
(sequence, layer, KV head), in <run_dir>/eval_<policy>_<budget>.json.
"""

from dmc_train import cli


def evaluate_app(cfg) -> None:
    from dmc_train import distributed
    from dmc_train.evaluation.perplexity import evaluate_checkpoint

    def run():
        r = evaluate_checkpoint(cfg)
        if distributed.is_rank0():
            cache = f"; cache {r['cache']}, budget {r['budget']} ({r['schedule']})" if "cache" in r else ""
            print(f"checkpoint {r['checkpoint']} (step {r['step']}){cache}")
            for split in ("valid", "test"):
                if f"{split}_ppl" in r:
                    uni = r.get(f"{split}_unigram_ppl")
                    cr = r.get(f"{split}_achieved_cr")
                    print(f"  {split}: loss {r[f'{split}_loss']:.4f}  perplexity {r[f'{split}_ppl']:.2f}"
                          + (f"  achieved CR {cr:.2f}" if cr else "")
                          + (f"  (unigram baseline {uni:.2f})" if uni else ""))

    cli.run_reporting_errors(run)
    distributed.shutdown()


def main() -> None:
    cli.hydra_main(evaluate_app)


if __name__ == "__main__":
    main()
