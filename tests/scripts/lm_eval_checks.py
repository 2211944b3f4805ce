"""lm-eval on a tiny checkpoint and its Hugging Face export, in one process; writes what it saw as JSON.

    python tests/scripts/lm_eval_checks.py OUT.json RUN_DIR HF_DIR TASK_DIR

For each case, every task's metrics and each document's responses (log-likelihoods, or generated text):

- hf:              the export through lm-eval's own ``hf`` model (full cache by construction);
- full:            the checkpoint through ``dmc_train`` with the full cache (plain forward);
- h2o_parallel:    H2O at a budget of 32 entries, log-likelihoods from the policy's teacher-forced form;
- h2o_engine:      the same, by decoding every continuation token by token in the engine's paged cache.
"""

import json
import sys

from dmc_train.evaluation import lm_eval_run

MC = ["shakespeare_next_line", "shakespeare_speaker"]
ROLLING = "shakespeare_scenes"
H2O = {"budget": 32}


def observe(**kwargs) -> dict:
    out = {}
    for task in kwargs.pop("tasks"):  # multiple-choice tasks: 5 documents; rolling: the first scene
        out.update(_observe(tasks=[task], limit=1 if task == ROLLING else 5, **kwargs))
    return out


def _observe(**kwargs) -> dict:
    results = lm_eval_run.evaluate_tasks(log_samples=True, **kwargs)
    out = {}
    for task, samples in results["samples"].items():
        samples = sorted(samples, key=lambda s: s["doc_id"])
        out[task] = {"metrics": {k: v for k, v in results["results"][task].items() if isinstance(v, float)},
                     "responses": [s["filtered_resps"] for s in samples]}
    return out


def main(out_path: str, run_dir: str, hf_dir: str, task_dir: str) -> None:
    lm_eval_run.set_offline()
    both = {"task_dir": task_dir, "batch_size": 4}
    res = {
        "hf": observe(hf_dir=hf_dir, tasks=[MC[0], ROLLING], **both),
        "full": observe(checkpoint=run_dir, cache="full", tasks=[MC[0], ROLLING], **both),
        "h2o_parallel": observe(checkpoint=run_dir, cache="h2o", options=H2O, tasks=MC + [ROLLING], **both),
        "h2o_engine": observe(checkpoint=run_dir, cache="h2o", options=H2O, route="engine", tasks=MC + [ROLLING],
                              **both),
        "h2o_generate": observe(checkpoint=run_dir, cache="h2o", options=H2O, tasks=["shakespeare_speaker_gen"],
                                **both),
        "main_metrics": lm_eval_run.run_tasks(run_dir, "tova", {"budget": 32}, [MC[1]], limit=4, **both),
    }
    with open(out_path, "w") as f:
        json.dump(res, f, default=str)


if __name__ == "__main__":
    main(*sys.argv[1:])
