"""DMC models inside Hugging Face transformers (``dmc_train/conversion/hf_dmc``).

End to end: a tiny DMC model trained by the project is exported as a ``dmc_llama`` directory
(``tests/scripts/hf_dmc_checks.py``, which also records the project's logits, greedy continuations
and Algorithm 1 slot counts) and loaded with ``AutoModelForCausalLM.from_pretrained(...,
trust_remote_code=True)`` offline. Unit checks compare the modeling file's decisions, accumulation and
attention with ``kernels.dmc`` and its cached (prefill + decode) path with its cache-free forward.
"""

import json

import pytest
import torch

from dmc_train.conversion.hf_dmc import dmc_settings_from_method, write_dmc_files
from dmc_train.conversion.hf_dmc import modeling_dmc_llama as dmc_hf
from dmc_train.errors import ConfigError
from kernels.dmc import decisions
from kernels.dmc.reference import dense_dmc_attention, reference_partial_accumulation
from tests.helpers import run, run_json

pytestmark = pytest.mark.slow

TRAIN = ["launch/pretrain.py", "+recipe=tiny_pretrain", "method=dmc", "method.init_offset=0.0",
         "model.num_query_groups=4", "train.max_steps=3", "logging.progress=false"]


ACCUMULATIONS = {"exact": [], "window": ["method.accumulation=window", "method.window=3"]}


@pytest.fixture(scope="module", params=list(ACCUMULATIONS))
def exported(request, tmp_path_factory):
    """(project results, HF directory, accumulation) for a tiny DMC model trained 3 steps and exported."""
    root = tmp_path_factory.mktemp(f"hf_dmc_{request.param}")
    run([*TRAIN, *ACCUMULATIONS[request.param], f"run_dir={root / 'run'}"])
    run(["checkpoints_tools/export_hf.py", "--input", str(root / "run"), "--output", str(root / "hf")])
    res = run_json(["tests/scripts/hf_dmc_checks.py", str(root / "run")], str(root / "out.json"))
    return res, root / "hf", request.param


@pytest.fixture(scope="module")
def hf_model(exported):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(exported[1], trust_remote_code=True, local_files_only=True).eval()


def test_export_directory_loads_as_dmc_llama(exported, hf_model):
    res, hf_dir, accumulation = exported
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["model_type"] == "dmc_llama" and config["architectures"] == ["DMCLlamaForCausalLM"]
    assert config["dmc_decision_channel"] == 7 and config["dmc_accumulation"] == accumulation
    names = sorted(p.name for p in hf_dir.iterdir())
    assert {"README.md", "config.json", "manifest.json", "modeling_dmc_llama.py", "model.safetensors.index.json"} \
        <= set(names) and any(n.endswith(".safetensors") for n in names)
    manifest = json.loads((hf_dir / "manifest.json").read_text())
    assert manifest["method"] == "dmc" and manifest["dmc"]["dmc_accumulation"] == accumulation
    assert manifest["verification"]["max_abs_logit_diff"] <= 1e-4  # the exporter checked DMC's own forward
    assert type(hf_model).__name__ == "DMCLlamaForCausalLM" and hf_model.config.dmc_init_offset == 0.0
    # mixed decisions: the checks below see both appends and merges
    assert all(0.2 < f < 0.8 for f in res["merge_fraction"])


def test_forward_without_cache_matches_the_project(exported, hf_model):
    from transformers import AutoModelForCausalLM

    res, hf_dir, accumulation = exported
    batch = torch.tensor(res["batch"])
    with torch.no_grad():
        out = hf_model(batch, use_cache=False).logits
    torch.testing.assert_close(out, torch.tensor(res["logits"]), rtol=1e-4, atol=1e-4)
    if accumulation == "window":  # segments longer than the window occur: the window matters
        exact = AutoModelForCausalLM.from_pretrained(hf_dir, trust_remote_code=True, local_files_only=True,
                                                     dmc_accumulation="exact").eval()
        with torch.no_grad():
            assert (exact(batch, use_cache=False).logits - out).abs().max() > 1e-3


