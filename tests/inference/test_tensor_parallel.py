"""Tensor-parallel inference (TP=2 under torchrun, gloo) equals the whole model: logits within 1e-5 (fp32),
the same greedy tokens, each rank's cache holding its own KV heads' rows; launch/generate.py under torchrun."""

import json

import pytest
import torch

from dmc_train.errors import InferenceError
from dmc_train.inference import tensor_parallel as tp
from dmc_train.inference.caches.less import LESSWeights
from dmc_train.inference.dmc_decisions import DMCInference
from dmc_train.inference.method import InferenceMethod
from dmc_train.inference.model import ModelShape, random_weights
from dmc_train.models.dmc_settings import DMCSettings
from tests.helpers import run, run_json

SHAPE = ModelShape(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_heads=4, num_kv_heads=2, vocab_size=50)
TRAIN = ["launch/pretrain.py", "+recipe=tiny_pretrain", "logging.progress=false", "train.eval_interval=0"]


def test_shards_are_the_heads_and_mlp_parts_of_training():
    w = random_weights(SHAPE)
    local, shape = tp.shard_weights(w, SHAPE, 1, 2)
    assert (shape.num_heads, shape.num_kv_heads, shape.ffn_hidden_size, shape.head_dim) == (2, 1, 64, 16)
    p = "model.layers.0."
    assert torch.equal(local[p + "self_attn.q_proj.weight"], w[p + "self_attn.q_proj.weight"][32:])
    assert torch.equal(local[p + "self_attn.k_proj.weight"], w[p + "self_attn.k_proj.weight"][16:])
    assert torch.equal(local[p + "self_attn.o_proj.weight"], w[p + "self_attn.o_proj.weight"][:, 32:])
    assert torch.equal(local[p + "mlp.up_proj.weight"], w[p + "mlp.up_proj.weight"][64:])
    assert torch.equal(local[p + "mlp.down_proj.weight"], w[p + "mlp.down_proj.weight"][:, 64:])
    assert local["lm_head.weight"] is w["lm_head.weight"]


def test_one_line_errors():
    with pytest.raises(InferenceError, match="tensor_parallel=4 does not divide the model's 2 KV heads"):
        tp.check(SHAPE, 4, InferenceMethod())
    with pytest.raises(InferenceError, match="variant hardc"):
        tp.check(SHAPE, 2, DMCInference(DMCSettings(channel=0, variant="hardc")))
    with pytest.raises(InferenceError, match="a LESS checkpoint cannot run tensor-parallel"):
        tp.check(SHAPE, 2, LESSWeights("h2o", 8))
    with pytest.raises(InferenceError, match="needs 2 processes, one per rank, and this is a single process: run "
                                             "torchrun --nproc_per_node=2"):
        tp.start(2)
    assert tp.start(1) == (0, None)
    for method in (DMCInference(DMCSettings(channel=0, variant="hardc")), LESSWeights("h2o", 8)):
        tp.check(SHAPE, 1, method)  # TP=1 runs every model


@pytest.fixture(scope="module")
def dmc_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_runs")
    run([*TRAIN, "method=dmc", "method.init_offset=0.0", "model.num_query_groups=4", "train.max_steps=2",
         f"run_dir={root / 'dmc'}"])
    return root / "dmc"


@pytest.mark.slow
def test_tp2_equals_tp1(dmc_run, tmp_path):
    ranks = run_json(["tests/scripts/tp_inference_checks.py", str(dmc_run)], str(tmp_path / "out.json"),
                     nproc=2)["ranks"]
    for name in ("full", "dmc", "dmc_pre", str(dmc_run)):  # random GQA and DMC models; a DMC checkpoint (GQA)
        r0, r1 = (r[name] for r in ranks)
        for r in (r0, r1):
            assert r["forward"] < 1e-5 and r["engine"] < 1e-5  # teacher-forced; batched prefill + ragged decode
            assert r["tokens"][0] == r["tokens"][1]  # greedy: TP=2 as TP=1
        assert r0["seeded"] == r1["seeded"]  # unseeded sampling: the same tokens on both ranks
        # each rank's cache holds its own KV heads: side by side, the whole model's cache
        assert [a + b for a, b in zip(r0["entries"], r1["entries"])] == r0["whole_entries"]
    assert "the 'h2o' cache does not run tensor-parallel" in ranks[0]["full"]["h2o"]  # DMC models refuse it anyway
    dmc = ranks[0][str(dmc_run)]
    assert dmc["entries"] != ranks[1][str(dmc_run)]["entries"]  # DMC heads compress differently per rank


@pytest.mark.slow
def test_generate_under_torchrun(dmc_run, tmp_path):
    args = ["launch/generate.py", "--checkpoint", str(dmc_run), "--prompt", "5 17 42 7 7 300", "--prompt", "9 9",
            "--token-ids", "--max-new-tokens", "10", "--kv-bytes", "1MB"]
    run([*args, "--json", str(tmp_path / "tp1.json")])
    proc = run([*args, "--tensor-parallel", "2", "--json", str(tmp_path / "tp2.json")], nproc=2, fresh=True)
    tp1, tp2 = (json.loads((tmp_path / f"tp{n}.json").read_text())["outputs"] for n in (1, 2))
    assert [o["tokens"] for o in tp2] == [o["tokens"] for o in tp1]
    assert proc.stdout.count("--- summary") == 1  # rank 0 prints
