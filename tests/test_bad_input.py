"""Bad input: one-line error naming the cause, non-zero exit, existing checkpoints untouched."""

import hashlib
import os

import pytest

from tests.helpers import run

TINY = ["launch/pretrain.py", "+recipe=tiny_pretrain", "train.max_steps=1", "train.eval_interval=0"]


def tree_digest(path) -> str:
    h = hashlib.sha256()
    for root, dirs, files in sorted(os.walk(path)):
        dirs.sort()
        for name in sorted(files):
            p = os.path.join(root, name)
            h.update(p.encode())
            with open(p, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def assert_one_line_error(proc, *fragments):
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-1000:], proc.stderr[-3000:])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


@pytest.mark.parametrize("override, fragments", [
    ("train.nonexistent=1", ["config error", "nonexistent"]),
    ("parallel.tensor=3", ["parallel.tensor=3 does not divide model.num_attention_heads=8"]),
    ("parallel.pipeline=2", ["world size 1 is not divisible by parallel.tensor x parallel.pipeline = 1x2"]),
])
def test_bad_config_fails_in_one_line(tmp_path, override, fragments):
    proc = run([*TINY, f"run_dir={tmp_path}/run", override], check=False)
    assert_one_line_error(proc, *fragments)
    assert not os.path.exists(tmp_path / "run")


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("saved") / "run"
    run([*TINY, f"run_dir={run_dir}"])
    return run_dir


def test_model_shape_mismatch(saved_run):
    before = tree_digest(saved_run / "checkpoints")
    proc = run([*TINY, f"run_dir={saved_run}", "model.hidden_size=128"], check=False)
    assert_one_line_error(proc, "different model shape", "hidden_size: checkpoint 64 vs config 128")
    assert tree_digest(saved_run / "checkpoints") == before


def test_missing_checkpoint(tmp_path):
    proc = run([*TINY, f"run_dir={tmp_path}/run", f"checkpoint.resume={tmp_path}/nowhere"], check=False)
    assert_one_line_error(proc, "does not exist")
    assert not os.path.exists(tmp_path / "run")  # rejected after Hydra started: nothing left behind


def test_truncated_checkpoint(saved_run, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(saved_run / "checkpoints" / "iter_0000001", broken)
    shard = sorted(p for p in os.listdir(broken) if p.endswith(".distcp"))[0]
    with open(broken / shard, "r+b") as f:
        f.truncate(100)
    before = tree_digest(saved_run / "checkpoints")
    proc = run([*TINY, f"run_dir={saved_run}", f"checkpoint.resume={broken}", "train.max_steps=2"], check=False)
    assert_one_line_error(proc, "truncated or corrupt")
    assert tree_digest(saved_run / "checkpoints") == before


def test_checkpoint_without_metadata(saved_run, tmp_path):
    import shutil

    partial = tmp_path / "partial"
    shutil.copytree(saved_run / "checkpoints" / "iter_0000001", partial)
    os.remove(partial / "meta.json")
    proc = run([*TINY, f"run_dir={saved_run}", f"checkpoint.resume={partial}"], check=False)
    assert_one_line_error(proc, "incomplete")
