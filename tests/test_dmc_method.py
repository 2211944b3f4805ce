"""DMC method pieces that need no process group: CR loss gradient, schedule, settings, GQA conversion."""

import math

import pytest
import torch

from dmc_train.errors import ConfigError, one_line
from dmc_train.methods.dmc import dmc_stage, finetune_lr_factor
from dmc_train.methods.gqa import convert_qkv_weight
from dmc_train.models.dmc.cr_loss import CRLossTracker
from dmc_train.models.llama_weights import split_qkv
from dmc_train.recipes import load_config, validate


def _alphas(seed, shapes, device, scale=1.0):
    """Drawn on CPU (the same values on every device), then moved to ``device``: leaves that require grad."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.rand(s, generator=gen, dtype=torch.float64) * scale).to(device).requires_grad_() for s in shapes]


@pytest.mark.parametrize("target_cr, active", [(1.5, True), (4.0, True), (1.0, False)])
def test_cr_gradient_equals_autograd_of_eq10(target_cr, active, device):
    """Two micro-batches through two 'layers': the injected gradient equals autograd of
    sum_m tokens_m * max(0, S_m - N_m / CR) / N_m, and the loss values agree."""
    shapes = [(2, 3, 5), (2, 3, 5)]  # [b, h_kv, n] per layer
    tracker = CRLossTracker(num_layers=2, num_heads=3)
    weights = torch.randn(2, 3, 5, dtype=torch.float64).to(device)
    ours, ref = [], []
    for m in range(2):
        alphas = _alphas(m, shapes, device, scale=0.4)
        ref_alphas = [a.detach().clone().requires_grad_() for a in alphas]
        tracker.begin_chunk(0)
        wired = [tracker.record(a, layer, 0, target_cr) for layer, a in enumerate(alphas)]
        tracker.end_chunk(0)
        lm = sum((a * weights).sum() for a in wired)
        value = tracker.loss(m, target_cr)
        lm.backward()
        ours.append((value, [a.grad for a in alphas]))

        s = sum((1 - a).sum() for a in ref_alphas)
        n = sum(a.numel() for a in ref_alphas)
        tokens = 2 * 5
        cr = torch.clamp(s - n / target_cr, min=0) / n
        (sum((a * weights).sum() for a in ref_alphas) + tokens * cr).backward()
        ref.append((cr.item(), [a.grad for a in ref_alphas]))
    for (v, grads), (rv, rgrads) in zip(ours, ref):
        assert v == pytest.approx(rv, abs=1e-12)
        assert (v > 0) == active
        for g, rg in zip(grads, rgrads):
            torch.testing.assert_close(g, rg)
    # Per-head hard-decision statistics: alphas <= 0.5 count as appends.
    stats = tracker.reduce_stats()
    assert stats.device.type == device.type  # the counts live where the decisions are made
    assert stats[..., 1].sum() == 2 * 2 * 3 * 2 * 5
    assert stats[..., 0].sum() > 0 and (stats[..., 0] <= stats[..., 1]).all()


def test_decision_logits_mean_and_max_of_the_training_forwards(device):
    """reduce_logits: the mean and maximum of the logits recorded with alphas that need a gradient (a training
    forward), over layers, heads and tokens; an evaluation's (no gradient) are not counted; reset after each call."""
    tracker = CRLossTracker(num_layers=2, num_heads=4)
    logits = [torch.randn(5, 2, 2, dtype=torch.float64, device=device) - 3 for _ in range(2)]  # [n, b, h] per layer
    tracker.begin_chunk(0)
    for layer, logit in enumerate(logits):  # heads 2-3 of layer `layer`: the second tensor-parallel rank's
        alpha = torch.sigmoid(logit).permute(1, 2, 0).requires_grad_()
        tracker.record(alpha, layer, 2, 2.0, logit=logit)
    tracker.record(torch.zeros(2, 2, 5, device=device), 0, 0, 2.0, logit=torch.full((5, 2, 2), 9.0, device=device))
    tracker.end_chunk(0)
    every = torch.cat([x.flatten() for x in logits])
    mean, top = tracker.reduce_logits()
    assert mean == pytest.approx(float(every.mean()), abs=1e-12) and top == float(every.max())
    assert tracker.reduce_logits() is None


