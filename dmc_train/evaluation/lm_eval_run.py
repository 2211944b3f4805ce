"""Run lm-eval tasks on a checkpoint of this project (any cache) or on an exported Hugging Face model.

    run_tasks("runs/base_tiny", "h2o", {"budget": 0.25}, ["shakespeare"], limit=50)
        -> {"shakespeare_next_line": 0.41, "shakespeare_speaker": 0.37, ...}    # each task's main metric
    evaluate_tasks(hf_dir="hf/base_tiny", tasks=["shakespeare_next_line"])     # lm-eval's own ``hf`` model
        -> lm-eval's results dict (every metric, per task)

The shipped tasks (``shakespeare_tasks``) are built on first use into ``task_dir`` and run offline. Other
task names (HellaSwag, ARC, MMLU, LongBench...) come from lm-eval's own task tree: they need their data sets
(Hugging Face's cache, or the network with ``offline=False``).
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional, Sequence

from dmc_train.errors import CheckpointError, ConfigError
from dmc_train.evaluation.shakespeare_tasks import DEFAULT_DIR, TAG, TASKS, ensure_tasks

OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
MAIN_METRICS = ("acc", "exact_match", "word_perplexity")  # the first one a task reports is its main metric
BOOTSTRAP_ITERS = 1000  # stderr of perplexity-like metrics (lm-eval's default, 100000, takes minutes)


def set_offline() -> None:
    """Tell the Hugging Face libraries not to touch the network. They read these variables when they are first
    imported, so entry points call this before importing transformers, datasets or lm-eval."""
    for name in OFFLINE_VARIABLES:
        os.environ[name] = "1"


def evaluate_tasks(checkpoint: Optional[str] = None, cache: str = "auto", options: Optional[dict] = None,
                   tasks: Sequence[str] = (TAG,), limit: Optional[float] = None, route: str = "parallel",
                   hf_dir: Optional[str] = None, batch_size: int = 8, task_dir: str = DEFAULT_DIR,
                   model_args: Optional[dict] = None, log_samples: bool = False,
                   num_fewshot: Optional[int] = None, samples: Optional[dict[str, list[int]]] = None,
                   device: str = "cpu") -> dict:
    """lm-eval's results for ``tasks`` on ``checkpoint`` (with ``cache`` and its ``options``, by ``route``) or
    on the Hugging Face directory ``hf_dir`` (lm-eval's ``hf`` model, ``trust_remote_code`` for DMC exports, the
    EOS token before an empty context and each rolling window, as the ``dmc_train`` class).
    ``limit``: the first N documents of each task (or a fraction). ``model_args``: more arguments of the model
    class. ``num_fewshot``: examples before each document (lm-eval's own tasks; the shipped ones are zero-shot).
    ``device``: where the model runs (``cpu``, ``cuda``, ``cuda:1``).
    Returns the dict of ``lm_eval.simple_evaluate`` (``results``: ``{task: {"acc,none": ...}}``)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from dmc_train.evaluation.lm_eval_model import DMCTrainLM

    if (checkpoint is None) == (hf_dir is None):
        raise ConfigError("give either a checkpoint of this project or an exported Hugging Face directory (hf_dir)")
    if not tasks:
        raise ConfigError(f"no task given; the shipped ones are {', '.join(TASKS)} (all: {TAG})")
    shipped = all(t in TASKS or t == TAG for t in tasks)
    manager = TaskManager(include_path=ensure_tasks(task_dir), include_defaults=not shipped)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ConfigError(f"unknown task {unknown[0]!r}; the shipped tasks are {', '.join(TASKS)} (all: {TAG}); "
                          f"lm-eval's own tasks are listed by `lm-eval ls tasks`")
    common = {"tasks": list(tasks), "limit": limit, "task_manager": manager, "log_samples": log_samples,
              "bootstrap_iters": BOOTSTRAP_ITERS, "num_fewshot": num_fewshot,
              "samples": samples}
    if hf_dir is not None:
        if not os.path.isfile(os.path.join(hf_dir, "config.json")):
            raise CheckpointError(f"{hf_dir} is not a Hugging Face model directory (no config.json); export one with "
                                  f"python checkpoints_tools/export_hf.py --input CKPT --output DIR")
        from lm_eval.models.huggingface import HFLM

        args = {"pretrained": hf_dir, "trust_remote_code": True, "dtype": "float32", "device": device,
                "batch_size": batch_size, **_eos_prefix(hf_dir), **(model_args or {})}
        return lm_eval.simple_evaluate(model=HFLM(**args), **common)
    model_args = {"device": device, **(model_args or {})}  # --model-arg device=... wins over --device
    lm = DMCTrainLM(checkpoint, cache=cache, route=route, batch_size=batch_size, **model_args, **(options or {}))
    return lm_eval.simple_evaluate(model=lm, **common)


def _eos_prefix(hf_dir: str) -> dict:
    """``{"prefix_token_id": EOS}`` of an export: this project's models train on EOS-separated documents with no
    BOS, so EOS (what the ``dmc_train`` class uses) starts a document; lm-eval's ``hf`` model would take BOS."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        eos = json.load(f).get("eos_token_id")
    return {"prefix_token_id": eos} if isinstance(eos, int) else {}


def main_metrics(results: dict) -> dict[str, float]:
    """``{task: value}`` of each task's main metric (accuracy, exact match, or word perplexity for rolling
    log-likelihood tasks) from lm-eval's results."""
    out = {}
    for task, metrics in results["results"].items():
        for name in MAIN_METRICS:
            if f"{name},none" in metrics:
                out[task] = float(metrics[f"{name},none"])
                break
    return out


def run_tasks(checkpoint: str, cache: str = "auto", options: Optional[dict] = None, tasks: Sequence[str] = (TAG,),
              limit: Optional[float] = None, route: str = "parallel", **kwargs: Any) -> dict[str, float]:
    """``{task: main metric}`` of ``tasks`` on a checkpoint of this project with ``cache`` (its ``options``):
    the harness's lm-eval column. ``kwargs``: more of :func:`evaluate_tasks`' arguments."""
    return main_metrics(evaluate_tasks(checkpoint, cache, options, tasks, limit, route, **kwargs))
