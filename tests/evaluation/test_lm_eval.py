"""Downstream tasks through lm-eval, offline: the shipped Shakespeare tasks are built deterministically from
the held-out plays; a tiny checkpoint runs them through the ``dmc_train`` model class (full cache, H2O by
its parallel form and by decoding in the engine) and its export through lm-eval's own ``hf`` model; the
routes agree."""

import json
import math
import os

import pytest

from tests.helpers import ROOT, run, run_json
from tests.test_data_tokenizer import tiny_docs

pytestmark = pytest.mark.slow

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
TRAIN = ["launch/pretrain.py", "+recipe=tiny_pretrain", "logging.progress=false", "train.eval_interval=0",
         "train.max_steps=3", "checkpoint.save_interval=0"]
ARCHIVE_CACHE = os.path.join(ROOT, "data_cache", "downloads")


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    from dmc_train.evaluation.shakespeare_tasks import build_tasks

    return build_tasks(str(tmp_path_factory.mktemp("lm_eval_tasks")), ARCHIVE_CACHE)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, task_dir):
    """Tiny vanilla and DMC models trained 3 steps with a sentencepiece tokenizer, their HF exports, and what
    lm-eval saw (``tests/scripts/lm_eval_checks.py``)."""
    from dmc_train.data.tokenizer import train_sentencepiece

    work = tmp_path_factory.mktemp("lm_eval_model")
    tok = train_sentencepiece(tiny_docs(), str(work / "tok.model"), vocab_size=400)
    run([*TRAIN, f"run_dir={work / 'run'}", f"data.tokenizer={tok.path}"])
    # init_offset 0: about half of the untrained model's decisions merge, so the DMC model really compresses
    run([*TRAIN, "method=dmc", "method.init_offset=0.0", f"run_dir={work / 'dmc'}", f"data.tokenizer={tok.path}"])
    for name in ("run", "dmc"):
        run(["checkpoints_tools/export_hf.py", "--input", str(work / name), "--output", str(work / f"{name}_hf")],
            env=OFFLINE)
    res = run_json(["tests/scripts/lm_eval_checks.py", *(str(work / n) for n in ("run", "run_hf", "dmc", "dmc_hf")),
                    task_dir], str(work / "out.json"), env=OFFLINE)
    return res, work


def test_tasks_are_deterministic_and_from_the_held_out_plays(task_dir, tmp_path):
    from dmc_train.data import shakespeare as shk
    from dmc_train.evaluation.shakespeare_tasks import TASKS, build_tasks

    again = build_tasks(str(tmp_path / "again"), ARCHIVE_CACHE)
    for stem in ("next_line", "speaker", "scenes"):
        assert open(f"{task_dir}/{stem}.jsonl", "rb").read() == open(f"{again}/{stem}.jsonl", "rb").read()
    assert all(os.path.isfile(f"{task_dir}/{name}.yaml") for name in TASKS)
    works = shk.read_works(shk.fetch_archive(ARCHIVE_CACHE, log=lambda _: None))
    test = shk.split_works({w: sum(len(t) for t in e.values()) for w, e in works.items()})["test"]
    docs = {stem: [json.loads(line) for line in open(f"{task_dir}/{stem}.jsonl")] for stem in
            ("next_line", "speaker", "scenes")}
    assert {d["play"] for d in docs["scenes"]} == set(test)
    assert len(docs["next_line"]) >= 200 and len(docs["speaker"]) >= 200
    for d in docs["next_line"]:  # the target line follows its context in the play, the distractors do not
        text = works[d["play"]]["modern"].decode()
        assert len(d["choices"]) == 4 and len(set(d["choices"])) == 4
        last = d["context"].rstrip("\n").split("\n")[-1]
        assert f"{last}\n{d['choices'][d['label']]}" in "\n".join(line.strip() for line in text.splitlines())
    for d in docs["speaker"]:
        assert d["choices"][d["label"]] == d["answer"] + "." and len(set(d["choices"])) == 4
        assert d["context"].endswith("\n\n")