def test_cr_reduction_waits_for_every_model_chunk(device):
    """With 2 chunks per rank (interleaved PP) micro-batch m is complete only after both chunks ran it."""
    tracker = CRLossTracker(num_layers=2, num_heads=1, num_chunks=2)
    for chunk, layer in ((0, 0), (0, 0), (1, 1), (1, 1)):  # chunk 0 runs m=0,1, then chunk 1 runs m=0,1
        tracker.begin_chunk(chunk)
        tracker.record(torch.full((1, 1, 4), 0.25, device=device), layer, 0, 2.0)
        tracker.end_chunk(chunk)
    assert tracker._partial[0][:, 0, :3].sum(0).tolist() == [2 * 4 * 0.75, 0, 8]  # both layers of micro-batch 0
    assert tracker.loss(1, 1.0) == pytest.approx(0.0)
    assert tracker.loss(0, 2.0) == pytest.approx((6 - 4) / 8)


@pytest.mark.parametrize("form", ["per_head", "per_layer_head"])
@pytest.mark.parametrize("target_cr", [1.5, 3.0])
def test_head_forms_gradient_is_straight_through_per_head(target_cr, form, device):
    """cr_loss=per_head: mean over heads of max(0, 1 - 1/CR - mean hard alpha of the head over all
    layers); per_layer_head: the same per (layer, head). Hard decisions with a straight-through
    gradient; compared with autograd of exactly that."""
    shapes = [(2, 4, 6), (2, 4, 6)]
    tracker = CRLossTracker(num_layers=2, num_heads=4, form=form)
    alphas = _alphas(3, shapes, device)
    alphas[1].data[:, 0] = 0.9  # head 0 accumulates a lot: its hinge is inactive
    ref_alphas = [a.detach().clone().requires_grad_() for a in alphas]
    weights = torch.randn(2, 4, 6, dtype=torch.float64).to(device)
    tracker.begin_chunk(0)
    wired = [tracker.record(a, layer, 0, target_cr) for layer, a in enumerate(alphas)]
    tracker.end_chunk(0)
    sum((a * weights).sum() for a in wired).backward()

    st = [(a > 0.5).double() + a - a.detach() for a in ref_alphas]
    mean_hard = torch.stack([x.mean(dim=(0, 2)) for x in st])  # [layers, heads], over batch and tokens
    if form == "per_head":
        mean_hard = mean_hard.mean(0)  # per head, over layers too
    loss = torch.clamp(1 - 1 / target_cr - mean_hard, min=0).mean()
    (sum((a * weights).sum() for a in ref_alphas) + 2 * 6 * loss).backward()
    assert tracker.loss(0, target_cr) == pytest.approx(loss.item(), abs=1e-12)
    for a, r in zip(alphas, ref_alphas):
        torch.testing.assert_close(a.grad, r.grad)
    assert len({round(float(g), 12) for a in alphas for g in (a.grad - weights)[0, :, 0]}) > 1  # per-head hinges
    if target_cr == 3.0:  # head 0: layer 1 merges everything, layer 0 too little; only per_layer_head pushes layer 0
        pushed = [float((a.grad - weights)[0, 0, 0]) != 0 for a in alphas]
        assert pushed == ([True, False] if form == "per_layer_head" else [False, False])


