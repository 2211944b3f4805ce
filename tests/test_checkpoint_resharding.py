"""Checkpoints: exact resume, TP=2 -> TP=1 weights and optimizer state, distributed optimizer rules."""

import pytest
import torch

from tests.helpers import run_json

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def obs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt")
    return run_json(["tests/scripts/checkpoint_checks.py", str(tmp / "work")], str(tmp / "out.json"), nproc=2)


def test_resume_continues_exactly(obs):
    assert obs["first_half"] == obs["full_tp2"][:3]
    assert obs["resume_tp2"] == obs["full_tp2"][3:]  # bitwise: same layout, RNG and data position


def test_resume_at_other_tp_reshards_optimizer(obs):
    assert obs["resume_tp1"] == pytest.approx(obs["full_tp2"][3:], abs=1e-5, rel=0)


def test_saved_at_tp2_loaded_at_tp1_same_logits(obs):
    a, b = torch.tensor(obs["logits_tp2"]), torch.tensor(obs["logits_tp1"])
    assert a.shape == (2, 16, 512)
    torch.testing.assert_close(b, a, atol=1e-5, rtol=0)


def test_distributed_optimizer_resume_is_exact(obs):
    assert obs["resume_distopt"] == obs["full_dp2"][3:]


def test_distributed_optimizer_layout_change_is_refused_clearly(obs):
    msg = obs["distopt_to_tp2"]
    assert "cannot be resharded" in msg and "checkpoint.load_optimizer=false" in msg
