"""Offline resharding of full training checkpoints: TP=2 -> TP=1 -> PP=2 -> PP=2 VPP=2 is lossless
(bitwise weights, identical continued losses); the distributed optimizer's limits -> one line + --weights-only."""

import json
import os

import pytest

from tests.helpers import run, run_json

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def obs(tmp_path_factory):
    work = tmp_path_factory.mktemp("reshard")
    res = run_json(["tests/scripts/reshard_checks.py", str(work / "w")], str(work / "out.json"), nproc=2)
    return res, work / "w"


@pytest.mark.parametrize("hop,layout", [("B", (1, 1, None)), ("C", (1, 2, None)), ("V", (1, 2, 2))])
def test_each_hop_is_lossless(obs, hop, layout):
    res = obs[0][hop]
    assert (res["layout"]["tensor"], res["layout"]["pipeline"], res["layout"]["virtual_pipeline"]) == layout
    assert res["weights_equal"]
    assert res["step"] == 3 and res["consumed"] == res["source_consumed"] == 24
    assert len(res["from_resharded"]) == 3
    assert res["from_resharded"] == res["from_original"]  # bitwise: same weights, optimizer, step, data


def test_distributed_optimizer_tp_change_needs_weights_only(obs):
    res = obs[0]
    assert "cannot be resharded" in res["distopt_refused"] and "--weights-only" in res["distopt_refused"]
    assert "\n" not in res["distopt_refused"] and not res["distopt_left_output"]
    assert res["weights_only"]["weights_equal"] and res["weights_only"]["weights_only"]
    assert res["weights_only"]["layout"]["tensor"] == 2


def test_command_line_under_torchrun(obs, tmp_path):
    out = tmp_path / "a_pp2"
    proc = run(["-m", "checkpoints_tools.reshard", "--input", str(obs[1] / "A"), "--output", str(out),
                "--tensor", "1", "--pipeline", "2"], nproc=2, fresh=True)
    assert "wrote" in proc.stdout
    latest = (out / "checkpoints" / "latest").read_text().strip()
    meta = json.loads((out / "checkpoints" / latest / "meta.json").read_text())
    assert meta["layout"]["pipeline"] == 2 and meta["step"] == 3 and meta["resharded_from"]["layout"]["tensor"] == 2
    assert (out / "config.yaml").exists()


@pytest.mark.parametrize("case", ["distopt", "exists", "missing"])
def test_command_line_refusals_are_one_line(obs, tmp_path, case):
    work = obs[1]
    src, out = {"distopt": (work / "D", tmp_path / "out"), "exists": (work / "A", work / "B"),
                "missing": (tmp_path / "nothing", tmp_path / "out")}[case]
    before = sorted(os.listdir(out)) if out.exists() else None
    proc = run(["checkpoints_tools/reshard.py", "--input", str(src), "--output", str(out), "--tensor", "2",
                "--pipeline", "1"], check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert {"distopt": "--weights-only", "exists": "--overwrite", "missing": "does not exist"}[case] in errors[0]
    assert (sorted(os.listdir(out)) if out.exists() else None) == before
