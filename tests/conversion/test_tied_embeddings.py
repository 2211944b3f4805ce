"""Tied embeddings stay tied: a tied Hugging Face Llama imports as one matrix, trains as one matrix (megatron's
``share_embeddings_and_output_weights``), and exports tied; the export imports back bit for bit."""

import json
import os

import pytest
import torch

from tests.helpers import run
from tests.scripts.hf_import_checks import make

pytestmark = pytest.mark.slow

ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _keys(ckpt):
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)


def _state(ckpt):
    from dmc_train.training.model_state import read_model_state

    state, _ = read_model_state(str(ckpt))
    return state


@pytest.fixture(scope="module")
def tied_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("tied")
    make(str(work / "hf"), "mha_tied")
    run(["checkpoints_tools/import_hf.py", "--input", str(work / "hf"), "--output", str(work / "imported")], env=ENV)
    run(["launch/pretrain.py", "+recipe=tiny_pretrain", "train.max_steps=2", "train.eval_interval=0",
         "checkpoint.save_interval=0", "model.tie_embeddings=true", f"checkpoint.init_from={work / 'imported'}",
         f"run_dir={work / 'run'}"], env=ENV)
    run(["checkpoints_tools/export_hf.py", "--input", str(work / "run"), "--output", str(work / "exported")], env=ENV)
    run(["checkpoints_tools/import_hf.py", "--input", str(work / "exported"), "--output", str(work / "reimported")],
        env=ENV)
    return work


def test_import_stores_one_matrix(tied_run):
    keys = _keys(tied_run / "imported")
    assert "embedding.word_embeddings.weight" in keys and "output_layer.weight" not in keys
    config = json.loads((tied_run / "imported" / "meta.json").read_text())["config"]["model"]
    assert config["tie_embeddings"] is True


def test_training_keeps_one_matrix_and_changes_it(tied_run):
    trained = tied_run / "run" / "checkpoints" / "iter_0000002"
    assert "output_layer.weight" not in _keys(trained)
    before, after = _state(tied_run / "imported"), _state(trained)
    assert "output_layer.weight" not in after
    assert not torch.equal(before["embedding.word_embeddings.weight"], after["embedding.word_embeddings.weight"])


def test_export_is_tied_and_round_trips(tied_run):
    from safetensors import safe_open

    exported = tied_run / "exported"
    assert json.loads((exported / "config.json").read_text())["tie_word_embeddings"] is True
    names = set()
    for shard in (p for p in os.listdir(exported) if p.endswith(".safetensors")):
        with safe_open(str(exported / shard), "pt") as f:
            names |= set(f.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    manifest = json.loads((exported / "manifest.json").read_text())
    assert manifest["verification"]["relative_error"] <= 1e-5
    trained, back = _state(tied_run / "run" / "checkpoints" / "iter_0000002"), _state(tied_run / "reimported")
    assert sorted(trained) == sorted(back)
    assert all(torch.equal(trained[k], back[k]) for k in trained)
