"""LESS checkpoints hold the kernels (and their Adam state) plus a reference to the base: resume is exact at TP=2
and with the distributed optimizer and reshards to PP=2; inference and evaluation load through the reference;
a moved base is found again (a moved tree) or named in one line (set_base.py re-points it); another base is
refused in one line. ``checkpoint.keep_best`` keeps the best validated checkpoint from ``keep_last``."""

import json
import shutil

import pytest
import torch

from tests.helpers import run, run_json
from tests.test_bad_input import assert_one_line_error, tree_digest

pytestmark = pytest.mark.slow

TRAIN = ["launch/pretrain.py", "+recipe=tiny_pretrain", "logging.progress=false"]
LESS = ["method=less", "method.budget=16", "method.hidden=32", "method.dropout=0.0", "optim.lr=1e-2",
        "optim.warmup_steps=0"]
PROMPT = ["--prompt", " ".join(map(str, range(5, 45))), "--token-ids", "--max-new-tokens", "4"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("less_ckpt")
    run([*TRAIN, "train.eval_interval=0", "train.max_steps=4", f"run_dir={root / 'base'}"])
    run([*TRAIN, *LESS, "train.max_steps=6", "train.eval_interval=3", "checkpoint.save_interval=3",
         "checkpoint.keep_last=1", "checkpoint.keep_best=true", f"checkpoint.init_from={root / 'base'}",
         f"run_dir={root / 'less'}"])
    return root


def dir_bytes(path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def test_a_checkpoint_holds_the_kernels_and_names_its_base(runs):
    from dmc_train.training.base_reference import saved_keys

    ckpt = runs / "less" / "checkpoints" / "iter_0000006"
    model = [k for k in saved_keys(str(ckpt)) if k.split(".")[0] in ("embedding", "decoder", "output_layer")]
    assert model and all(".less." in k for k in model)
    base = json.loads((ckpt / "meta.json").read_text())["base"]
    assert base["path"] == str(runs / "base" / "checkpoints" / "iter_0000004") and base["step"] == 4
    assert base["kind"] == "checkpoint" and base["model"]["num_layers"] == 4
    assert base["relative"] == "../../../base/checkpoints/iter_0000004"
    assert dir_bytes(ckpt) < dir_bytes(runs / "base" / "checkpoints" / "iter_0000004") / 3


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("less_layouts")
    return run_json(["tests/scripts/less_checkpoint_checks.py", str(tmp / "work")], str(tmp / "out.json"), nproc=2)


@pytest.mark.distributed
def test_resume_is_exact_and_reshards(layouts):
    assert layouts["first_half"] == layouts["full_tp2"][:3]
    assert layouts["resume_tp2"] == layouts["full_tp2"][3:]  # bitwise: the base from its reference, the rest saved
    assert layouts["resume_distopt"] == layouts["full_dp2"][3:]
    torch.testing.assert_close(torch.tensor(layouts["resume_pp2"]), torch.tensor(layouts["full_tp2"][3:]),
                               rtol=1e-5, atol=0)


def _same_layers(a, b) -> bool:
    """Every decoder-layer tensor of two inference models is equal (LlamaLayer's fused weights and norms)."""
    names = ("qkv_t", "o_t", "gate_up_t", "down_t", "norm_in", "norm_mlp")
    return all(torch.equal(getattr(x, n), getattr(y, n)) for x, y in zip(a.layers, b.layers) for n in names)


def test_inference_and_evaluation_load_the_base_through_the_reference(runs, tmp_path):
    from dmc_train.inference.model import LlamaForInference

    base, _ = LlamaForInference.from_checkpoint(str(runs / "base"))
    less, _ = LlamaForInference.from_checkpoint(str(runs / "less"))
    assert torch.equal(base.embed, less.embed) and less.default_cache == "less" and len(less.method.layers) == 4
    assert _same_layers(base, less)
    common = ["launch/evaluate.py", "+recipe=tiny_pretrain", "data.kind=synthetic"]
    (tmp_path / "eval_base").mkdir()
    (tmp_path / "eval_less").mkdir()
    on_base = run([*common, f"run_dir={tmp_path / 'eval_base'}",
                   f"checkpoint.resume={runs / 'base'}/checkpoints/latest"])
    on_less = run([*common, *LESS, f"run_dir={tmp_path / 'eval_less'}",
                   f"checkpoint.resume={runs / 'less'}/checkpoints/best"])
    loss = [[line for line in p.stdout.splitlines() if "perplexity" in line] for p in (on_base, on_less)]
    assert loss[0] and [line.split()[2] for line in loss[0]] == [line.split()[2] for line in loss[1]]  # frozen base


def test_a_moved_base_is_found_with_its_run_or_named_in_one_line(runs, tmp_path):
    a = tmp_path / "a"
    shutil.copytree(runs, a, ignore=shutil.ignore_patterns("*.png"))
    run(["checkpoints_tools/set_base.py", "--input", str(a / "less"), "--base", str(a / "base")])
    b = tmp_path / "b"
    a.rename(b)  # the whole tree moved: found at the recorded relative path
    run(["launch/generate.py", "--checkpoint", str(b / "less"), *PROMPT])
    (b / "base").rename(tmp_path / "elsewhere")
    before = tree_digest(b / "less")
    proc = run(["launch/generate.py", "--checkpoint", str(b / "less"), *PROMPT], check=False)
    assert_one_line_error(proc, f"its base {a / 'base'}/checkpoints/iter_0000004 (step 4) is missing",
                          "checkpoints_tools/set_base.py")
    assert tree_digest(b / "less") == before
    run(["checkpoints_tools/set_base.py", "--input", str(b / "less"), "--base", str(tmp_path / "elsewhere")])
    proc = run(["launch/generate.py", "--checkpoint", str(b / "less"), *PROMPT])
    assert "KV cache (less)" in proc.stdout


def test_another_base_is_refused_in_one_line(runs, tmp_path):
    other, later = tmp_path / "other", tmp_path / "later"  # another shape; the same shape at another step
    run([*TRAIN, "train.eval_interval=0", "train.max_steps=1", "model.num_layers=2", f"run_dir={other}"])
    run([*TRAIN, "train.eval_interval=0", "train.max_steps=1", f"run_dir={later}"])
    before = tree_digest(runs / "less")
    for base, message in ((other, "is another model (num_layers 4 vs 2)"), (later, "another state of the base")):
        proc = run(["checkpoints_tools/set_base.py", "--input", str(runs / "less"), "--base", str(base)], check=False)
        assert_one_line_error(proc, message, f"set_base.py --input {runs / 'less'} --base")
    assert tree_digest(runs / "less") == before
    copy = tmp_path / "copy"  # the LESS run beside a base that was replaced by another model at the same path
    shutil.copytree(runs / "less", copy / "less")
    shutil.copytree(other, copy / "base")
    meta_path = copy / "less" / "checkpoints" / "iter_0000006" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["base"]["path"] = str(copy / "base" / "checkpoints" / "iter_0000001")
    meta_path.write_text(json.dumps(meta))
    proc = run(["launch/generate.py", "--checkpoint", str(copy / "less"), *PROMPT], check=False)
    assert_one_line_error(proc, "is another model (num_layers 4 vs 2)")


def test_the_best_validated_checkpoint_outlives_keep_last(runs, tmp_path):
    ckpts = runs / "less" / "checkpoints"
    metas = {p.parent.name: json.loads(p.read_text()) for p in ckpts.glob("iter_*/meta.json")}
    best = (ckpts / "best").read_text()
    assert best in metas and metas[best]["validation"]["metric"] == "val_less_mse"
    assert metas[best]["validation"]["value"] == min(m["validation"]["value"] for m in metas.values())
    # the LM loss as the metric (the default): a step-3 checkpoint, then a learning rate that makes it worse
    lm = [*TRAIN, "train.max_steps=6", "train.eval_interval=3", "checkpoint.save_interval=3", "checkpoint.keep_last=1",
          "checkpoint.keep_best=true", f"run_dir={tmp_path / 'lm'}"]
    run([*lm, "train.max_steps_per_job=3"])
    run([*lm, "optim.lr=1.0"])
    ckpts = tmp_path / "lm" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["best", "iter_0000003", "iter_0000006", "latest"]
    assert (ckpts / "best").read_text() == "iter_0000003" and (ckpts / "latest").read_text() == "iter_0000006"
    run(["launch/generate.py", "--checkpoint", str(ckpts / "best"), *PROMPT])


def test_keep_best_needs_an_evaluation_at_every_save():
    from dmc_train.errors import ConfigError
    from dmc_train.recipes import load_config, validate

    cfg = load_config(["+recipe=tiny_pretrain", "checkpoint.keep_best=true", "train.eval_interval=2",
                       "checkpoint.save_interval=3"])
    with pytest.raises(ConfigError, match=r"checkpoint.keep_best=true .* \(now 2 and 3\)"):
        validate(cfg, 1)


def test_choose_best_takes_the_lowest_of_the_newest_metric(tmp_path):
    from dmc_train.training.best_checkpoint import choose_best, validation_record

    values = {"iter_1": ("val_loss", 1.0), "iter_2": ("val_less_mse", 0.5), "iter_3": ("val_less_mse", 0.2),
              "iter_4": ("val_less_mse", 0.2), "iter_5": None}
    for name, record in values.items():
        (tmp_path / name).mkdir()
        meta = {"validation": {"metric": record[0], "value": record[1]}} if record else {}
        (tmp_path / name / "meta.json").write_text(json.dumps(meta))
    assert choose_best(str(tmp_path), list(values)) == "iter_3"  # a tie keeps the earlier one
    assert choose_best(str(tmp_path), ["iter_5"]) is None
    assert validation_record("val_loss", 6, (6, {"val_loss": float("nan")})) is None
    assert validation_record("val_loss", 6, (3, {"val_loss": 1.0})) is None  # not the weights validated
    assert validation_record("val_loss", 6, (6, {"val_loss": 1.0})) == {"metric": "val_loss", "value": 1.0}


def test_a_hugging_face_base_is_referenced_and_loaded(runs, tmp_path):
    from dmc_train.inference.model import LlamaForInference

    hf = tmp_path / "hf"
    run(["checkpoints_tools/export_hf.py", "--input", str(runs / "base"), "--output", str(hf)])
    run([*TRAIN, *LESS, "train.max_steps=2", "train.eval_interval=0", f"checkpoint.init_from={hf}",
         f"run_dir={tmp_path / 'less'}"])
    meta = json.loads((tmp_path / "less" / "checkpoints" / "iter_0000002" / "meta.json").read_text())
    assert meta["base"]["kind"] == "hf" and meta["base"]["path"] == str(hf) and meta["base"]["step"] is None
    base, _ = LlamaForInference.from_checkpoint(str(runs / "base"))
    less, _ = LlamaForInference.from_checkpoint(str(tmp_path / "less"))
    assert torch.equal(base.embed, less.embed) and _same_layers(base, less)
    run([*TRAIN, *LESS, "train.max_steps=3", "train.eval_interval=0", f"run_dir={tmp_path / 'less'}"])  # resumes


def test_the_export_of_a_less_run_is_refused_in_one_line(runs, tmp_path):
    proc = run(["checkpoints_tools/export_hf.py", "--input", str(runs / "less"), "--output", str(tmp_path / "hf")],
               check=False)
    assert_one_line_error(proc, "is a LESS model", f"export its base {runs / 'base'}/checkpoints/iter_0000004")
    assert not (tmp_path / "hf").exists()
