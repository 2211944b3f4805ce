"""Training on an indexed corpus: a run resumed mid-epoch sees exactly the samples of an uninterrupted run,
and a missing dataset prefix fails before any model is built."""

import json
import os

import pytest

from tests.helpers import run

TINY = ["launch/pretrain.py", "+recipe=tiny_pretrain", "train.eval_interval=0", "checkpoint.save_interval=0",
        "data.kind=indexed", "train.max_steps=6"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from dmc_train.data.prepare import prepare_corpus

    root = tmp_path_factory.mktemp("corpus")
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly numbers".split()
    for split, n in (("train", 60), ("valid", 8)):
        with open(root / f"{split}.jsonl", "w") as f:
            for i in range(n):
                text = " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(40 + i % 13))
                f.write(json.dumps({"text": text}) + "\n")
    prepare_corpus([str(root / "train.jsonl")], str(root / "data" / "train"), vocab_size=300, progress=False,
                   log=lambda *_: None)
    prepare_corpus([str(root / "valid.jsonl")], str(root / "data" / "valid"), progress=False, log=lambda *_: None,
                   tokenizer=str(root / "data" / "tokenizer.model"))
    return root / "data"


def data_args(corpus):
    return [f"data.prefixes=[{corpus}/train]", f"data.valid_prefixes=[{corpus}/valid]",
            f"data.cache_dir={corpus}/index_cache"]


def losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r["lm_loss"] for r in map(json.loads, f)]


def test_resume_mid_epoch_sees_the_same_samples(corpus, tmp_path):
    run([*TINY, *data_args(corpus), f"run_dir={tmp_path}/full"])
    run([*TINY, *data_args(corpus), f"run_dir={tmp_path}/split", "train.max_steps_per_job=3"])
    run([*TINY, *data_args(corpus), f"run_dir={tmp_path}/split"])
    full = losses(tmp_path / "full")
    assert len(full) == 6 and full[0] > full[-1]  # real text: the loss goes down
    assert losses(tmp_path / "split") == full


def test_missing_prefix_fails_before_the_model(tmp_path):
    proc = run([*TINY, f"run_dir={tmp_path}/run", f"data.prefixes=[{tmp_path}/nowhere/train]"], check=False)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "nowhere/train" in errors[0] and "prepare_data.py" in errors[0], proc.stderr[-2000:]
    assert "parameters" not in proc.stdout  # the model summary line is printed only after the build
