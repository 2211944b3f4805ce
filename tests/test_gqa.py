"""GQA conversion of a TP=2 checkpoint: groups = heads is exact, fewer groups average exactly, the
result loads at another layout and up-trains (tests/scripts/gqa_checks.py, one 2-rank launch);
the command-line tool's errors."""

import math

import pytest
import torch

from tests.helpers import run, run_json

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gqa")
    return run_json(["tests/scripts/gqa_checks.py", str(tmp)], str(tmp / "out.json"), nproc=2)


def test_all_groups_reproduces_the_logits(res):
    torch.testing.assert_close(torch.tensor(res["g8_logits"]), torch.tensor(res["source_logits"]), rtol=0, atol=1e-5)


def test_fewer_groups_average_exactly(res):
    assert res["g2_qkv_max_error"] == 0.0
    diff = (torch.tensor(res["g2_logits"]) - torch.tensor(res["source_logits"])).abs().max()
    assert diff > 1e-3  # heads were really merged


def test_converted_model_uptrains(res):
    losses = res["uptrain_losses"]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses) and len(set(losses)) == 4


def test_cli_refuses_to_overwrite_and_bad_groups(tmp_path):
    out = tmp_path / "exists"
    out.mkdir()
    (out / "keep.txt").write_text("data")
    proc = run(["checkpoints_tools/convert_gqa.py", "--input", str(tmp_path / "nothing"), "--output", str(out),
                "--groups", "4"], check=False)
    assert proc.returncode == 2 and "exists; choose another directory or pass --force" in proc.stderr
    assert (out / "keep.txt").read_text() == "data"
    proc = run(["checkpoints_tools/convert_gqa.py", "--input", str(tmp_path / "nothing"), "--output",
                str(tmp_path / "new"), "--groups", "4"], check=False)
    assert proc.returncode == 2 and "does not exist" in proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "new").exists()
