"""Bad input of the inference, conversion and study tools and of the CPU kernels' build: one line naming the cause
and the fix, exit code 2, no traceback, nothing written or lost (docs/INFERENCE.md, docs/CONVERSION.md,
docs/EVALUATION.md). The validation functions are checked in-process, one row per case; a subprocess row where the
entry point's exit code and wiring are the point."""

import json
import os
import signal
import subprocess
import sys
import time
import types
import warnings

import pytest

from dmc_train.errors import CheckpointError, ConfigError, DataError
from tests.helpers import ROOT, TEST_DEVICE, run
from tests.test_bad_input import assert_one_line_error, tree_digest

TINY = ["+recipe=tiny_pretrain", "train.max_steps=1", "train.eval_interval=0"]
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def one_line(error: Exception, *fragments: str) -> None:
    text = str(error)
    assert "\n" not in text, text
    for fragment in fragments:
        assert fragment in text, text


# -- policy and method options: one schema (policy_config) for the CLI, the Python API and the trainer ----------
@pytest.mark.parametrize("policy, options, fragment", [
    ("keyformer", {"recent_fraction": "0,3"}, "keyformer option recent_fraction='0,3' must be a number"),
    ("lsh_e", {"bits": "many"}, "lsh_e option bits='many' must be a whole number"),
    ("keyformer", {"seed": "abc"}, "keyformer option seed='abc' must be a whole number"),
    ("keyformer", {"noise": 1}, "keyformer option noise=1 must be true or false"),
    ("tova", {"aggregate": 2}, "tova option aggregate=2 must be a name"),
    ("h2o", {"seed": 3}, "h2o has no option 'seed'; its options are budget, schedule, compression_ratio, aggregate"),
    ("h2o", {"compression_ratio": 0.3}, "compression_ratio is read by the prefill schedule only"),
    ("h2o", {"budget": float("nan")}, "budget=nan must be a whole number of entries >= 1 or a fraction"),
    ("h2o3", {}, "unknown policy 'h2o3'; the policies are h2o, tova"),
])
def test_policy_options_are_checked_by_one_schema(policy, options, fragment):
    from dmc_train.policies import policy_config

    with pytest.raises(ConfigError) as e:
        policy_config(policy, options)
    one_line(e.value, fragment)


def test_lightcache_options_go_through_the_same_schema():
    from dmc_train.policies.lightcache import LightCacheConfig

    for options, fragment in (({"top_k": "x"}, "lightcache option top_k='x' must be a whole number"),
                              ({"seed": 1}, "lightcache has no option 'seed'")):
        with pytest.raises(ConfigError) as e:
            LightCacheConfig.from_options(options)
        one_line(e.value, fragment)
    assert LightCacheConfig.from_options({"global": 2.0, "local": None}).global_ == 2


@pytest.mark.parametrize("override, fragment", [
    ("+method.policy_options.recent_fraction=abc", "method=less with method.policy=h2o: h2o option recent_fraction="),
    ("+method.policy_options.seed=1", "h2o has no option 'seed'"),
])
def test_less_policy_options_fail_with_the_config(override, fragment):
    from dmc_train.recipes import load_config, validate

    with pytest.raises(ConfigError) as e:
        validate(load_config([*TINY, "method=less", override]), 1)
    one_line(e.value, fragment)


# -- Hugging Face directories: a damaged config.json, layers it does not list -----------------------------------
@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A 2-layer random ``LlamaForCausalLM`` directory (safetensors, no tokenizer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("hf") / "llama"
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def damaged_copy(src, dest, edit):
    import shutil

    shutil.copytree(src, dest)
    hf = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps(edit(hf)))
    return dest


def without(key):
    return lambda hf: {k: v for k, v in hf.items() if k != key}


@pytest.mark.parametrize("edit, fragments", [
    (without("hidden_size"), ["config.json lacks hidden_size", "restore the model's config.json"]),
    (lambda hf: {}, ["lacks num_hidden_layers, hidden_size, intermediate_size, num_attention_heads, vocab_size"]),
    (lambda hf: [], ["config.json is not a JSON object"]),
    (lambda hf: {**hf, "hidden_size": "abc"}, ["sets hidden_size='abc', not a positive whole number"]),
    (lambda hf: {**hf, "num_key_value_heads": 0}, ["sets num_key_value_heads=0"]),
    (lambda hf: {**hf, "num_hidden_layers": 1}, ["hold 2 layers but its config.json lists num_hidden_layers=1"]),
])
def test_import_refuses_a_damaged_config_and_writes_nothing(hf_dir, tmp_path, edit, fragments):
    from dmc_train.conversion.hf_import import import_hf

    src = damaged_copy(hf_dir, tmp_path / "in", edit)
    before = tree_digest(src)
    with pytest.raises(CheckpointError) as e:
        import_hf(str(src), str(tmp_path / "out"))
    one_line(e.value, *fragments)
    assert tree_digest(src) == before and sorted(os.listdir(tmp_path)) == ["in"]


