"""dmc_train.cluster.memory against a hand computation, the published Llama 2 sizes and a measurement."""

import os

import pytest
from helpers import ROOT, free_port, run_json

from dmc_train.cluster import memory
from dmc_train.recipes import load_config

BASE = ["train.precision=bf16", "train.seq_length=4096", "train.micro_batch_size=1", "train.global_batch_size=1024"]


def test_llama2_7b_tp2_sp_distributed_optimizer_by_hand():
    cfg = load_config(["model=llama2_7b", *BASE, "parallel.tensor=2", "parallel.sequence_parallel=true",
                       "parallel.distributed_optimizer=true"])
    est = memory.estimate_memory(cfg, world_size=8)  # TP=2, DP=4
    h, f, v, layers, s, heads, hd = 4096, 11008, 32000, 32, 4096, 32, 128
    # parameters on one rank: half of each layer's matrices + both norms, half of embedding and head
    per_layer = (4 * h * h + 3 * h * f) // 2 + 2 * h
    p = layers * per_layer + 2 * (v * h // 2) + h
    assert p == 3_369_340_928
    assert est["parameters"] == 2 * p  # bf16
    assert est["gradients"] == 4 * p  # fp32 grad buffer
    assert est["optimizer"] == 12 * p // 4  # fp32 main params + 2 Adam moments, sharded over DP=4
    assert est["parameters"] + est["gradients"] + est["optimizer"] == 9 * p  # megatron's 6 + 12/DP
    # activations (bf16, sequence parallel: everything split by TP=2), per layer and token:
    norms = 2 * (8 * h + 4) + 2 * 2 * h  # fp32 x and y + rstd per norm, bf16 norm outputs
    attention = 2 * h * (3 + 3) + 4 * heads  # MHA: QKV (+ rotated Q, K), output; fp32 LSE
    mlp = 5 * 2 * f
    layer = s * (norms + attention + mlp) // 2 + 4 * s * hd * 2 + 2 * 4 * h
    head = s * (8 * h + 4 + 2 * h) // 2 + s * v * 6 // 2  # final norm, fp32 + bf16 logits
    assert est["activations"] == layers * layer + head == 16_425_426_944
    assert est["total"] == 9 * p + est["activations"]
    assert est["checkpoint_model_bf16"] == 2 * 6_738_415_616
    assert est["checkpoint_with_optimizer"] == 14 * 6_738_415_616


@pytest.mark.parametrize("model, published", [("llama2_7b", 6.74e9), ("llama2_13b", 13.0e9), ("llama2_70b", 69.0e9)])
def test_parameter_counts(model, published):
    """The one formula (dmc_train.models.shape; tests/models/test_llama_weights.py checks it against a
    built model) matches the published sizes and the checkpoint-size estimate."""
    from dmc_train.models.shape import count_parameters

    cfg = load_config([f"model={model}", *BASE])
    n = count_parameters(cfg.model)
    assert round(n / 1e9, 2 if published < 1e10 else 1) == published / 1e9
    assert memory.estimate_memory(cfg, 8)["checkpoint_model_bf16"] == 2 * n


def test_pipeline_holds_one_model_of_activations_on_the_first_stage():
    cfg = load_config(["model=llama2_70b", *BASE, "parallel.tensor=8", "parallel.pipeline=4"])
    lay = memory.layout_of(cfg, 32)
    assert memory._inflight_layer_microbatches(cfg, lay, 0) == 80  # 4 micro-batches x 20 layers
    assert memory._inflight_layer_microbatches(cfg, lay, 3) == 20
    cfg = load_config(["model=llama2_70b", *BASE, "parallel.tensor=8", "parallel.pipeline=4",
                       "parallel.virtual_pipeline=5"])
    lay = memory.layout_of(cfg, 32)
    assert memory._inflight_layer_microbatches(cfg, lay, 0) == pytest.approx(80 * (1 + 3 / 20))
    full = memory.estimate_memory(load_config(["model=llama2_70b", *BASE, "parallel.tensor=8", "parallel.pipeline=4",
                                               "train.recompute=full"]), 32)
    assert full["activations"] < memory.estimate_memory(cfg, 32)["activations"] / 10


def test_layer_activations_match_saved_tensors(tmp_path):
    """The per-layer formula equals what the real modules save (TP=1, GQA, CPU, bf16 and fp32)."""
    over = ["model=tiny", "model.hidden_size=256", "model.ffn_hidden_size=688", "model.num_attention_heads=8",
            "model.num_query_groups=2", "model.vocab_size=1024", "train.seq_length=128", "train.micro_batch_size=1"]
    got = run_json(["tests/scripts/saved_activations.py", *over], str(tmp_path / "out.json"),
                   env={"MASTER_PORT": str(free_port())})
    for precision in ("bf16", "fp32"):
        expected = memory.layer_activation_bytes(load_config([*over, f"train.precision={precision}"]))
        assert got[precision] == expected, precision


def test_docs_table_is_current():
    """docs/CLUSTER.md shows the output of `python launch/estimate_memory.py --doc-table`."""
    with open(os.path.join(ROOT, "docs", "CLUSTER.md")) as f:
        assert memory.doc_tables(load_config) in f.read()
