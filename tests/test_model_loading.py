"""Model-only loading (any saved layout, eval mode, the method's attention) and evaluation on it."""

import json

import pytest
import torch

from tests.helpers import run, run_json

CONFIG = ["+recipe=tiny_pretrain", "method=dmc", "method.init_offset=0.5", "model.num_query_groups=4"]
TRAIN = ["launch/pretrain.py", *CONFIG, "train.max_steps=4", "train.eval_interval=4", "logging.progress=false"]


@pytest.fixture(scope="module")
def dmc_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("loading") / "dmc"
    run([*TRAIN, f"run_dir={run_dir}"])
    return run_dir


@pytest.mark.distributed
def test_checkpoint_loads_model_only_at_any_layout(dmc_run, tmp_path):
    res = run_json(["tests/scripts/model_loading_checks.py", str(dmc_run)], str(tmp_path / "out.json"), nproc=2)
    for layout in ("tp1", "tp2"):
        assert res[layout]["method"] == "dmc" and res[layout]["attention"] == "DMCSelfAttention"
        assert res[layout]["step"] == 4 and not res[layout]["training"]
    torch.testing.assert_close(torch.tensor(res["tp2"]["logits"]), torch.tensor(res["tp1"]["logits"]),
                               rtol=1e-4, atol=1e-4)


def test_evaluation_matches_the_loops_validation(dmc_run):
    proc = run(["launch/evaluate.py", *CONFIG, f"run_dir={dmc_run}"])
    assert "achieved CR" in proc.stdout
    result = json.loads((dmc_run / "eval.json").read_text())
    last = [json.loads(line) for line in (dmc_run / "metrics.jsonl").read_text().splitlines()][-1]
    assert result["step"] == 4
    assert result["valid_loss"] == pytest.approx(last["val_loss"], rel=1e-9)
    assert result["valid_achieved_cr"] == pytest.approx(last["val_achieved_cr"], rel=1e-9)


def test_evaluation_needs_a_checkpoint_to_name(dmc_run):
    proc = run(["launch/evaluate.py", *CONFIG, f"run_dir={dmc_run}", "checkpoint.resume=none"], check=False)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "checkpoint.resume=none names no checkpoint to evaluate" in errors[0]
