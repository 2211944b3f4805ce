"""method=less on the megatron trainer: a short real run lowers every layer's validation MSE and leaves the
base bit-identical; TP=2 and PP=2 give one process's losses; the run generates with its LESS cache; bad
settings fail in one line."""

import json

import pytest
import torch

from tests.helpers import run

pytestmark = pytest.mark.slow

TRAIN = ["launch/pretrain.py", "+recipe=tiny_pretrain", "logging.progress=false"]
LESS = ["method=less", "method.budget=16", "method.hidden=32", "method.dropout=0.0", "optim.lr=1e-2",
        "optim.warmup_steps=0"]


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("less_runs")
    run([*TRAIN, "train.eval_interval=0", "train.max_steps=4", f"run_dir={root / 'base'}"])
    # this base's attention outputs are small (LESS's MSE ~3e-6, gradients ~1e-9): with Adam's default eps (1e-5)
    # the kernels would hardly move, so the run that must learn divides by the gradients' own scale
    run([*TRAIN, *LESS, "optim.eps=1e-12", "train.max_steps=6", "train.eval_interval=3", "checkpoint.save_interval=3",
         "checkpoint.keep_last=2", f"checkpoint.init_from={root / 'base'}", f"run_dir={root / 'less'}"])
    # the layouts' reference: one process, the settings of test_tensor_pipeline_and_data_parallel_... (default eps:
    # with eps 1e-12 Adam's steps are sign-like and amplify float-rounding differences between layouts)
    run([*TRAIN, *LESS, "train.max_steps=3", "train.eval_interval=0", f"checkpoint.init_from={root / 'base'}",
         f"run_dir={root / 'one'}"])
    return root


def test_training_lowers_every_layers_validation_mse_and_keeps_the_base(runs):
    from dmc_train.inference.model import LlamaForInference

    metas = [json.loads(p.read_text())["method_metadata"]
             for p in sorted((runs / "less" / "checkpoints").glob("iter_*/meta.json"))]
    evals = [m["val_less_mse_layers"] for m in metas]  # the validation just before each save (steps 3 and 6)
    assert len(evals) == 2 and all(late < early for early, late in zip(*evals)), evals
    assert all(m["lr"] > 0 for m in metrics(runs / "less"))
    base, _ = LlamaForInference.from_checkpoint(str(runs / "base"))
    less, _ = LlamaForInference.from_checkpoint(str(runs / "less"))
    for name in ("embed", "lm_head", "final_norm"):
        assert torch.equal(getattr(base, name), getattr(less, name))
    for a, b in zip(base.layers, less.layers):
        assert all(torch.equal(getattr(a, key), getattr(b, key))  # the base is frozen: bit-identical
                   for key in ("qkv_t", "o_t", "gate_up_t", "down_t", "norm_in", "norm_mlp"))
    assert less.default_cache == "less" and less.method.budget == 16 and len(less.method.layers) == 4
    assert less.method.layers[0]["q1"].shape[-1] == 32 and less.method.rank == 8  # method.hidden=32, the default rank
    assert metas[-1]["policy"] == "h2o" and len(evals[-1]) == 4
    assert sorted((runs / "less" / "checkpoints").glob("iter_*/less_mse.png"))


@pytest.mark.distributed
@pytest.mark.parametrize("name, layout", [("tp2", ["parallel.tensor=2"]), ("pp2", ["parallel.pipeline=2"]),
                                          ("dp2", [])])  # two processes and no split of the model: data parallel
def test_tensor_pipeline_and_data_parallel_give_one_process_losses(runs, name, layout):
    out = runs / name
    run([*TRAIN, *LESS, "train.max_steps=3", "train.eval_interval=0", f"checkpoint.init_from={runs / 'base'}", *layout,
         f"run_dir={out}"], nproc=2)
    single = [m["less_mse_layers"] for m in metrics(runs / "one")]
    parallel = [m["less_mse_layers"] for m in metrics(out)]
    torch.testing.assert_close(torch.tensor(parallel), torch.tensor(single), rtol=1e-5, atol=0)


def test_a_less_run_generates_with_its_cache(runs, tmp_path):
    out = tmp_path / "gen.json"
    proc = run(["launch/generate.py", "--checkpoint", str(runs / "less"), "--prompt", " ".join(map(str, range(5, 45))),
                "--token-ids", "--max-new-tokens", "10", "--json", str(out)])
    result = json.loads(out.read_text())["outputs"][0]
    assert "KV cache (less)" in proc.stdout
    assert {c for layer in result["entries"] for c in layer} == {16}
    assert result["kv_bytes"]["state"] > 0


@pytest.mark.parametrize("args, message", [
    (["method.policy=nope"], "unknown policy 'nope'; the policies are h2o"),
    (["method.policy=lsh_e", "method.budget=8", "checkpoint.init_from={base}"],
     "leaves lsh_e no room beside its fixed part"),
    (["checkpoint.init_from=/nonexistent/base"], "/nonexistent/base"),
    (["model.num_layers=2", "checkpoint.init_from={base}"], "num_layers"),
])
def test_bad_less_settings_are_one_line(runs, tmp_path, args, message):
    proc = run([*TRAIN, *LESS, "train.max_steps=1", *[a.format(base=runs / "base") for a in args],
                f"run_dir={tmp_path / 'bad'}"], check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1 and message in errors[0], proc.stderr[-2000:]