# -- the entry points: exit code 2, one line, nothing written ----------------------------------------------------
@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("saved") / "run"
    run(["launch/pretrain.py", *TINY, f"run_dir={run_dir}"])
    return run_dir


def test_command_lines_fail_in_one_line_and_write_nothing(saved_run, hf_dir, tmp_path):
    empty_config = damaged_copy(hf_dir, tmp_path / "hf_empty", lambda hf: {})
    cells = tmp_path / "study" / "cells"
    cells.mkdir(parents=True)
    (cells / "vanilla.json").write_text('{"name": "vanilla", "ppl": ')
    generate = ["launch/generate.py", "--checkpoint", str(saved_run), "--token-ids", "--prompt", "5 17 42"]
    rows = [  # argv, fragments of the error line, the directory that must stay as it was
        ([*generate, "--cache", "keyformer", "--policy-option", "recent_fraction=0,3"],
         ["keyformer option recent_fraction='0,3' must be a number"], saved_run),
        ([*generate, "--max-new-tokens", "60", "--kv-bytes", "64KB", "--max-batch", "1"],
         ["the request needs", "more KV pages", "raise kv_bytes or lower max_new_tokens"], saved_run),
        ([*generate, "--device", "cuda:7"], ["device='cuda:7' but", "use device=cpu"
                                             if TEST_DEVICE == "cpu" else "choose one of those"], saved_run),
        ([*generate, "--dtype", "fp16"], ["fp16 on the CPU is not supported", "fp16 on a GPU (device=cuda)"],
         saved_run),
        (["checkpoints_tools/import_hf.py", "--input", str(empty_config), "--output", str(tmp_path / "imported")],
         ["config.json lacks num_hidden_layers"], empty_config),
        (["launch/pretrain.py", *TINY, f"checkpoint.init_from={empty_config}", f"run_dir={tmp_path / 'from_hf'}"],
         ["config.json lacks num_hidden_layers"], empty_config),
        (["launch/pretrain.py", *TINY, "method=less", f"run_dir={tmp_path / 'less'}"],
         ["method=less distils from a frozen base model", "set checkpoint.init_from="], None),
        (["launch/study.py", "cell=vanilla", f"out={tmp_path / 'study'}"],
         [f"study cell file {cells / 'vanilla.json'} cannot be read", "delete it to run the cell again"],
         tmp_path / "study"),
    ]
    for argv, fragments, kept in rows:
        before = tree_digest(kept) if kept else None
        proc = run(argv, check=False, env=ENV)
        assert_one_line_error(proc, *fragments)
        assert kept is None or tree_digest(kept) == before, argv
    assert sorted(os.listdir(tmp_path)) == ["hf_empty", "study"]  # no output, no run directory


def test_evaluation_names_an_unknown_cache_before_the_model_kind(monkeypatch):
    from dmc_train.errors import InferenceError
    from dmc_train.evaluation import perplexity
    from dmc_train.inference.model import LlamaForInference

    dmc_model = types.SimpleNamespace(decisions=object(), default_cache="dmc")
    monkeypatch.setattr(LlamaForInference, "from_checkpoint", staticmethod(lambda ckpt, device: (dmc_model, None)))
    cfg = types.SimpleNamespace(eval=types.SimpleNamespace(cache="nope", device="cpu"))
    with pytest.raises(InferenceError) as e:
        perplexity.evaluate_with_cache(cfg, "ckpt", {})
    one_line(e.value, "unknown cache 'nope'; expected auto or one of full, dmc")