def test_greedy_generate_and_cache_lengths_match_the_project(exported, hf_model):
    res = exported[0]
    prompts = res["prompts"]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, ragged
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    new = len(res["greedy"][0])
    out = hf_model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
                            eos_token_id=None, return_dict_in_generate=True)
    assert out.sequences[:, width:].tolist() == res["greedy"] == res["engine_greedy"]  # HF, project, engine
    no_cache = hf_model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
                                 eos_token_id=None, use_cache=False)  # the cache-free forward, left-padded
    assert torch.equal(no_cache, out.sequences)
    own = dmc_hf.DMCCache(hf_model.config)  # a cache made by the package's copy of the modeling file
    hf_model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0,
                      eos_token_id=None, past_key_values=own)
    assert own.get_seq_length() == width + 1
    cache = out.past_key_values
    assert type(cache).__name__ == "DMCCache" and cache.get_seq_length() == width + new - 1  # the remote copy
    slots = cache.slot_counts()  # [layers, B, H_kv]
    for i in range(len(prompts)):  # Algorithm 1 on the project's hard decisions
        assert slots[:, i].tolist() == res["slots"][i] == res["engine_slots"][i]
    tokens = sum(len(p) + new - 1 for p in prompts) * slots.shape[0] * slots.shape[2]
    report = cache.compression()
    assert report["overall"] == pytest.approx(tokens / slots.sum().item())
    assert len(report["per_layer"]) == 4 and len(report["per_head"][0]) == 4 and report["overall"] > 1.2


@pytest.mark.parametrize("eps, threshold", [(decisions.OMEGA_EPS, 0.0), (2.0 ** -7, 0.3)])
def test_decisions_equal_the_projects(eps, threshold):
    gen = torch.Generator().manual_seed(0)
    b, hk, g, n, d, c, c0 = 2, 3, 2, 7, 8, 7, 0.3
    query = torch.randn(b, hk * g, n, d, generator=gen)
    key = torch.randn(b, hk, n, d, generator=gen)
    alpha, omega = dmc_hf.dmc_decisions(query, key, c, c0, omega_eps=eps, threshold=threshold)
    logit = decisions.alpha_logit(key[..., c], c0)
    assert torch.equal(alpha, decisions.hard_alpha(logit, threshold))
    if threshold:  # the threshold really moves decisions on these inputs
        assert not torch.equal(alpha, decisions.hard_alpha(logit))
    assert torch.equal(omega, decisions.omega(query[..., c].transpose(1, 2), hk, c0, eps).transpose(1, 2))
    real = torch.ones(b, hk, n, dtype=torch.bool)
    first, w = dmc_hf.sequence_rules(alpha, omega, real, torch.ones(b, dtype=torch.bool))
    assert torch.equal(first, decisions.first_token_appends(alpha, seq_dim=-1)) and torch.equal(w, omega)
    later, _ = dmc_hf.sequence_rules(alpha, omega, real, torch.zeros(b, dtype=torch.bool))
    assert torch.equal(later, alpha)  # a sequence with cached tokens decides its next token freely


@pytest.mark.parametrize("window", [None, 3])
def test_layer_attention_equals_the_kernel_references(window):
    """Eq. 9 (exact and windowed) + Fig. 3 with hard decisions, and left padding that changes nothing."""
    gen = torch.Generator().manual_seed(1)
    b, hk, g, n, d = 2, 2, 2, 12, 8
    q = torch.randn(b, hk * g, n, d, generator=gen)
    k, v = torch.randn(2, b, hk, n, d, generator=gen)
    alpha = decisions.first_token_appends((torch.rand(b, hk, n, generator=gen) < 0.6).float(), seq_dim=-1)
    omega = torch.rand(b, hk, n, generator=gen) + 0.1
    k_t, v_t = reference_partial_accumulation(k.double(), v.double(), alpha.double(), omega.double(), window)
    expected = dense_dmc_attention(q.double(), k_t, v_t, alpha.double(), scale=0.3).float()
    out = _layer(window).attend(q, k, v, alpha, omega, torch.ones(b, n, dtype=torch.bool), 0.3, store=False)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    pad = 3  # left padding: whatever the padded positions hold is neither decided on nor seen
    padded = [torch.cat([torch.randn(*t.shape[:2], pad, *t.shape[3:], generator=gen), t], dim=2) for t in (q, k, v)]
    a_pad, w_pad = (torch.cat([torch.rand(b, hk, pad, generator=gen), t], dim=-1) for t in (alpha, omega))
    real = (torch.arange(n + pad) >= pad).expand(b, -1)
    out = _layer(window).attend(*padded, a_pad, w_pad, real, 0.3, store=False)
    torch.testing.assert_close(out[:, :, pad:], expected, rtol=1e-5, atol=1e-5)


