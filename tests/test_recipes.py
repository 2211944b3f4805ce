"""Every recipe composes against the schema and validates for its intended layout (no model built)."""

import os
import sys

import pytest

from dmc_train.errors import ConfigError
from dmc_train.recipes import load_config, recipes_dir, validate

RECIPES = sorted(f[:-5] for f in os.listdir(os.path.join(recipes_dir(), "recipe")) if f.endswith(".yaml"))
BIG = {"llama2_7b": (6.74e9, 8), "llama2_13b": (13.0e9, 8), "llama2_70b": (69.0e9, 64)}
BIG.update({"dmc_7b": BIG["llama2_7b"], "dmc_13b": BIG["llama2_13b"], "dmc_70b": BIG["llama2_70b"],
            "gqa_7b": (6.20e9, 8)})  # 16 KV heads instead of 32
TOKENS_PER_STEP = 1024 * 4096


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_composes_and_validates(name):
    overrides = [f"+recipe={name}"]
    cfg = load_config(overrides)
    if cfg.data.kind == "indexed" and not cfg.data.get("prefixes", None):
        cfg = load_config(overrides + ["data.prefixes=[/data/corpus_text_document]"])
    world = BIG.get(name, (None, cfg.parallel.tensor * cfg.parallel.pipeline))[1]
    validate(cfg, world_size=world)


@pytest.mark.parametrize("name", sorted(BIG))
def test_big_recipes_carry_paper_settings(name):
    from dmc_train.models.shape import count_parameters

    cfg = load_config([f"+recipe={name}", "data.prefixes=[x]"])
    o = cfg.optim
    assert (o.beta1, o.beta2, o.eps, o.weight_decay, o.clip_grad) == (0.9, 0.95, 1e-5, 0.1, 1.0)
    assert o.lr == (1.5e-5 if name.endswith("70b") else 3e-5) and o.schedule == "constant"
    assert (cfg.train.global_batch_size, cfg.train.seq_length, cfg.train.precision) == (1024, 4096, "bf16")
    assert count_parameters(cfg.model) == pytest.approx(BIG[name][0], rel=0.005)


@pytest.mark.parametrize("name", ["dmc_7b", "dmc_13b", "dmc_70b", "gqa_7b"])
def test_retrofit_recipes_follow_the_paper_schedule(name):
    cfg = load_config([f"+recipe={name}", "data.prefixes=[x]"])
    d, steps = cfg.method, cfg.train.max_steps
    assert steps * TOKENS_PER_STEP == pytest.approx(33e9, rel=0.01)  # 1B zero-out + 24B ramp + 8B finetune
    if name.startswith("dmc"):
        assert cfg.method.name == "dmc" and d.target_cr == 2.0
        assert d.zero_out_steps * TOKENS_PER_STEP == pytest.approx(1e9, rel=0.05)
        assert d.ramp_steps * TOKENS_PER_STEP == pytest.approx(24e9, rel=0.001)
        assert d.finetune_steps * TOKENS_PER_STEP == pytest.approx(8e9, rel=0.001)
        assert d.zero_out_steps + d.ramp_steps + d.finetune_steps == steps
    else:
        assert cfg.method.name == "none" and cfg.model.num_query_groups == 16
    if name == "dmc_70b":
        assert cfg.model.num_query_groups == 8  # GQA 8x + DMC 2x


@pytest.mark.parametrize("name", ["llama3_8b", "dmc_llama3_8b", "gqa_llama3_8b"])
def test_llama3_recipes_scale_the_paper_schedule_to_the_model(name):
    """Llama 3.1 8B (llama3 RoPE scaling, 8 KV heads): the paper's settings and token budgets at Llama 3's
    8192-token context, 512 x 8192 tokens per step = the paper's 1024 x 4096."""
    from dmc_train.models.shape import count_parameters

    cfg = load_config([f"+recipe={name}", "data.prefixes=[x]"])
    m, o, t = cfg.model, cfg.optim, cfg.train
    assert (m.rotary_base, m.num_attention_heads, m.vocab_size, m.max_position_embeddings) == (500000, 32, 128256,
                                                                                              131072)
    assert dict(m.rope_scaling) == {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192}
    assert (o.beta1, o.beta2, o.eps, o.weight_decay, o.clip_grad, o.lr, o.schedule) == (
        0.9, 0.95, 1e-5, 0.1, 1.0, 3e-5, "constant")
    assert (t.global_batch_size * t.seq_length, t.seq_length, t.precision) == (TOKENS_PER_STEP, 8192, "bf16")
    validate(cfg, world_size=8)
    if name == "dmc_llama3_8b":
        d = cfg.method
        assert cfg.method.name == "dmc" and d.target_cr == 2.0 and m.num_query_groups == 8  # GQA 4x + DMC 2x
        assert (d.zero_out_steps, d.ramp_steps, d.finetune_steps, t.max_steps) == (250, 5722, 1907, 7879)
    if name == "gqa_llama3_8b":
        assert m.num_query_groups == 4 and t.max_steps == 7879
        validate(load_config([f"+recipe={name}", "data.prefixes=[x]", "model.num_query_groups=2"]), world_size=8)
    else:
        assert count_parameters(m) == pytest.approx(8.03e9, rel=0.001)


