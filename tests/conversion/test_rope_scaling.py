"""Llama 3.x RoPE scaling (``model.rope_scaling``: ``llama3``, ``linear``).

In this process: ``config.json`` in every spelling transformers 5.23 reads (``rope_parameters``,
legacy ``rope_scaling`` + ``rope_theta``, ``type`` for ``rope_type``, both at once, top-level fields),
read by the project and by transformers' own ``LlamaConfig``: the same type, parameters and, bit for
bit, the same frequencies; unsupported types refused in one line. End to end in one subprocess
(``tests/scripts/rope_scaling_checks.py``): tiny random Llamas built by transformers imported, run by
the training model and the engine, exported, and a DMC model with scaling exported and run under
``trust_remote_code``.
"""

import json

import pytest
import torch

from dmc_train.config import RopeScalingConfig
from dmc_train.errors import ConfigError
from dmc_train.models.hf_config import model_config_from_hf, rope_parameters
from dmc_train.models.rope import rope_inv_freq
from tests.helpers import run_json

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
BASE = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 128,
        "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5}
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

# config.json spellings: (extra fields, (type, rope_theta) transformers reads)
SPELLINGS = {
    "rope_parameters_llama3": ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3}},
                               ("llama3", 500000.0)),
    "rope_parameters_linear": ({"rope_parameters": {"rope_type": "linear", "rope_theta": 500000.0, "factor": 4.0}},
                               ("linear", 500000.0)),
    "rope_parameters_default": ({"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
                                ("default", 500000.0)),
    "legacy_llama3": ({"rope_scaling": {"rope_type": "llama3", **LLAMA3}, "rope_theta": 500000.0},
                      ("llama3", 500000.0)),
    "legacy_type_key": ({"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 20000.0},
                        ("linear", 20000.0)),
    "rope_type_beats_type": ({"rope_scaling": {"type": "linear", "rope_type": "llama3", **LLAMA3}},
                             ("llama3", 10000.0)),
    # the hand-edited file: rope_scaling replaces rope_parameters, whose theta is then unused
    "mixed": ({"rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
               "rope_scaling": {"rope_type": "llama3", **LLAMA3}}, ("llama3", 10000.0)),
    "mixed_top_level_theta": ({"rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
                               "rope_scaling": {"rope_type": "llama3", **LLAMA3}, "rope_theta": 20000.0},
                              ("llama3", 20000.0)),
    "parameters_without_theta": ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}, "rope_theta": 3000.0},
                                 ("linear", 3000.0)),
    "top_level_original_max": ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3},
                                "original_max_position_embeddings": 16}, ("llama3", 500000.0)),
    "no_original_max": ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0,
                                             **{k: v for k, v in LLAMA3.items() if "original" not in k}},
                         "max_position_embeddings": 512}, ("llama3", 500000.0)),
    "empty_rope_scaling": ({"rope_scaling": {}, "rope_parameters": {"rope_type": "default", "rope_theta": 7000.0}},
                           ("default", 7000.0)),
    "nothing": ({}, ("default", 10000.0)),
}


