"""The inference side on real checkpoints: the same logits as the training model (vanilla/GQA, and
DMC with hard decisions), Algorithm 1's slot counts in the cache, and the generate command."""

import json

import pytest

from tests.helpers import run, run_json
from tests.test_data_tokenizer import tiny_docs

pytestmark = pytest.mark.slow

TRAIN = ["launch/pretrain.py", "+recipe=tiny_pretrain", "logging.progress=false", "train.eval_interval=0"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("inference_runs")
    # init_offset 0: about half of the untrained model's decisions merge, so the cache really compresses
    run([*TRAIN, "method=dmc", "method.init_offset=0.0", "train.max_steps=4", f"run_dir={root / 'dmc'}"])
    run([*TRAIN, "method=dmc", "method.init_offset=0.0", "method.rope_order=pre", "method.accumulation=window",
         "method.window=3", "model.num_query_groups=4", "train.max_steps=2", f"run_dir={root / 'dmc_pre'}"])
    run([*TRAIN, "model.num_query_groups=4", "train.max_steps=2", f"run_dir={root / 'gqa'}"])
    # saved at TP=2: the inference model reads the global tensors from the files, whatever layout wrote them
    run([*TRAIN, "method=dmc", "method.init_offset=0.0", "model.num_query_groups=4", "parallel.tensor=2",
         "train.max_steps=2", f"run_dir={root / 'dmc_tp2'}"], nproc=2)
    return root


def test_inference_model_and_cache_match_the_training_model(runs, tmp_path):
    names = ("dmc", "dmc_pre", "gqa", "dmc_tp2")
    res = run_json(["tests/scripts/inference_checks.py", *(str(runs / name) for name in names)],
                   str(tmp_path / "out.json"))
    dmc, pre, gqa, tp2 = (res[str(runs / name)] for name in names)
    for r in (dmc, pre, gqa, tp2):
        assert r["forward_vs_training"] < 1e-4
        assert r["engine_vs_training"] < 1e-4  # prefill + ragged batched decode, fp32
    for r in (dmc, pre, tp2):  # GQA + DMC, rope_order=pre with window accumulation too, saved at TP=2
        assert r["entries"] == r["algorithm1"]  # [sequence][layer][KV head]
    counts = [c for seq in dmc["entries"] for layer in seq for c in layer]
    assert 1 < min(counts) and max(counts) < 48  # compressed, and not to a single slot
    assert {c for seq in gqa["entries"] for layer in seq for c in layer} == {48}
    assert len(gqa["entries"][0][0]) == 4  # GQA: one row per KV group


def test_an_engine_leaves_its_process_as_it_found_it(runs, tmp_path):
    """Engine.from_checkpoint starts no process group and sets no environment variable (MASTER_PORT left
    behind made a child launch/generate.py fail with EADDRINUSE); a child inheriting the environment as it
    is then generates."""
    import os
    import subprocess
    import sys

    import torch.distributed as dist
    from megatron.core import parallel_state

    from dmc_train.inference import Engine, SamplingParams
    from tests.helpers import ROOT

    before = dict(os.environ)
    engine = Engine.from_checkpoint(str(runs / "dmc_tp2"))
    assert dict(os.environ) == before
    assert not dist.is_initialized() and not parallel_state.model_parallel_is_initialized()
    assert len(engine.generate([[5, 17, 42]], SamplingParams(max_new_tokens=3))[0].tokens) == 3
    proc = subprocess.run([sys.executable, "launch/generate.py", "--checkpoint", str(runs / "gqa"), "--prompt", "5 17",
                           "--token-ids", "--max-new-tokens", "2"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_generate_command_streams_and_reports_compression(runs, tmp_path):
    out = tmp_path / "gen.json"
    proc = run(["launch/generate.py", "--checkpoint", str(runs / "dmc"), "--prompt", "5 17 42 7 7 300",
                "--token-ids", "--max-new-tokens", "12", "--kv-bytes", "1MB", "--json", str(out)])
    result = json.loads(out.read_text())
    tokens = result["outputs"][0]["tokens"]
    assert proc.stdout.split("\n")[0].split() == [str(t) for t in tokens]  # streamed as produced
    assert "achieved compression:" in proc.stdout and "KV cache (dmc)" in proc.stdout
    assert result["summary"]["compression"] > 1 and len(result["summary"]["per_layer"]) == 4

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("1 2 3\n\n9 9 9 9 9\n4\n")
    proc = run(["launch/generate.py", "--checkpoint", str(runs / "gqa"), "--prompts-file", str(prompts),
                "--token-ids", "--max-new-tokens", "5", "--max-batch", "2"])
    assert sorted(line[:3] for line in proc.stdout.splitlines() if line.startswith("[")) == ["[0]", "[1]", "[2]"]
    assert "KV cache (full)" in proc.stdout and "achieved compression: 1.00x" in proc.stdout


def test_generate_command_with_a_tokenizer(runs, tmp_path):
    from dmc_train.data.tokenizer import train_sentencepiece

    tok = train_sentencepiece(tiny_docs(), str(tmp_path / "tok.model"), vocab_size=400)
    proc = run(["launch/generate.py", "--checkpoint", str(runs / "dmc"), "--tokenizer", tok.path,
                "--prompt", "The king", "--max-new-tokens", "8", "--temperature", "0.8", "--seed", "3",
                "--json", str(tmp_path / "gen.json")])
    out = json.loads((tmp_path / "gen.json").read_text())["outputs"][0]
    assert proc.stdout.startswith("The king" + out["text"])
    assert out["prompt_tokens"] == tok.encode("The king") and len(out["tokens"]) == 8


@pytest.mark.parametrize("args, message", [
    (["--checkpoint", "{runs}/missing", "--prompt", "1", "--token-ids"], "does not exist"),
    (["--checkpoint", "{runs}/gqa", "--prompt", "1", "--token-ids", "--cache", "dmc"],
     "the 'dmc' cache needs a DMC model"),
    (["--checkpoint", "{runs}/dmc", "--prompt", "hello"], "this model has no tokenizer"),
])
def test_generate_command_bad_input(runs, args, message):
    proc = run(["launch/generate.py", *[a.format(runs=runs) for a in args]], check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1 and message in errors[0], proc.stderr[-2000:]


def test_every_policy_and_schedule_through_the_generate_command(runs, tmp_path):
    """The whole registry: prefill + 50 decode steps of a ragged batch on a GQA checkpoint."""
    from dmc_train.policies import POLICIES
    from launch.generate import main

    prompts = tmp_path / "prompts.txt"
    lengths = (30, 3, 17)
    prompts.write_text("\n".join(" ".join(str(5 + (7 * i + j) % 200) for j in range(n)) for i, n in enumerate(lengths)))
    budget = 24
    for policy in POLICIES:
        for schedule in ("decode", "prefill"):
            out = tmp_path / f"{policy}_{schedule}.json"
            main(["--checkpoint", str(runs / "gqa"), "--prompts-file", str(prompts), "--token-ids", "--max-new-tokens",
                  "50", "--cache", policy, "--budget", str(budget), "--schedule", schedule, "--json", str(out)])
            result = json.loads(out.read_text())
            for o, n in zip(result["outputs"], lengths):
                assert o["error"] is None and len(o["tokens"]) == 50
                written = n + 49  # the last sampled token is never fed
                kept = budget if schedule == "decode" else max(1, int(n * 0.5)) + 49
                assert {c for layer in o["entries"] for c in layer} == {min(kept, written)}, (policy, schedule)
                assert len(o["entries"][0]) == 4  # one row per KV group


def test_policies_on_a_trained_checkpoint_keep_what_the_parallel_form_keeps(runs):
    """Engine vs parallel form on the GQA checkpoint (4 KV groups), every policy and schedule."""
    import torch

    from dmc_train.inference.model import LlamaForInference
    from dmc_train.policies import POLICIES
    from tests.inference.test_policy_caches import assert_engine_matches_parallel

    model, _ = LlamaForInference.from_checkpoint(str(runs / "gqa"))
    g = torch.Generator().manual_seed(0)
    sequences = [torch.randperm(model.shape.vocab_size, generator=g)[:n] for n in (70, 45)]
    for policy in POLICIES:
        for schedule in ("decode", "prefill"):
            assert_engine_matches_parallel(model, policy, schedule, sequences, prompt_lens=[40, 2], budget=24)


def test_evaluate_command_with_an_eviction_policy(runs):
    """launch/evaluate.py eval.cache=<policy>: a budget covering the sequence is the model's own perplexity;
    a smaller one is the policy's; bad settings are one line."""
    gqa = ["launch/evaluate.py", "+recipe=tiny_pretrain", "model.num_query_groups=4", f"run_dir={runs / 'gqa'}"]
    run(gqa)
    model = json.loads((runs / "gqa" / "eval.json").read_text())
    run([*gqa, "eval.cache=tova", "eval.budget=64"])  # 64 = train.seq_length: nothing is evicted
    full = json.loads((runs / "gqa" / "eval_tova_64.json").read_text())
    assert full["valid_ppl"] == pytest.approx(model["valid_ppl"], rel=1e-5)
    proc = run([*gqa, "eval.cache=knorm", "eval.budget=8", "eval.max_sequences=4"])
    small = json.loads((runs / "gqa" / "eval_knorm_8.json").read_text())
    assert "cache knorm, budget 8 (decode)" in proc.stdout
    assert small["valid_tokens"] == 4 * 64 and small["valid_ppl"] != pytest.approx(model["valid_ppl"], rel=1e-5)
    assert "| gqa | knorm | 8 (0.125) |" in proc.stdout  # the harness's table row: entries (fraction of the context)
    for args, message in ((["eval.cache=h2x"], "unknown cache 'h2x'; expected auto or one of full, dmc, h2o"),
                          (["eval.cache=lsh_e", "eval.budget=5"], "leaves lsh_e no room beside its fixed part"),
                          (["eval.cache=h2o", f"run_dir={runs / 'dmc'}", "model.num_query_groups=null", "method=dmc"],
                           "is a DMC model (evaluate it with eval.cache=model)")):
        proc = run([*gqa, *args], check=False)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert proc.returncode == 2 and len(errors) == 1 and message in errors[0], proc.stderr[-2000:]