@pytest.mark.parametrize("target_cr", [1.5, 3.0])
def test_released_form_hinges_per_sequence_over_all_heads_and_layers(target_cr, device):
    """cr_loss=released (the authors' form, made layout-independent): per sequence, the mean hard
    decision over all layers, KV heads and tokens; mean of the per-sequence hinges; straight-through.
    Heads are recorded in two TP-like halves to check that the sums are over all of them."""
    tracker = CRLossTracker(num_layers=2, num_heads=4, form="released")
    alphas = _alphas(4, [(3, 4, 6), (3, 4, 6)], device)
    for a in alphas:  # sequence 0 keeps every token, sequence 1 merges most of them
        a.data[0], a.data[1] = 0.1, 0.9
    ref_alphas = [a.detach().clone().requires_grad_() for a in alphas]
    weights = torch.randn(3, 4, 6, dtype=torch.float64).to(device)
    tracker.begin_chunk(0)
    wired = [torch.cat([tracker.record(a[:, :2], layer, 0, target_cr), tracker.record(a[:, 2:], layer, 2, target_cr)],
                       dim=1) for layer, a in enumerate(alphas)]
    tracker.end_chunk(0)
    sum((a * weights).sum() for a in wired).backward()

    st = [(a > 0.5).double() + a - a.detach() for a in ref_alphas]
    mean_hard = torch.stack([x.mean(dim=(1, 2)) for x in st]).mean(0)  # per sequence, over layers, heads, tokens
    loss = torch.clamp(1 - 1 / target_cr - mean_hard, min=0).mean()
    (sum((a * weights).sum() for a in ref_alphas) + 3 * 6 * loss).backward()
    assert tracker.loss(0, target_cr) == pytest.approx(loss.item(), abs=1e-12)
    for a, r in zip(alphas, ref_alphas):
        torch.testing.assert_close(a.grad, r.grad)
    if target_cr == 1.5:  # sequence 1 meets the target, the others do not: only they get the push
        assert torch.equal(alphas[0].grad[1], weights[1]) and not torch.equal(alphas[0].grad[0], weights[0])


def test_attached_loss_joins_the_backward(device):
    from dmc_train.models.layer_loss import AttachLoss

    w = torch.randn(3, dtype=torch.float64).to(device).requires_grad_()
    x = torch.randn(4, dtype=torch.float64).to(device).requires_grad_()
    g = torch.randn(4, dtype=torch.float64).to(device)
    y = AttachLoss.apply(x * w.sum(), (w ** 2).sum(), 0.25)
    torch.testing.assert_close(y, x * w.sum())
    (y * g).sum().backward()
    torch.testing.assert_close(w.grad, (g * x).sum().detach() + 0.25 * 2 * w.detach())
    torch.testing.assert_close(x.grad, g * w.sum().detach())


def _dmc_cfg(*overrides):
    return load_config(["+recipe=tiny_pretrain", "method=dmc", *overrides])


def test_schedule_stages_and_finetune_lr():
    cfg = _dmc_cfg("method.zero_out_steps=4", "method.ramp_steps=5", "method.finetune_steps=10", "method.target_cr=3",
                   "optim.lr=1.0", "method.finetune_min_lr_ratio=0.1", "optim.schedule=constant")
    stages = [dmc_stage(cfg.method, s) for s in range(20)]
    assert stages[:4] == [("zero_out", 1.0), ("zero_out", 0.75), ("zero_out", 0.5), ("zero_out", 0.25)]
    assert [v for _, v in stages[4:9]] == pytest.approx([1.4, 1.8, 2.2, 2.6, 3.0])
    assert {s for s, _ in stages[4:9]} == {"retrofit"} and stages[9:] == [("finetune", 3.0)] * 11
    factor = [finetune_lr_factor(cfg.method, s) for s in range(41)]
    assert factor[:10] == [1.0] * 10  # the scheduler's LR until the finetune stage starts (step 9)
    assert factor[14] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert factor[19] == pytest.approx(0.1) and factor[40] == pytest.approx(0.1)
    released = _dmc_cfg("method.zero_out_steps=10", "method.zero_out_fraction=0.8")
    assert [dmc_stage(released.method, s)[1] for s in (4, 8, 9)] == [0.5, 0.0, 0.0]


@pytest.mark.parametrize("overrides, message", [
    (["method.target_cr=0.5"], "method.target_cr=0.5 must be >= 1"),
    (["method.window=0"], "method.window=0 must be >= 1"),
    (["model.hidden_size=8"], "head dimension >= 2"),
    (["method.decision_channel=middle"], "method.decision_channel='middle' is not one of last, first"),
    (["method.accumulation=approx"], "method.accumulation='approx' is not one of exact, window"),
    (["model.num_query_groups=2", "parallel.tensor=4"], "parallel.tensor=4 does not divide model.num_query_groups=2"),
    (["train.recompute=full"], "train.recompute='full' is not supported with DMC"),
    (["train.precision=fp16"], "fp16 is not supported with DMC"),
    (["method=fixed_pooling", "method.pool=0"], "method.pool=0 must be >= 1"),
    (["method.variant=soft"], "method.variant='soft' is not one of dmc, c, hardc"),
    (["method.cr_loss=mine"], "method.cr_loss='mine' is not one of paper, released"),
    (["method.rope_order=foo"], "method.rope_order='foo' is not one of post, pre"),
    (["method.finetune_steps=5"], "set optim.schedule=constant as the DMC recipes do"),
    (["method.omega_eps=0"], "method.omega_eps=0.0 must be > 0"),
    (["method.decision_threshold=inf"], "method.decision_threshold=inf must be a finite number"),
])
def test_invalid_dmc_settings_fail_in_one_line(overrides, message):
    cfg = _dmc_cfg(*overrides)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")) as e:
        validate(cfg, world_size=cfg.parallel.tensor)
    assert "\n" not in str(e.value)


