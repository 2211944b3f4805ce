"""The LR schedules of ``optim.schedule`` as megatron's scheduler applies them, step by step."""

import math

import pytest
import torch

from dmc_train.errors import ConfigError
from dmc_train.recipes import load_config, validate
from dmc_train.training.setup import build_scheduler


def _lrs(overrides: list[str], steps: int) -> list[float]:
    cfg = load_config(["+recipe=tiny_pretrain", "optim.lr=1.0", "optim.min_lr_ratio=0.1", *overrides])
    validate(cfg, world_size=1)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    scheduler = build_scheduler(cfg, optimizer, cfg.train.max_steps)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        scheduler.step(increment=1)
    return lrs


def test_wsd_is_constant_then_a_cosine_over_the_anneal_steps():
    lrs = _lrs(["optim.schedule=wsd", "optim.anneal_steps=4", "optim.warmup_steps=0", "train.max_steps=10"], 12)
    assert lrs[:7] == [1.0] * 7
    assert lrs[7:11] == pytest.approx([0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in (1, 2, 3, 4)])
    assert lrs[11] == pytest.approx(0.1)


def test_wsd_with_warmup_and_cosine_agree_where_they_should():
    wsd = _lrs(["optim.schedule=wsd", "optim.anneal_steps=8", "optim.warmup_steps=2", "train.max_steps=10"], 11)
    cosine = _lrs(["optim.schedule=cosine", "optim.warmup_steps=2", "train.max_steps=10"], 11)
    assert wsd == pytest.approx(cosine)  # annealing over every step after warm-up is the cosine schedule


@pytest.mark.parametrize("anneal", [0, 11])
def test_wsd_needs_anneal_steps_within_the_run(anneal):
    cfg = load_config(["+recipe=tiny_pretrain", "optim.schedule=wsd", f"optim.anneal_steps={anneal}",
                       "train.max_steps=10"])
    with pytest.raises(ConfigError, match=f"optim.schedule=wsd needs 1 <= optim.anneal_steps <= .* got "
                                          f"optim.anneal_steps={anneal}"):
        validate(cfg, world_size=1)
