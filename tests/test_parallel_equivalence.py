"""TP / PP / interleaved PP / DP (+ distributed optimizer) give the same losses as one process."""

import pytest

from tests.helpers import run_json

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def losses(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("layouts")
    ref = run_json(["tests/scripts/train_layouts.py", "ref"], str(tmp / "ref.json"))
    two = run_json(["tests/scripts/train_layouts.py", "tp2", "tp2_sp", "pp2", "vpp2", "dp2", "dp2_distopt"],
                   str(tmp / "two.json"), nproc=2)
    return {**ref, **two}


@pytest.mark.parametrize("layout", ["tp2", "tp2_sp", "pp2", "vpp2", "dp2", "dp2_distopt"])
def test_same_losses_as_single_process(losses, layout):
    ref = losses["ref"]
    assert len(ref) == 3 and len(losses[layout]) == 3
    assert losses[layout] == pytest.approx(ref, abs=1e-5, rel=0)


def test_training_changes_the_loss(losses):
    # The comparison above is meaningful only if the three steps differ from each other.
    ref = losses["ref"]
    assert max(ref) - min(ref) > 1e-3
