"""Hugging Face Llama import: tiny random ``LlamaForCausalLM`` models (MHA/GQA, tied/untied, single and
sharded safetensors, sharded ``.bin``) imported (streamed, without building the model) and compared logit
by logit with transformers and file by file with the whole-model import, loaded at other layouts, used
directly by training (``checkpoint.init_from=<HF dir>``), and bad inputs (a corrupt written tensor
included)."""

import json
import os
import shutil

import pytest
import torch

from tests.helpers import run
from tests.scripts.hf_import_checks import hf_logits, make, make_tokenizer, ragged

pytestmark = pytest.mark.slow

SCRIPT = "tests/scripts/hf_import_checks.py"
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
KINDS = ("gqa", "mha_tied", "gqa_bin")


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    for kind in KINDS:
        make(str(root / kind), kind)
    return root


@pytest.fixture(scope="module")
def imported(hf_models, tmp_path_factory):
    """``gqa`` imported with the command line, the others with import_hf; each compared with HF at TP=1."""
    out = tmp_path_factory.mktemp("imported")
    proc = run(["checkpoints_tools/import_hf.py", "--input", str(hf_models / "gqa"), "--output", str(out / "gqa")],
               env=ENV)
    assert "wrote" in proc.stdout
    pairs = [str(p) for kind in KINDS for p in (hf_models / kind, out / kind)]
    run([SCRIPT, "imports", str(out / "res.json"), *pairs], env=ENV)
    return out, json.loads((out / "res.json").read_text())


def test_imported_logits_equal_hf(imported, hf_models):
    out, res = imported
    for kind in KINDS:
        assert res[kind]["logit_scale"] > 1  # weights large enough for the comparison to mean something
        assert res[kind]["max_diff"] < 1e-4, (kind, res[kind])
        assert res[kind]["meta"]["hf_source"] == str(hf_models / kind)
    assert res["mha_tied"]["meta"]["tie_word_embeddings"] and not res["gqa"]["meta"]["tie_word_embeddings"]
    # the tokenizer came along, and the saved config's data.tokenizer points at it
    assert res["gqa"]["data_tokenizer"] == str(out / "gqa" / "tokenizer")
    assert sorted(os.listdir(out / "gqa" / "tokenizer")) == ["tokenizer.json", "tokenizer_config.json"]
    assert res["mha_tied"]["data_tokenizer"] == str(out / "mha_tied" / "tokenizer" / "tokenizer.model")
    assert os.listdir(out / "mha_tied" / "tokenizer") == ["tokenizer.model"]
    assert res["gqa_bin"]["data_tokenizer"] is None
    assert not [p for p in os.listdir(out) if p.endswith((".tmp", ".importing"))]


def test_streamed_import_equals_the_model_based_one(imported):
    """The streamed files are those the whole-model import (build, load_hf_into_model, save_weights)
    writes: the same .metadata (keys, global shapes, dtypes, chunks) and bitwise equal tensors."""
    _, res = imported
    for kind in KINDS:
        same = res[kind]["model_path"]
        tensors = 26 if kind == "mha_tied" else 27  # tied: the output layer is the embedding, stored once
        assert same["same_metadata"] and same["tensors"] == tensors and same["unequal"] == [], (kind, same)
        assert same["dtypes"] == ["torch.float32"]
    bf16 = res["gqa"]["model_path_bf16"]
    assert bf16["same_metadata"] and bf16["unequal"] == [] and bf16["dtypes"] == ["torch.bfloat16"], bf16


def test_verifications_agree_with_transformers(imported):
    """The layer-by-layer reference forward computes transformers' logits, and the full verification
    (transformers vs our megatron model) passes on the streamed checkpoints."""
    _, res = imported
    for kind in KINDS:
        assert res[kind]["reference_vs_transformers"] < 1e-5, (kind, res[kind])
        full = res[kind]["full_check"]
        assert full["tolerance"] == 1e-5 and full["relative_error"] <= 1e-5, (kind, full)


@pytest.mark.distributed
def test_any_layout_and_training_start_from_the_hf_weights(imported, hf_models, tmp_path):
    out, _ = imported
    hf = str(hf_models / "gqa")
    run([SCRIPT, "layouts", str(tmp_path / "lay.json"), str(out / "gqa"), hf, str(tmp_path / "run")],
        nproc=2, env=ENV)
    res = json.loads((tmp_path / "lay.json").read_text())
    # load_hf_into_model's local shards are exactly megatron's resharding of the TP=1 import
    for layout in ("tp1", "tp2", "pp2", "pp2_vpp2"):
        assert res[layout]["shard_diff"] == 0.0, layout
    # a dist checkpoint stores global tensors: megatron's own save at TP=2 / PP=2 has the import's keys and
    # global shapes (layers keyed by their global number); at PP=2 even the chunks are the same
    for layout in ("tp2", "pp2"):
        diff = res[layout]["saved_vs_import"]
        assert diff["same_keys"] and diff["same_global_shapes"], (layout, diff)
    assert res["pp2"]["saved_vs_import"]["same_chunks"] and not res["tp2"]["saved_vs_import"]["same_chunks"]
    assert res["pp2"]["params"] == [13, 14]  # embedding + 2 layers | 2 layers + final norm + output layer
    tokens, lengths = ragged(512)
    theirs = hf_logits(hf, tokens, lengths)
    for layout in ("tp1", "tp2", "pp2", "train"):
        ours = torch.tensor(res[layout]["logits"])
        for i, n in enumerate(lengths):
            torch.testing.assert_close(ours[i, :n], theirs[i], rtol=1e-4, atol=1e-4, msg=layout)
    assert 0 < res["train"]["loss"] < 20