def test_fixed_pooling_pool_is_its_own_field():
    """Fixed pooling's tokens per slot are method.pool (an integer), reaching DMCSettings.pool; it has no
    method.target_cr. A checkpoint saved when the pool size was method.target_cr is read as method.pool."""
    from omegaconf import OmegaConf

    from dmc_train.methods.configs import dmc_settings
    from dmc_train.training.model_loading import config_from_checkpoint

    cfg = load_config(["+recipe=tiny_pretrain", "method=fixed_pooling", "method.pool=4"])
    assert "target_cr" not in cfg.method and dmc_settings(cfg.method, 8).pool == 4
    for wrong in ("method.target_cr=4", "method.pool=2.5"):
        with pytest.raises(Exception, match=wrong.split("=")[0].split(".")[1]):
            load_config(["+recipe=tiny_pretrain", "method=fixed_pooling", wrong])
    saved = OmegaConf.to_container(cfg, resolve=True)
    del saved["method"]["pool"]
    saved["method"]["target_cr"] = 4.0
    old = config_from_checkpoint({"config": saved})
    assert old.method.pool == 4 and "target_cr" not in old.method
    validate(old, world_size=1)


def test_unknown_method_is_rejected():
    with pytest.raises(Exception) as e:
        load_config(["+recipe=tiny_pretrain", "method=dmcc"])
    assert "method/dmcc" in one_line(e.value) and "dmc fixed_pooling less none" in one_line(e.value)


def _qkv(heads, groups, d=3, hidden=5, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(groups * (heads // groups + 2) * d, hidden, generator=gen, dtype=torch.float64).to(device)


def _split(w, heads, groups):
    """megatron's fused layout -> (q, k, v) lists of ``[d, hidden]`` heads (tested against megatron
    itself in tests/models/test_llama_weights.py)."""
    return tuple(list(t) for t in split_qkv(w, heads, groups))


def test_gqa_conversion_with_all_groups_is_identity(device):
    w = _qkv(8, 8, device=device)
    assert torch.equal(convert_qkv_weight(w, 8, 8, 8), w)


@pytest.mark.parametrize("heads, groups_from, groups_to", [(8, 8, 4), (8, 8, 2), (8, 8, 1), (8, 4, 2)])
def test_gqa_conversion_averages_exactly(heads, groups_from, groups_to, device):
    w = _qkv(heads, groups_from, device=device)
    q0, k0, v0 = _split(w, heads, groups_from)
    q1, k1, v1 = _split(convert_qkv_weight(w, heads, groups_from, groups_to), heads, groups_to)
    merge = groups_from // groups_to
    for j in range(heads):
        assert torch.equal(q1[j], q0[j])  # query heads unchanged, in place
    for g in range(groups_to):
        torch.testing.assert_close(k1[g], sum(k0[g * merge: (g + 1) * merge]) / merge, rtol=0, atol=1e-15)
        torch.testing.assert_close(v1[g], sum(v0[g * merge: (g + 1) * merge]) / merge, rtol=0, atol=1e-15)


@pytest.mark.parametrize("groups_to, message", [(3, "must divide the number of attention heads"),
                                                (8, "must divide the model's current number of KV heads")])
def test_gqa_conversion_rejects_bad_group_counts(groups_to, message):
    with pytest.raises(ConfigError, match=message):
        convert_qkv_weight(_qkv(8, 4), 8, 4, groups_to)