# -- the study: a cell file that is not a cell, SIGTERM while a run trains ---------------------------------------
@pytest.mark.parametrize("text, fragment", [
    ('{"name": "x", "ppl": ', "cannot be read (Expecting value"),
    ("[1, 2]", "is not a cell's results (no name, checkpoint, cache, ppl)"),
    ('{"name": "x"}', "is not a cell's results (no checkpoint, cache, ppl)"),
])
def test_a_damaged_cell_file_is_named(tmp_path, text, fragment):
    from dmc_train.evaluation import study

    path = tmp_path / "cell.json"
    path.write_text(text)
    with pytest.raises(DataError) as e:
        study.read_cell(str(path))
    one_line(e.value, f"study cell file {path}", fragment, "delete it to run the cell again")


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def test_sigterm_stops_the_study_and_its_training_subprocess(tmp_path):
    base = "base=[" + ",".join(f'"{a}"' for a in [*TINY, f"run_dir={tmp_path / 'base'}"]) + "]"
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "launch/study.py", "--quick", base, "cell=vanilla",
                             f"out={tmp_path / 'study'}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not _children(proc.pid) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    children = _children(proc.pid)
    assert children, "the study started no training subprocess"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, (out[-2000:], err[-3000:])
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "stopped by SIGTERM" in errors[0] and "run the study again to resume" in errors[0]
    assert "Traceback" not in err
    assert not any(os.path.exists(f"/proc/{c}") for c in children)  # the training run stopped with it
    assert not (tmp_path / "study" / "cells").exists()  # the cell is not marked finished: a re-run does it


# -- the CPU kernels' build: one warning per process and cause, a damaged cached library rebuilt ----------------
def _sources():
    from kernels.eviction import cpu as eviction
    from kernels.layer import cpu as layer
    from kernels.paged import cpu as paged
    from kernels.sampling import cpu as sampling

    return [m.SOURCE for m in (paged, eviction, layer, sampling)]


def _load_all(monkeypatch) -> list[str]:
    """Every family's library loaded as a fresh process would; the warnings' texts."""
    from kernels import compiled

    monkeypatch.setattr(compiled, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        libs = [compiled.load(source, f"family {source.parent.name}") for source in _sources()]
    assert libs == [None] * len(libs)
    return [str(w.message) for w in caught]


@pytest.mark.parametrize("cause, fragment", [
    ("no_compiler", "no C compiler (cc) found: the CPU kernels run their PyTorch paths"),
    ("unwritable_cache", "is writable (DMC_KERNELS_CACHE)"),
])
def test_one_warning_per_process_for_a_missing_compiler_or_an_unwritable_cache(monkeypatch, tmp_path, cause,
                                                                                 fragment):
    if cause == "no_compiler":
        monkeypatch.setenv("CC", "")
        monkeypatch.setenv("PATH", str(tmp_path))
    else:
        (tmp_path / "file").write_text("")
        monkeypatch.setenv("DMC_KERNELS_CACHE", str(tmp_path / "file" / "kernels"))  # below a file: never a dir
    messages = _load_all(monkeypatch)
    assert len(messages) == 1 and fragment in messages[0], messages


def test_a_library_is_built_once_into_the_cache_directory(monkeypatch, tmp_path):
    """(The sampling kernel: every family's library is built by the same code, and it compiles in a second where
    the paged-attention one takes half a minute.)"""
    from kernels import compiled
    from kernels.sampling import cpu as sampling

    monkeypatch.setenv("DMC_KERNELS_CACHE", str(tmp_path))
    assert compiled.load(sampling.SOURCE, "sampling") is not None
    built = list(tmp_path.iterdir())
    assert len(built) == 1 and built[0].suffix == ".so"
    stamp = built[0].stat().st_mtime_ns
    assert compiled.load(sampling.SOURCE, "sampling") is not None and built[0].stat().st_mtime_ns == stamp  # loaded


def test_a_damaged_cached_library_is_rebuilt(monkeypatch, tmp_path):
    from kernels import compiled
    from kernels.sampling import cpu as sampling

    monkeypatch.setenv("DMC_KERNELS_CACHE", str(tmp_path / "built"))
    assert compiled.load(sampling.SOURCE, "sampling") is not None
    name = os.listdir(tmp_path / "built")[0]
    (tmp_path / "damaged").mkdir()
    (tmp_path / "damaged" / name).write_bytes(b"")  # an emptied file under a path never loaded in this process
    monkeypatch.setenv("DMC_KERNELS_CACHE", str(tmp_path / "damaged"))
    monkeypatch.setattr(compiled, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lib = compiled.load(sampling.SOURCE, "sampling", {"argmax_f32": []})
    assert lib is not None and caught == []
    assert (tmp_path / "damaged" / name).stat().st_size > 0