def _copy(src, dest, config=None):
    shutil.copytree(src, dest)
    if config:
        hf = json.loads((dest / "config.json").read_text())
        hf.update(config)
        (dest / "config.json").write_text(json.dumps(hf))
    return dest


def test_bad_inputs_fail_in_one_line_and_leave_nothing(hf_models, imported, tmp_path):
    cases = {
        "gpt2": _copy(hf_models / "gqa", tmp_path / "gpt2",
                      {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}),
        "yarn_rope": _copy(hf_models / "gqa", tmp_path / "yarn_rope", {"rope_parameters": {
            "rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0, "original_max_position_embeddings": 64}}),
        "truncated": _copy(hf_models / "mha_tied", tmp_path / "truncated"),
        "missing_shard": _copy(hf_models / "mha_tied", tmp_path / "missing_shard"),
        "no_weights": tmp_path / "no_weights",
        "shape": _copy(hf_models / "gqa_bin", tmp_path / "shape", {"intermediate_size": 160}),
        "tokenizer": _copy(hf_models / "gqa", tmp_path / "tokenizer"),
        "verify": _copy(hf_models / "gqa", tmp_path / "verify"),
        "corrupt": _copy(hf_models / "gqa", tmp_path / "corrupt"),
        "truncated_written": _copy(hf_models / "gqa", tmp_path / "truncated_written"),
    }
    shard = tmp_path / "truncated" / "model-00003-of-00005.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    os.remove(tmp_path / "missing_shard" / "model-00002-of-00005.safetensors")
    os.makedirs(cases["no_weights"])
    shutil.copy(hf_models / "gqa" / "config.json", cases["no_weights"])
    make_tokenizer(str(cases["tokenizer"]), 600)
    run([SCRIPT, "errors", str(tmp_path / "err.json"), *[f"{k}={v}" for k, v in cases.items()]], env=ENV)
    res = json.loads((tmp_path / "err.json").read_text())
    expected = {
        "gpt2": "model_type='gpt2'",
        "yarn_rope": "RoPE of type 'yarn'",
        "truncated": "model-00003-of-00005.safetensors cannot be read",
        "missing_shard": "model-00002-of-00005.safetensors is missing",
        "no_weights": "holds no weights",
        "shape": "model.layers.0.mlp.gate_proj.weight has shape (176, 64) but the model config needs (160, 64)",
        "tokenizer": "has 600 tokens but the model's vocab_size is 512",
        "verify": "the imported model's logits differ from the Hugging Face model's",
        # one layer's o_proj corrupted on disk after writing: the streaming verification finds it
        "corrupt": "the imported model's logits differ from the Hugging Face model's",
        "truncated_written": "could not be read (EOFError); it is truncated or corrupt",
    }
    for case, text in expected.items():
        error = res[case]["error"]
        assert error is not None and text in error and "\n" not in error, (case, error)
        assert res[case]["left"] == [], (case, res[case]["left"])

    out, _ = imported  # an existing output is refused without --overwrite (and left as it was)
    before = sorted(os.listdir(out / "gqa"))
    proc = run(["-m", "checkpoints_tools.import_hf", "--input", str(hf_models / "gqa"), "--output", str(out / "gqa")],
               check=False, env=ENV)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1 and "pass --overwrite" in errors[0], proc.stderr[-2000:]
    assert sorted(os.listdir(out / "gqa")) == before


def test_training_from_hf_refuses_another_model_shape(hf_models, tmp_path):
    proc = run(["launch/pretrain.py", "+recipe=tiny_pretrain", f"checkpoint.init_from={hf_models / 'gqa'}",
                f"run_dir={tmp_path / 'run'}", "train.max_steps=1"], check=False, env=ENV)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert "num_query_groups: config.json 4 vs config 8" in errors[0]


def _hf_tensors(directory):
    """All tensors of a Hugging Face directory by name (the importer's own lazy reader)."""
    from dmc_train.training.hf_loading import HFWeights

    weights = HFWeights(str(directory))
    return {name: weights.get(name) for name in weights.names()}


def test_round_trip_hf_ours_hf_is_bit_identical(imported, hf_models, tmp_path):
    """The real tools both ways: import (above), then export, and every tensor equals the original."""
    out, _ = imported
    for kind in KINDS:
        back = tmp_path / f"{kind}_back"
        run(["checkpoints_tools/export_hf.py", "--input", str(out / kind), "--output", str(back)], env=ENV)
        original, exported = _hf_tensors(hf_models / kind), _hf_tensors(back)
        assert sorted(exported) == sorted(original), kind
        for name, tensor in original.items():
            assert torch.equal(exported[name], tensor), (kind, name)
        config = json.loads((back / "config.json").read_text())
        assert config["tie_word_embeddings"] == (kind == "mha_tied")