def _close(a: list[float], b: list[float]) -> bool:
    """Equal up to float32 summation order: 2e-4 + 1e-7 relative per log-likelihood (a scene's sum is ~8e3; BOS
    instead of EOS before a scene moved it by 2e-2 on these nearly untrained models)."""
    return len(a) == len(b) > 0 and all(abs(x - y) <= 2e-4 + 1e-7 * abs(x) for x, y in zip(a, b))


def _loglikelihoods(case: dict, task: str) -> list[float]:
    """Every choice's (or window sum's) log-likelihood, document by document."""
    out = []
    for doc in case[task]["responses"]:
        for resp in doc:
            out.append(float(resp[0]) if isinstance(resp, list) else float(resp))
    return out


def test_the_export_in_lm_evals_hf_model_agrees_with_the_checkpoint(tiny):
    res = tiny[0]
    for task in ("shakespeare_next_line", "shakespeare_scenes"):
        assert _close(_loglikelihoods(res["hf"], task), _loglikelihoods(res["full"], task))
    for metric in ("acc,none", "acc_norm,none"):
        assert res["hf"]["shakespeare_next_line"]["metrics"][metric] == res["full"]["shakespeare_next_line"]["metrics"][
            metric]
    ppl = res["full"]["shakespeare_scenes"]["metrics"]["word_perplexity,none"]
    assert math.isfinite(ppl) and ppl > 1


def test_a_dmc_export_through_its_remote_code_agrees_with_the_checkpoint_and_the_engine(tiny):
    res = tiny[0]
    for task in ("shakespeare_next_line", "shakespeare_scenes"):
        parallel = _loglikelihoods(res["dmc_parallel"], task)
        assert _close(_loglikelihoods(res["dmc_hf"], task), parallel)
        assert _close(_loglikelihoods(res["dmc_engine"], task), parallel)


def test_a_policy_cache_by_its_parallel_form_and_by_engine_decoding_agree(tiny):
    res = tiny[0]
    for task in ("shakespeare_next_line", "shakespeare_speaker", "shakespeare_scenes"):
        assert _close(_loglikelihoods(res["h2o_parallel"], task), _loglikelihoods(res["h2o_engine"], task))
        assert res["h2o_parallel"][task]["metrics"] == pytest.approx(res["h2o_engine"][task]["metrics"])
    # the budget of 32 entries evicts on these contexts: H2O's log-likelihoods are not the full cache's
    for task in ("shakespeare_next_line", "shakespeare_scenes"):
        assert not _close(_loglikelihoods(res["full"], task), _loglikelihoods(res["h2o_parallel"], task))


def test_generation_and_the_harness_function(tiny):
    res = tiny[0]
    texts = [doc[0] for doc in res["h2o_parallel"]["shakespeare_speaker_gen"]["responses"]]
    assert len(texts) == 5 and all(isinstance(t, str) and "." not in t and "\n" not in t for t in texts)
    assert "exact_match,none" in res["h2o_parallel"]["shakespeare_speaker_gen"]["metrics"]
    acc = res["main_metrics"]["shakespeare_speaker"]
    assert set(res["main_metrics"]) == {"shakespeare_speaker"} and 0 <= acc <= 1


def test_command_line_with_a_policy_cache_and_bad_input(tiny, task_dir):
    work = tiny[1]
    out = work / "cli.json"
    proc = run(["launch/downstream.py", "--checkpoint", str(work / "run"), "--cache", "tova", "--option", "budget=32",
                "--tasks", "shakespeare_speaker", "--limit", "3", "--task-dir", task_dir, "--json", str(out)],
               env=OFFLINE)
    assert "shakespeare_speaker: acc " in proc.stdout and "cache tova budget=32, parallel" in proc.stdout
    assert json.loads(out.read_text())["results"]["shakespeare_speaker"]["sample_len"] == 3
    for args, message in ((["--cache", "h2o", "--option", "bogus=1"], "bogus"),
                          (["--tasks", "no_such_task"], "unknown task 'no_such_task'")):
        proc = run(["launch/downstream.py", "--checkpoint", str(work / "run"), "--task-dir", task_dir, *args],
                   check=False, env=OFFLINE)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert proc.returncode == 2 and len(errors) == 1 and message in errors[0], proc.stderr[-2000:]
