"""dmc_train.models.llama_weights: the fused QKV / fc1 layout, the megatron <-> Hugging Face name map,
the parameter-count formula. Pure-torch checks here; the checks on real megatron models run in a
subprocess (tests/scripts/llama_weights_checks.py: the CPU compatibility layer is process-wide)."""

import pytest
import torch

from dmc_train.models.llama_weights import (
    HF_TO_MEGATRON,
    MEGATRON_TO_HF,
    hf_names,
    hf_to_megatron,
    megatron_to_hf,
    merge_fc1,
    merge_qkv,
    qkv_by_group,
    split_fc1,
    split_qkv,
)
from tests.helpers import free_port, run, run_json

SHAPES = [(8, 8), (8, 4), (8, 2), (8, 1), (4, 2), (6, 3)]  # (heads, groups)


def _qkv(heads, groups, device, d=3, hidden=5, seed=0):
    """Drawn on CPU (the same values on every device), then moved to ``device``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(groups * (heads // groups + 2) * d, hidden, generator=gen, dtype=torch.float64).to(device)


def _rows(w, d, row_block):  # rows of the row_block-th block of d rows
    return w[row_block * d:(row_block + 1) * d]


@pytest.mark.parametrize("heads, groups", SHAPES)
def test_by_group_view_is_the_manual_indexing(heads, groups, device):
    d, w = 3, _qkv(heads, groups, device)
    per = heads // groups
    view = qkv_by_group(w, heads, groups)
    assert view.shape == (groups, per + 2, d, 5) and view.data_ptr() == w.data_ptr()
    for g in range(groups):
        base = g * (per + 2)  # block index of group g's first query head
        for j in range(per):
            assert torch.equal(view[g, j], _rows(w, d, base + j))
        assert torch.equal(view[g, per], _rows(w, d, base + per))  # key
        assert torch.equal(view[g, per + 1], _rows(w, d, base + per + 1))  # value


def test_by_group_view_edits_in_place_and_fits_a_tensor_parallel_shard(device):
    heads, groups, tp = 8, 4, 2
    w = _qkv(heads, groups, device)
    full = qkv_by_group(w.clone(), heads, groups)
    shard = w[: w.shape[0] // tp]  # rank 0's rows of the column-parallel linear_qkv
    assert torch.equal(qkv_by_group(shard, heads // tp, groups // tp), full[: groups // tp])
    qkv_by_group(w, heads, groups)[:, :, 1, :] = 0  # e.g. DMC's decision channel
    assert (w.view(-1, 3, 5)[:, 1] == 0).all() and (w.view(-1, 3, 5)[:, 0] != 0).all()


@pytest.mark.parametrize("heads, groups", SHAPES)
def test_split_merge_round_trip(heads, groups, device):
    d, w = 3, _qkv(heads, groups, device)
    q, k, v = split_qkv(w, heads, groups)
    assert q.shape == (heads, d, 5) and k.shape == v.shape == (groups, d, 5)
    view = qkv_by_group(w, heads, groups)
    for j in range(heads):  # query head j belongs to group j // (heads/groups)
        assert torch.equal(q[j], view[j // (heads // groups), j % (heads // groups)])
    assert torch.equal(k, view[:, -2]) and torch.equal(v, view[:, -1])
    assert torch.equal(merge_qkv(q, k, v), w)
    q2, k2, v2 = (torch.randn_like(x) for x in (q, k, v))
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(merge_qkv(q2, k2, v2), heads, groups), (q2, k2, v2)))


def test_qkv_shape_errors(device):
    with pytest.raises(ValueError, match="must divide"):
        qkv_by_group(_qkv(8, 4, device), 8, 3)
    with pytest.raises(ValueError, match="not \\[16 \\* head_dim, hidden\\]"):
        qkv_by_group(torch.zeros(25, 5, device=device), 8, 4)
    with pytest.raises(ValueError, match="cannot merge"):
        merge_qkv(*(torch.zeros(shape, device=device) for shape in ((8, 3, 5), (3, 3, 5), (3, 3, 5))))


def test_fc1_split_merge(device):
    w = torch.randn(2 * 7, 4).to(device)
    gate, up = split_fc1(w)
    assert torch.equal(gate, w[:7]) and torch.equal(up, w[7:])
    assert torch.equal(merge_fc1(gate, up), w)
    with pytest.raises(ValueError, match="odd number of rows"):
        split_fc1(torch.zeros(7, 4, device=device))
    with pytest.raises(ValueError, match="differ in shape"):
        merge_fc1(torch.zeros(7, 4, device=device), torch.zeros(6, 4, device=device))


def test_name_map_is_one_to_one():
    assert len(HF_TO_MEGATRON) == sum(len(v) for v in MEGATRON_TO_HF.values())
    assert hf_names("decoder.layers.12.self_attention.linear_qkv.weight") == (
        "model.layers.12.self_attn.q_proj.weight", "model.layers.12.self_attn.k_proj.weight",
        "model.layers.12.self_attn.v_proj.weight")
    assert hf_names("decoder.layers.3.pre_mlp_layernorm.weight") == ("model.layers.3.post_attention_layernorm.weight",)
    assert hf_names("output_layer.weight") == ("lm_head.weight",)
    with pytest.raises(KeyError, match="no Hugging Face name"):
        hf_names("decoder.layers.0.self_attention.core_attention.weight")


def _synthetic_state(device, heads=8, groups=2, layers=2, d=4, ffn=12, vocab=16):
    hidden = heads * d
    sd = {"embedding.word_embeddings.weight": torch.randn(vocab, hidden)}
    for i in range(layers):
        p = f"decoder.layers.{i}."
        sd.update({p + "input_layernorm.weight": torch.randn(hidden),
                   p + "self_attention.linear_proj.weight": torch.randn(hidden, hidden),
                   p + "self_attention.linear_proj._extra_state": None,
                   p + "self_attention.linear_qkv.weight": torch.randn((heads + 2 * groups) * d, hidden),
                   p + "pre_mlp_layernorm.weight": torch.randn(hidden),
                   p + "mlp.linear_fc1.weight": torch.randn(2 * ffn, hidden),
                   p + "mlp.linear_fc2.weight": torch.randn(hidden, ffn)})
    sd.update({"decoder.final_layernorm.weight": torch.randn(hidden),
               "output_layer.weight": torch.randn(vocab, hidden)})
    return {name: t if t is None else t.to(device) for name, t in sd.items()}  # drawn on CPU


def test_state_dict_round_trip_and_errors(device):
    sd = _synthetic_state(device)
    hf = megatron_to_hf(sd, 8, 2)
    assert hf["model.layers.1.self_attn.k_proj.weight"].shape == (2 * 4, 32)
    assert hf["model.layers.0.mlp.up_proj.weight"].shape == (12, 32)
    storages = [t.untyped_storage().data_ptr() for t in hf.values()]
    assert len(set(storages)) == len(storages)  # safetensors-friendly: no shared storage
    assert all(t.device.type == device.type for t in hf.values())
    back = hf_to_megatron({**hf, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(2, device=device)}, 8, 2)
    weights = {k: v for k, v in sd.items() if not k.endswith("_extra_state")}
    assert set(back) == set(weights) and all(torch.equal(back[k], weights[k]) for k in weights)
    with pytest.raises(KeyError, match="no megatron name"):
        hf_to_megatron({**hf, "model.layers.0.self_attn.q_norm.weight": torch.zeros(2, device=device)}, 8, 2)
    with pytest.raises(KeyError, match="needs model.layers.1.mlp.up_proj.weight"):
        hf_to_megatron({k: v for k, v in hf.items() if k != "model.layers.1.mlp.up_proj.weight"}, 8, 2)
    with pytest.raises(ValueError, match="do not fit 8 heads and 4 groups"):
        hf_to_megatron(hf, 8, 4)
    with pytest.raises(KeyError, match="no Hugging Face name"):
        megatron_to_hf({"decoder.layers.0.self_attention.dmc.weight": torch.zeros(2, device=device)}, 8, 2)


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("llama_weights")
    return run_json(["tests/scripts/llama_weights_checks.py"], str(tmp / "out.json"),
                    env={"MASTER_PORT": str(free_port())})


@pytest.mark.parametrize("kind", ["gqa", "mha"])
def test_on_a_real_megatron_model(real, kind):
    r = real[kind]
    groups = 2 if kind == "gqa" else 8
    assert r["count"] == r["numel"]  # count_parameters is what the model builds
    assert r["qkv_error"] == 0.0  # our split = megatron's get_query_key_value_tensors
    expected = {"embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"}
    for i in range(2):
        expected |= {f"decoder.layers.{i}.{n}" for n in (
            "input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
            "pre_mlp_layernorm.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight")}
    assert set(r["megatron_keys"]) == expected
    hf = r["hf_shapes"]
    assert len(hf) == 3 + 2 * 9
    assert hf["model.layers.0.self_attn.q_proj.weight"] == [64, 64]
    k, v = hf["model.layers.1.self_attn.k_proj.weight"], hf["model.layers.1.self_attn.v_proj.weight"]
    assert k == v == [8 * groups, 64]
    assert hf["model.layers.0.mlp.gate_proj.weight"] == hf["model.layers.0.mlp.up_proj.weight"] == [176, 64]
    assert r["round_trip"] == {"same_keys": True, "bit_equal": True}
    reload = r["reload"]
    assert reload["missing"] == [] and reload["unexpected"] == []
    assert reload["differed_before"] > 0.1 and reload["error"] == 0.0
    assert r["hf_logits_error"] < 1e-5  # the map means the same model under Hugging Face semantics


def test_imports_stay_light():
    """llama_weights: torch only (no megatron, methods, training, launch); shape and the memory
    estimate (SLURM dry run): no torch."""
    code = ("import sys\n"
            "import dmc_train.models.shape, dmc_train.cluster.memory\n"
            "assert 'torch' not in sys.modules, 'shape/memory import torch'\n"
            "import dmc_train.models.llama_weights\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('megatron', 'launch') or "
            "m.startswith(('dmc_train.methods', 'dmc_train.training'))]\n"
            "assert not bad, bad\n")
    run(["-c", code], fresh=True)  # what it imports: a fresh interpreter