def _layer(window):
    layer = dmc_hf.DMCCacheLayer()
    layer.window = window
    return layer


@pytest.mark.parametrize("accumulation", ["exact", "window"])
def test_cached_prefill_and_decode_equal_the_cache_free_forward(accumulation):
    torch.manual_seed(0)
    config = dmc_hf.DMCLlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, dmc_init_offset=0.0,
                                   dmc_accumulation=accumulation, dmc_window=3)
    model = dmc_hf.DMCLlamaForCausalLM(config).eval()
    ids = torch.randint(0, 64, (2, 20))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = dmc_hf.DMCCache(config)
        steps = [model(ids[:, :5], past_key_values=cache).logits, model(ids[:, 5:12], past_key_values=cache).logits]
        steps += [model(ids[:, t: t + 1], past_key_values=cache).logits for t in range(12, 20)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    slots = cache.slot_counts()
    assert cache.get_seq_length() == 20 and bool((slots < 20).any()) and bool((slots > 1).all())
    assert cache.layers[0].keys.shape[2] == int(slots[0].max())  # padded to the longest head


def test_settings_from_the_method_config():
    from dmc_train.recipes import load_config

    cfg = load_config(["+recipe=tiny_pretrain", "method=dmc", "method.decision_channel=first",
                       "method.accumulation=window", "method.window=5", "method.variant=hardc",
                       "method.rope_order=pre", "method.omega_eps=0.0078125", "method.decision_threshold=0.00785"])
    assert dmc_settings_from_method(cfg.method, 8) == {
        "dmc_decision_channel": 0, "dmc_init_offset": 5.0, "dmc_omega_eps": 0.0078125,
        "dmc_decision_threshold": 0.00785, "dmc_accumulation": "window", "dmc_window": 5,
        "dmc_shared_decisions": True, "dmc_rope_order": "pre"}
    as_dict = {"name": "dmc", "decision_channel": "last", "init_offset": 0.5, "zero_out_steps": 10}
    assert dmc_settings_from_method(as_dict, 8, step=11)["dmc_decision_channel"] == 7  # meta.json's dict
    older = dmc_settings_from_method(as_dict, 8, step=11)  # saved before these options existed
    assert (older["dmc_rope_order"], older["dmc_omega_eps"], older["dmc_decision_threshold"]) == ("post", 1e-6, 0.0)
    with pytest.raises(ConfigError, match="zero-out stage"):  # step 10's rows are zeroed as step 10 starts
        dmc_settings_from_method(as_dict, 8, step=10)
    with pytest.raises(ConfigError, match="only DMC models"):
        dmc_settings_from_method(load_config(["+recipe=tiny_pretrain", "method=fixed_pooling"]).method, 8)


def test_write_dmc_files(tmp_path):
    config = write_dmc_files(str(tmp_path), {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                             "hidden_size": 64}, {"dmc_decision_channel": 7})
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_dmc_llama.DMCLlamaForCausalLM"
    assert config["hidden_size"] == 64 and config["dmc_decision_channel"] == 7
    assert (tmp_path / "modeling_dmc_llama.py").read_text().count("import dmc_train") == 0
    assert "padded" in (tmp_path / "README.md").read_text()
    with pytest.raises(ValueError, match="unknown DMC settings"):
        write_dmc_files(str(tmp_path), {}, {"dmc_typo": 1})
