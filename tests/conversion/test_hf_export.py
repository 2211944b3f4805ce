"""Export to Hugging Face: tiny MHA and GQA models reload in transformers (no custom code) with our
logits and greedy tokens, HF -> ours -> HF is bitwise, bf16 within its tolerance, bad input -> one line."""

import json
import os
import shutil

import pytest
import torch

from tests.helpers import run, run_json

pytestmark = pytest.mark.slow

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    work = tmp_path_factory.mktemp("hf_export")
    res = run_json(["tests/scripts/hf_export_checks.py", str(work)], str(work / "out.json"), env=OFFLINE)
    return res, work


@pytest.mark.parametrize("name,groups", [("mha", 8), ("gqa", 4)])
def test_transformers_gives_our_logits_and_greedy_tokens(exported, name, groups):
    res = exported[0][name]
    assert res["max_logit_diff"] < 1e-4
    assert res["hf_tokens"] == res["our_tokens"]
    assert res["config"]["num_key_value_heads"] == groups and res["config"]["tie_word_embeddings"] is False
    assert "auto_map" not in res["config"] and not any(f.endswith(".py") for f in res["files"])
    assert res["shards"] > 1 and "model.safetensors.index.json" in res["files"]


def test_manifest_records_source_and_verification(exported):
    res, work = exported
    manifest = res["mha"]["manifest"]
    assert manifest["step"] == 2 and manifest["method"] == "none" and manifest["dtype"] == "float32"
    assert manifest["source_checkpoint"].endswith("iter_0000002") and manifest["dmc_train_version"]
    assert manifest["verification"]["max_abs_logit_diff"] <= 1e-4
    assert manifest["tokenizer"]["kind"] == "none"  # tiny_pretrain trains on synthetic tokens


def test_failed_verification_leaves_nothing(exported):
    res = exported[0]["failed"]
    assert "does not load in transformers" in res["load_error"]["error"]
    assert "differ from the checkpoint's" in res["logits_differ"]["error"]
    for case in res.values():
        assert "\n" not in case["error"] and not case["left"]


@pytest.mark.parametrize("kind", ["untied", "tied"])
def test_hf_ours_hf_round_trip_is_bitwise(exported, kind):
    res = exported[0][f"roundtrip_{kind}"]
    assert res["names_equal"] and res["bitwise_equal"]
    assert res["config_tie"] is (kind == "tied")


def test_sentencepiece_tokenizer_is_exported(exported):
    res = exported[0]["roundtrip_untied"]
    assert {"tokenizer.model", "tokenizer.json", "tokenizer_config.json"} <= set(res["files"])
    assert res["tokenizer"]["same_ids"] and res["tokenizer"]["same_text"]
    assert res["tokenizer"]["eos"] == [2, 2, 2]


def test_bf16_export_from_the_command_line(exported, tmp_path):
    from safetensors import safe_open
    from transformers import LlamaForCausalLM

    out = tmp_path / "gqa_bf16"
    proc = run(["-m", "checkpoints_tools.export_hf", "--input", str(exported[1] / "gqa"), "--output", str(out),
                "--dtype", "bf16", "--max-shard-size", "1MB"], env=OFFLINE)
    assert "verified" in proc.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["dtype"] == "bfloat16" and manifest["tokenizer"]["kind"] == "none"
    check = manifest["verification"]
    assert 0 < check["max_abs_logit_diff"] and check["tolerance"] == 0.05  # relative to max(1, max |logit|)
    assert 0 < check["relative_error"] <= 0.05
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(out / "model-00001-of-00001.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    model = LlamaForCausalLM.from_pretrained(str(out), local_files_only=True)
    assert model.dtype == torch.bfloat16


def _fails_with_one_line(args, out, expect):
    proc = run(["checkpoints_tools/export_hf.py", *args, "--output", str(out)], check=False, env=OFFLINE)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1 and expect in errors[0], proc.stderr[-2000:]
    assert not os.path.exists(f"{out}.tmp")
    return errors[0]


def test_bad_input_is_refused_with_one_line(exported, tmp_path):
    work = exported[1]
    existing = work / "mha_hf"
    before = sorted(os.listdir(existing))
    _fails_with_one_line(["--input", str(work / "mha")], existing, "pass --overwrite")
    assert sorted(os.listdir(existing)) == before

    dmc = tmp_path / "dmc_ckpt"  # DMC models export (tests/conversion/test_hf_dmc.py), Fixed Memory Pooling not
    shutil.copytree(work / "mha" / "checkpoints" / "iter_0000002", dmc)
    meta = json.loads((dmc / "meta.json").read_text())
    meta["method"] = meta["config"]["method"]["name"] = "fixed_pooling"
    (dmc / "meta.json").write_text(json.dumps(meta))
    _fails_with_one_line(["--input", str(dmc)], tmp_path / "dmc_hf", "only DMC models (method=dmc) can be exported")
    assert not (tmp_path / "dmc_hf").exists()

    _fails_with_one_line(["--input", str(tmp_path / "missing")], tmp_path / "missing_hf", "does not exist")
    assert not (tmp_path / "missing_hf").exists()

    corrupt = tmp_path / "corrupt_ckpt"
    shutil.copytree(work / "mha" / "checkpoints" / "iter_0000002", corrupt)
    for f in corrupt.iterdir():
        if f.suffix == ".distcp":
            f.write_bytes(f.read_bytes()[:100])
    _fails_with_one_line(["--input", str(corrupt)], tmp_path / "corrupt_hf", "truncated or corrupt")
    assert not (tmp_path / "corrupt_hf").exists()
