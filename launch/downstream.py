"""Downstream tasks through lm-eval: a checkpoint of this project with any KV cache, or an exported HF model.

    python launch/downstream.py --checkpoint runs/base_tiny                               # shipped tasks, full cache
    python launch/downstream.py --checkpoint runs/base_tiny --cache h2o --option budget=0.25 --limit 100
    python launch/downstream.py --checkpoint runs/base_tiny --cache tova --option budget=64 --route engine
    python launch/downstream.py --hf hf/base_tiny --tasks shakespeare_next_line            # lm-eval's own hf model
    python launch/downstream.py --build-tasks                                              # only write the task dir
    python launch/downstream.py --checkpoint CKPT --tasks hellaswag,arc_easy --online      # lm-eval's task tree

Prints each task's metrics; ``--json FILE`` writes lm-eval's results. Runs offline (``HF_HUB_OFFLINE``,
``HF_DATASETS_OFFLINE``) unless ``--online``. Logic: ``dmc_train/evaluation/lm_eval_*.py``,
``dmc_train/evaluation/shakespeare_tasks.py``; docs/DOWNSTREAM.md.
"""

import argparse
import json
import sys


def parse_args(argv=None):
    from dmc_train.policies import POLICIES

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="checkpoint or run directory of this project")
    src.add_argument("--hf", help="an exported Hugging Face directory (checkpoints_tools/export_hf.py)")
    src.add_argument("--build-tasks", action="store_true", help="write the shipped tasks' directory and stop")
    p.add_argument("--tasks", default="shakespeare", help="comma-separated tasks or tags (default: shakespeare, "
                                                          "every shipped task)")
    p.add_argument("--cache", default="auto",
                   help=f"auto, full, dmc, less, lightcache or an eviction policy: {', '.join(POLICIES)}")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a cache option, e.g. budget=0.25, schedule=prefill, local=128 (repeatable)")
    p.add_argument("--route", default="parallel", choices=("parallel", "engine"),
                   help="log-likelihoods by the cache's teacher-forced form or by decoding in the engine")
    p.add_argument("--limit", type=float, default=None, help="the first N documents of each task (or a fraction)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default="cpu", help="where the model runs: cpu (default), cuda, cuda:1")
    p.add_argument("--num-fewshot", type=int, default=None, help="examples before each document (e.g. 5 for MMLU)")
    p.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="another argument of the model class (dmc_train or hf), e.g. max_length=128")
    p.add_argument("--task-dir", default=None,
                   help="where the shipped tasks are built (default data_cache/lm_eval_tasks)")
    p.add_argument("--online", action="store_true", help="allow Hugging Face downloads (lm-eval's own tasks)")
    p.add_argument("--json", help="write lm-eval's results to this file")
    return p.parse_args(argv)


def key_values(items: list[str], flag: str) -> dict:
    """``KEY=VALUE`` items as a dict, numbers as numbers."""
    from dmc_train.errors import ConfigError

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{flag} {item!r} must be KEY=VALUE, e.g. budget=0.25")
        for kind in (int, float):
            try:
                out[key] = kind(value)
                break
            except ValueError:
                out[key] = value
    return out


def print_results(results: dict) -> None:
    for task, metrics in sorted(results["results"].items()):
        shown = [f"{name.split(',')[0]} {value:.4f}" for name, value in metrics.items()
                 if "," in name and "stderr" not in name and isinstance(value, float)]
        print(f"{task}: {'  '.join(shown)}  ({metrics.get('sample_len', '?')} documents)")


def main(argv=None) -> None:
    args = parse_args(argv)

    from dmc_train import cli

    def run():
        from dmc_train.evaluation import lm_eval_run
        from dmc_train.evaluation.shakespeare_tasks import DEFAULT_DIR, ensure_tasks

        if not args.online:
            lm_eval_run.set_offline()  # before transformers, datasets and lm-eval are imported
        task_dir = args.task_dir or DEFAULT_DIR
        if args.build_tasks:
            print(f"tasks written to {ensure_tasks(task_dir)} (lm-eval: --include_path that directory)")
            return
        limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
        results = lm_eval_run.evaluate_tasks(
            checkpoint=args.checkpoint, cache=args.cache, options=key_values(args.option, "--option"),
            tasks=[t for t in args.tasks.split(",") if t], limit=limit, route=args.route, hf_dir=args.hf,
            batch_size=args.batch_size, task_dir=task_dir, model_args=key_values(args.model_arg, "--model-arg"),
            num_fewshot=args.num_fewshot, device=args.device)
        if args.hf is None:
            where = f"{args.checkpoint} (cache {args.cache}{''.join(' ' + o for o in args.option)}, {args.route})"
        else:
            where = f"{args.hf} (lm-eval hf)"
        print(where)
        print_results(results)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"results": results["results"], "n-samples": results.get("n-samples"),
                           "config": {k: str(v) for k, v in results.get("config", {}).items()}}, f, indent=1)

    cli.run_reporting_errors(run)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