def test_dmc_tiny_serves_dmc_and_fixed_pooling():
    """dmc_tiny's run name carries the CR: DMC's method.target_cr, or fixed pooling's method.pool."""
    assert load_config(["+recipe=dmc_tiny"]).run_name == "dmc_tiny_cr2.0"
    cfg = load_config(["+recipe=dmc_tiny", "method=fixed_pooling", "method.pool=4"])
    assert cfg.run_name == "fixed_pooling_tiny_cr4"
    validate(cfg, world_size=cfg.parallel.tensor * cfg.parallel.pipeline)


def test_unknown_key_is_rejected():
    with pytest.raises(Exception, match="nonexistent"):
        load_config(["+recipe=tiny_pretrain", "train.nonexistent=1"])


@pytest.mark.parametrize("override, message", [
    (["parallel.tensor=3"], "does not divide model.num_attention_heads=8"),
    (["model.num_query_groups=2", "parallel.tensor=4"], "does not divide model.num_query_groups=2"),
    (["parallel.pipeline=2"], "world size 1 is not divisible"),
    (["train.precision=fp8"], "train.precision='fp8' is not one of fp32, bf16, fp16"),
    (["train.global_batch_size=7"], "global_batch_size=7 is not divisible"),
    (["model.num_query_groups=3"], "num_query_groups=3 does not divide"),
    (["optim.lr=-0.001"], "optim.lr=-0.001 is not allowed; use a finite learning rate > 0"),
    (["optim.lr=0"], "optim.lr=0.0 is not allowed; use a finite learning rate > 0"),
    (["optim.lr=nan"], "optim.lr=nan is not allowed; use a finite learning rate > 0"),
    (["optim.lr=inf"], "optim.lr=inf is not allowed; use a finite learning rate > 0"),
    (["train.micro_batch_size=0"], "train.micro_batch_size=0 is not allowed; use an integer >= 1"),
    (["train.log_interval=0"], "train.log_interval=0 is not allowed; use an integer >= 1"),
    (["checkpoint.save_interval=-1"], "checkpoint.save_interval=-1 is not allowed; use an integer >= 0"),
    (["train.eval_interval=-5"], "train.eval_interval=-5 is not allowed; use an integer >= 0"),
    (["train.max_nonfinite_steps=0"], "train.max_nonfinite_steps=0 is not allowed; use an integer >= 1"),
    (["model.vocab_size=0"], "model.vocab_size=0 is not allowed; use an integer >= 2"),
    (["model.num_attention_heads=0"], "model.num_attention_heads=0 is not allowed; use an integer >= 1"),
    (["optim.warmup_steps=-1"], "optim.warmup_steps=-1 is not allowed; use an integer >= 0"),
])
def test_invalid_values_name_the_field(override, message):
    cfg = load_config(["+recipe=tiny_pretrain", *override])
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        validate(cfg, world_size=1)


def test_logging_to_wandb_needs_it_installed(monkeypatch):
    cfg = load_config(["+recipe=tiny_pretrain", "logging.wandb_project=demo"])
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed (it is optional)
    with pytest.raises(ConfigError, match="logging.wandb_project=demo needs wandb, which is not installed"):
        validate(cfg, world_size=1)


def test_less_settings_come_from_the_method_config_with_their_one_set_of_defaults():
    from dmc_train.methods.configs import less_settings
    from dmc_train.models.less_settings import LESSSettings

    assert less_settings(load_config(["+recipe=less_tiny"]).method) == LESSSettings()
    cfg = load_config(["+recipe=less_tiny", "method.rank=4", "method.dropout=0.1"])
    assert less_settings(cfg.method) == LESSSettings(rank=4, dropout=0.1)
