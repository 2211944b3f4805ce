"""TP / PP / interleaved PP / DP (+ distributed optimizer) give the same losses as one process;
with DMC also the same CR loss (reduced over all layers and heads) and achieved CR."""

import pytest

from tests.helpers import run_json
from tests.scripts.train_layouts import VARIANTS

VARIANT_LAYOUTS = [f"{v}_{layout}" for v in VARIANTS for layout in ("tp2", "pp2")]

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def losses(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("layouts")
    ref = run_json(["tests/scripts/train_layouts.py", "ref", "dmc_ref", *(f"{v}_ref" for v in VARIANTS)],
                   str(tmp / "ref.json"))
    two = run_json(["tests/scripts/train_layouts.py", "tp2", "tp2_sp", "pp2", "vpp2", "dp2", "dp2_distopt",
                    "dmc_tp2", "dmc_pp2", "dmc_vpp2", *VARIANT_LAYOUTS], str(tmp / "two.json"), nproc=2)
    return {**ref, **two}


@pytest.mark.parametrize("layout", ["tp2", "tp2_sp", "pp2", "vpp2", "dp2", "dp2_distopt"])
def test_same_losses_as_single_process(losses, layout):
    ref = losses["ref"]["lm_loss"]
    assert len(ref) == 3 and len(losses[layout]["lm_loss"]) == 3
    assert losses[layout]["lm_loss"] == pytest.approx(ref, abs=1e-5, rel=0)


@pytest.mark.parametrize("layout", ["dmc_tp2", "dmc_pp2", "dmc_vpp2", *VARIANT_LAYOUTS])
def test_dmc_same_losses_and_cr_as_single_process(losses, layout):
    ref, got = losses[layout.rsplit("_", 1)[0] + "_ref"], losses[layout]
    for key in ("lm_loss", "cr_loss", "cr") + (("cr_c_loss",) if layout.startswith("dmcc") else ()):
        assert len(got[key]) == 3 and None not in got[key], (key, got[key])
        assert got[key] == pytest.approx(ref[key], abs=1e-5, rel=0), key


def test_hardc_shares_decisions_within_a_layer(losses):
    """The hard-decision counts per head of a layer are identical with DMC-HardC (and not with DMC)."""
    def spread(name):  # max over layers of (max - min) per-head CR in the last step
        return max(max(row) - min(row) for row in losses[name]["cr_heads"])

    assert spread("hardc_ref") == 0 and spread("dmc_ref") > 0


def test_training_changes_the_losses(losses):
    # The comparisons above are meaningful only if the three steps differ from each other, the CR
    # hinge is active (its gradient flows) and the decisions are not trivially all-append.
    ref, dmc = losses["ref"]["lm_loss"], losses["dmc_ref"]
    assert max(ref) - min(ref) > 1e-3
    assert max(dmc["lm_loss"]) - min(dmc["lm_loss"]) > 1e-3
    assert min(dmc["cr_loss"]) > 0
    assert min(dmc["cr"]) > 1.05