def _transformers(tmp_path, name, fields):
    """transformers' reading of the config.json: (rope_parameters after its RoPE init, inv_freq)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**BASE, **fields}))
    config = LlamaConfig.from_pretrained(str(path), local_files_only=True)
    inv_freq = LlamaRotaryEmbedding(config).inv_freq  # its init settles top-level overrides into the dict
    return dict(config.rope_parameters), inv_freq


@pytest.mark.parametrize("name", list(SPELLINGS))
def test_config_json_is_read_as_transformers_reads_it(name, tmp_path):
    fields, (hf_type, theta) = SPELLINGS[name]
    theirs, their_inv_freq = _transformers(tmp_path, name, fields)
    assert (theirs["rope_type"], theirs["rope_theta"]) == (hf_type, theta)  # the table above is transformers'
    model = model_config_from_hf({**BASE, **fields})
    scaling = RopeScalingConfig(**model["rope_scaling"])
    assert float(model["rotary_base"]) == theta
    assert {"default": "none"}.get(hf_type, hf_type) == scaling.type
    if hf_type in ("linear", "llama3"):
        assert scaling.factor == theirs["factor"]
    if hf_type == "llama3":
        assert (scaling.low_freq_factor, scaling.high_freq_factor, scaling.original_max_position_embeddings) == (
            theirs["low_freq_factor"], theirs["high_freq_factor"], theirs["original_max_position_embeddings"])
    head_dim = BASE["hidden_size"] // BASE["num_attention_heads"]
    assert torch.equal(rope_inv_freq(head_dim, float(model["rotary_base"]), scaling), their_inv_freq)


@pytest.mark.parametrize("name", ["rope_parameters_llama3", "rope_parameters_linear", "rope_parameters_default"])
def test_export_writes_what_it_read(name, tmp_path):
    """config.json -> model node -> rope_parameters (what the exporter writes) -> transformers: the same."""
    from omegaconf import OmegaConf

    from dmc_train.config import ModelConfig

    fields = SPELLINGS[name][0]
    node = OmegaConf.merge(OmegaConf.structured(ModelConfig), model_config_from_hf({**BASE, **fields}))
    written = rope_parameters(node)
    assert written == fields["rope_parameters"]
    _, theirs = _transformers(tmp_path, "written", {"rope_parameters": written})
    assert torch.equal(theirs, _transformers(tmp_path, "original", fields)[1])


@pytest.mark.parametrize("fields, text", [
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                          "original_max_position_embeddings": 64}}, "RoPE of type 'yarn' (rope_parameters)"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}, "rope_theta": 1e4}, "RoPE of type 'dynamic' (rope_scaling)"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}},
     "RoPE of type 'longrope' (rope_scaling)"),
    ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "default"}, "rope_scaling": {"rope_type": "yarn",
                                                                                        "factor": 2.0}},
     "RoPE of type 'yarn' (rope_scaling)"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}},
     "rope_parameters of type 'llama3' lacks low_freq_factor, high_freq_factor"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
])
def test_unsupported_rope_is_refused_in_one_line(fields, text):
    with pytest.raises(ConfigError) as e:
        model_config_from_hf({**BASE, **fields})
    assert text in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("override, text", [
    ("model.rope_scaling.type=yarn", "model.rope_scaling.type='yarn' is not one of none, llama3, linear"),
    ("model.rope_scaling={type:linear,factor:0}", "model.rope_scaling.factor=0.0 is not allowed"),
    ("model.rope_scaling={type:llama3,factor:8,low_freq_factor:4}", "0 < low_freq_factor < high_freq_factor"),
])
def test_model_option_is_checked(override, text):
    from dmc_train.recipes import load_config, validate

    with pytest.raises(ConfigError, match=text.replace("(", r"\(").replace(")", r"\)")):
        validate(load_config(["+recipe=tiny_pretrain", override]), 1)


@pytest.fixture(scope="module")
def end_to_end(tmp_path_factory):
    work = tmp_path_factory.mktemp("rope_scaling")
    return run_json(["tests/scripts/rope_scaling_checks.py", str(work)], str(work / "out.json"), env=OFFLINE)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama3", "linear"])
def test_import_runs_and_exports_like_transformers(end_to_end, kind):
    res = end_to_end[kind]
    assert res["rope_scaling"]["type"] == kind and res["logit_scale"] > 1
    # fp32 logits of the imported model over 96 positions (past the 32 original ones) = transformers'
    assert res["import_vs_transformers"] <= 1e-5 and res["past_original"] <= 1e-5
    assert res["megatron_inv_freq_equal"] and res["transformers_inv_freq_equal"]
    assert all(end_to_end["megatron_llama31"].values())  # megatron's own llama3 switch: the same frequencies
    assert res["engine_forward_vs_transformers"] <= 1e-5
    assert res["unscaled_vs_transformers"] > 0.1  # the scaling matters: unscaled RoPE is far off
    assert res["exported_rope_parameters"]["rope_type"] == kind
    assert res["export_vs_ours"] <= 1e-5 and res["export_verification"]["relative_error"] <= 1e-5


@pytest.mark.slow
def test_engine_greedy_tokens_equal_transformers_generate(end_to_end):
    res = end_to_end["llama3"]
    assert res["engine_greedy"] == res["hf_greedy"] and all(len(t) == 30 for t in res["hf_greedy"])


@pytest.mark.slow
def test_mixed_rope_parameters_and_rope_scaling_import_as_transformers_reads_them(end_to_end):
    res = end_to_end["mixed"]
    theirs = res["transformers_rope_parameters"]
    assert (theirs["rope_type"], theirs["rope_theta"]) == ("llama3", 10000.0)  # not the unscaled 500000
    assert res["rope_scaling"]["type"] == "llama3" and res["rotary_base"] == 10000
    assert res["import_vs_transformers"] <= 1e-5


@pytest.mark.slow
def test_dmc_model_with_scaling_exports_and_runs_under_trust_remote_code(end_to_end):
    res = end_to_end["dmc"]
    assert res["config"]["model_type"] == "dmc_llama" and res["config"]["dmc_rope_order"] == "pre"
    assert res["config"]["rope_parameters"]["rope_type"] == "llama3"
    assert res["export_verification"]["relative_error"] <= 1e-5
    # 64 positions (past the 16 original ones): the remote-code model and the engine's DMC forward
    assert res["remote_vs_ours"] <= 1e-5 and res["engine_forward_vs_ours"] <= 1e-5
    # cached generate (DMC cache, accumulated raw keys rotated with the scaled RoPE) = the engine's DMC cache
    assert res["hf_greedy"] == res["engine_greedy"] and all(len(t) == 24 for t in res["hf_greedy"])
