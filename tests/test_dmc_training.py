"""DMC training end to end (one process): schedule, CR loss, checkpoint metadata and heatmaps, exact
resume, zeroed decision rows, the fixed-pooling ablation, method.rope_order=pre against its reference
(tests/scripts/dmc_checks.py)."""

import pytest

from tests.helpers import free_port, run_json

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dmc")
    return run_json(["tests/scripts/dmc_checks.py", str(tmp)], str(tmp / "out.json"))


def test_schedule_drives_target_cr_and_losses(res):
    full = res["full"]
    assert full["target_cr"] == pytest.approx([1, 1, 2, 3, 3, 3])
    assert full["cr_loss"][:2] == [None, None]  # zero-out stage: vanilla attention, no CR loss
    assert all(v > 0 for v in full["cr_loss"][2:])  # achieved CR below target: the hinge is active
    assert all(1 < v < 3 for v in full["cr"][2:])
    assert full["lr"][4:] == pytest.approx([3e-3, 3e-3 * (0.1 + 0.9 * 0.5)])  # finetune: cosine to 10 %


def test_decision_logits_are_logged_from_minus_the_offset(res):
    """The first DMC step runs on the zeroed decision rows: every logit is exactly -c0 (method.init_offset=1); the CR
    loss then moves them up."""
    full = res["full"]
    assert full["alpha_logit_mean"][:2] == [None, None] and full["alpha_logit_max"][:2] == [None, None]
    assert full["alpha_logit_mean"][2] == full["alpha_logit_max"][2] == -1.0
    assert all(m > -1.0 for m in full["alpha_logit_max"][3:])
    assert all(mean < top for mean, top in zip(full["alpha_logit_mean"][3:], full["alpha_logit_max"][3:]))


def test_checkpoints_record_achieved_cr_and_heatmap(res):
    for step, expected_stage, target in (("3", "retrofit", 2.0), ("6", "finetune", 3.0)):
        ckpt = res["checkpoints"][step]
        meta = ckpt["meta"]
        assert (meta["stage"], meta["target_cr"]) == (expected_stage, target)
        per_head = meta["achieved_cr_per_head"]
        assert len(per_head) == 4 and all(len(row) == 4 for row in per_head)  # layers x KV heads
        assert len(meta["achieved_cr_per_layer"]) == 4
        assert min(min(row) for row in per_head) <= meta["achieved_cr"] <= max(max(row) for row in per_head)
        assert ckpt["png"] > 1000


def test_resume_continues_exactly(res):
    assert res["resumed"] == res["full"]["lm_loss"][3:]


def test_zero_out_stage_ends_with_zeroed_decision_rows(res):
    for layer in res["zeroed_rows"]:
        assert layer["qk_decision"] == 0.0
        assert layer["v_decision"] > 0 and layer["other"] > 0  # nothing else touched


def test_fixed_pooling_ablation_trains(res):
    pool = res["fixed_pool"]
    assert pool["cr"] == [2.0, 2.0, 2.0] and pool["target_cr"] == [2.0, 2.0, 2.0]  # the pool size, every step
    assert pool["alpha_logit_max"] == [None, None, None]  # no decisions learned
    assert (pool["meta"]["stage"], pool["meta"]["target_cr"], pool["meta"]["achieved_cr"]) == ("fixed", 2.0, 2.0)
    assert pool["val_loss"][-1] is not None and 5 < pool["val_loss"][-1] < 7


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_rope_pre_attention_equals_reference(res, mode):
    """The DMC attention module with rope_order=pre equals kernels.dmc.reference_pre_rope_dmc_attention
    on the same weights and inputs (eval: hard decisions; train: soft, fixed Gumbel noise), and is a
    different model from rope_order=post (same decisions, different outputs)."""
    got = res["rope_pre"][mode]
    assert got["accumulated"] and got["same_decisions"]
    assert got["hard"] == (mode == "eval") and 0.2 < got["appends"] < 0.8  # decisions vary
    assert got["scale"] > 0.5 and got["ref"] < 1e-5
    assert got["post"] > 1e-2


def test_decision_threshold_and_omega_eps_reach_the_module(res):
    got = res["rope_pre"]["options"]
    assert got["threshold_high_appends"] and got["threshold_low_merges"]
    assert got["omega_shift"] == pytest.approx(0.5 - 1e-6) and got["omega_shift_max"] == pytest.approx(0.5 - 1e-6)


def test_rope_pre_fixed_pooling_and_zero_out(res):
    fixed, zero_out = res["rope_pre"]["fixed"], res["rope_pre"]["zero_out"]
    assert fixed["alpha"] and fixed["ref"] < 1e-5 and fixed["post"] > 1e-2
    assert zero_out["handoff"] is None and zero_out["post"] == 0.0  # vanilla attention: the order is irrelevant


def test_rope_pre_trains_and_resumes_exactly(res):
    full = res["pre"]["full"]
    assert None not in full["lm_loss"] and full["lm_loss"][-1] < full["lm_loss"][0]
    assert all(v > 0 for v in full["cr_loss"][2:]) and all(1 < v < 3 for v in full["cr"][2:])
    assert full["val_loss"][-1] is not None
    assert full["lm_loss"] != res["full"]["lm_loss"]  # a different model from rope_order=post
    assert res["pre"]["resumed"] == full["lm_loss"][3:]


def test_dmc_layer_keeps_no_more_for_backward_than_vanilla(tmp_path):
    """What one DMC layer saves for backward (exact accumulation with rope_order post and pre, window;
    fp32) is within one [s, b, g, d] tensor of what a vanilla layer saves: no second copy of k~ / v~,
    of the attention output or of the fused QKV projection output, no scan state
    (tests/scripts/saved_activations.py)."""
    over = ["model=tiny", "model.hidden_size=256", "model.ffn_hidden_size=688", "model.num_attention_heads=8",
            "model.num_query_groups=2", "model.vocab_size=1024", "train.seq_length=128", "train.micro_batch_size=1"]
    kv_tensor = 128 * 1 * 2 * 32 * 4  # [s, b, g, d] fp32

    def saved(*extra):
        name = "_".join(extra).replace("=", "-").replace(".", "-") or "vanilla"
        return run_json(["tests/scripts/saved_activations.py", *over, *extra], str(tmp_path / f"{name}.json"),
                        env={"MASTER_PORT": str(free_port())})["fp32"]

    vanilla = saved()
    for accumulation, rope_order in (("exact", "post"), ("exact", "pre"), ("window", "post")):
        dmc = saved("method=dmc", f"method.accumulation={accumulation}", f"method.rope_order={rope_order}")
        assert dmc < vanilla + kv_tensor, (accumulation, rope_order, dmc, vanilla)
