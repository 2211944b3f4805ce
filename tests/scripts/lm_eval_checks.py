"""lm-eval on a tiny checkpoint and its Hugging Face export, in one process; writes what it saw as JSON.

    python tests/scripts/lm_eval_checks.py OUT.json RUN_DIR HF_DIR DMC_RUN_DIR DMC_HF_DIR TASK_DIR

For each case, every task's metrics and each document's responses (log-likelihoods, or generated text):

- hf:              the export through lm-eval's own ``hf`` model (full cache by construction);
- full:            the checkpoint through ``dmc_train`` with the full cache (plain forward);
- h2o_parallel:    H2O at a budget of 32 entries, log-likelihoods from the policy's teacher-forced form;
                   (and the generation task, which always runs the engine);
- h2o_engine:      the same, by decoding every continuation token by token in the engine's paged cache;
- dmc_hf, dmc_parallel, dmc_engine: a DMC model's export through ``hf`` (its remote code's cache-free
                   forward), its checkpoint through ``dmc_train`` by the DMC model's forward and by the engine's
                   DMC cache.
"""

import json
import sys

from dmc_train.evaluation import lm_eval_run

MC = ["shakespeare_next_line", "shakespeare_speaker"]
ROLLING = "shakespeare_scenes"
GENERATE = "shakespeare_speaker_gen"
H2O = {"budget": 32}


def observe(task_dir: str, **kwargs) -> dict:
    """Metrics and responses of each task in ``tasks``: 5 documents of a multiple-choice or generation task,
    for the rolling one the scene nearest 1500 characters (several windows of the tiny model's 256 positions)."""
    with open(f"{task_dir}/scenes.jsonl") as f:
        lengths = [len(json.loads(line)["text"]) for line in f]
    scene = min(range(len(lengths)), key=lambda i: abs(lengths[i] - 1500))
    tasks = kwargs.pop("tasks")
    samples = {t: [scene] if t == ROLLING else list(range(5)) for t in tasks}
    results = lm_eval_run.evaluate_tasks(tasks=tasks, samples=samples, log_samples=True, task_dir=task_dir, **kwargs)
    out = {}
    for task, docs in results["samples"].items():
        docs = sorted(docs, key=lambda s: s["doc_id"])
        out[task] = {"metrics": {k: v for k, v in results["results"][task].items() if isinstance(v, float)},
                     "responses": [s["filtered_resps"] for s in docs]}
    return out


def main(out_path: str, run_dir: str, hf_dir: str, dmc_run: str, dmc_hf: str, task_dir: str) -> None:
    lm_eval_run.set_offline()
    both = {"task_dir": task_dir, "batch_size": 4}
    res = {
        "hf": observe(hf_dir=hf_dir, tasks=[MC[0], ROLLING], **both),
        "full": observe(checkpoint=run_dir, cache="full", tasks=[MC[0], ROLLING], **both),
        "h2o_parallel": observe(checkpoint=run_dir, cache="h2o", options=H2O, tasks=MC + [ROLLING, GENERATE],
                                **both),
        "h2o_engine": observe(checkpoint=run_dir, cache="h2o", options=H2O, route="engine", tasks=MC + [ROLLING],
                              **both),
        "dmc_hf": observe(hf_dir=dmc_hf, tasks=[MC[0], ROLLING], **both),
        "dmc_parallel": observe(checkpoint=dmc_run, tasks=[MC[0], ROLLING], **both),
        "dmc_engine": observe(checkpoint=dmc_run, route="engine", tasks=[MC[0], ROLLING], **both),
        "main_metrics": lm_eval_run.run_tasks(run_dir, "tova", {"budget": 32}, [MC[1]], limit=4, batch_size=4,
                                              task_dir=task_dir),
    }
    with open(out_path, "w") as f:
        json.dump(res, f, default=str)


if __name__ == "__main__":
    main(*sys.argv[1:])
