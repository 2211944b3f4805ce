"""DMC training end to end in one process; writes observations as JSON for tests/test_dmc_training.py.

    python tests/scripts/dmc_checks.py OUT.json WORKDIR

Scenarios (tiny model, GQA 4 groups, zero-out 2 + ramp 2 + finetune 2 steps):
  full          uninterrupted 6 steps, checkpoints at steps 3 and 6: losses, stages, metadata, PNGs
  resumed       the same run stopped after 3 steps and resumed: losses of steps 4..6
  zeroed_rows   before step 2 (end of zero-out) the q/k decision-channel rows of W_qkv are zero
  fixed_pool    the Fixed Memory Pooling ablation (method.pool=2; the schedule fields ignored) trains, evaluates
                and records its stage and target CR
  rope_pre      method.rope_order=pre: one DMC attention module against
                kernels.dmc.reference_pre_rope_dmc_attention (eval/hard, train/soft, fixed pooling),
                against rope_order=post, and in the zero-out phase; method.decision_threshold and
                method.omega_eps reach the module's evaluation decisions
  pre           the uninterrupted run with method.rope_order=pre, and the same run stopped after 3
                steps and resumed
"""

import json
import os
import sys

COMMON = ["+recipe=tiny_pretrain", "model.num_query_groups=4", "train.max_steps=6",
          "train.eval_interval=3", "logging.progress=false", "checkpoint.save_interval=3", "optim.lr=3e-3",
          "optim.schedule=constant",
          "method.zero_out_steps=2", "method.ramp_steps=2", "method.finetune_steps=2", "method.init_offset=1.0"]
DMC = ["method=dmc", "method.target_cr=3"]


def run(overrides, method=DMC):
    from dmc_train.recipes import load_config
    from dmc_train.training.loop import train

    return train(load_config(COMMON + method + overrides))


def history(summary, key):
    return [h.get(key) for h in summary["history"]]


def rope_pre_module(trainer) -> dict:
    """The first DMC attention module of ``trainer``'s model (rope_order=pre) against the reference on
    the same weights and inputs: max abs differences (and to rope_order=post) per scenario."""
    import dataclasses

    import torch
    from megatron.core.transformer.attention import SelfAttention

    from dmc_train.models.dmc import DMCSelfAttention
    from kernels.dmc import decisions, reference_pre_rope_dmc_attention

    m = trainer.cfg.model
    state = trainer.method.state
    state.tracker = None  # no CR bookkeeping for these bare module calls

    def settings(**changes):  # the settings are frozen: the scenarios swap in changed copies
        state.settings = dataclasses.replace(state.settings, **changes)

    settings(init_offset=0.0)  # alpha logit = k[c]: a mix of appends and accumulations
    att = next(x for x in trainer.model[0].modules() if isinstance(x, DMCSelfAttention))
    with torch.no_grad():  # larger weights than at init: O(1) scores and outputs, so differences show
        att.linear_qkv.weight.mul_(10)
        att.linear_proj.weight.mul_(10)
    gpt = next(x for x in trainer.model[0].modules() if hasattr(x, "rotary_pos_emb"))
    s, b, d = 24, 2, m.hidden_size // m.num_attention_heads
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(s, b, m.hidden_size, generator=gen)
    inv_freq = 1.0 / m.rotary_base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = torch.outer(torch.arange(s, dtype=torch.float32), inv_freq).repeat(1, 2)  # [s, d]
    cos, sin = angles.cos(), angles.sin()
    handed = []
    put = att.handoff.put
    att.handoff.put = lambda value: (handed.append(value), put(value))

    def module_out(order):
        settings(rope_order=order)
        handed.clear()
        out = att(hidden, None, rotary_pos_emb=gpt.rotary_pos_emb(s))[0]
        return out, (handed[0] if handed else None)

    def reference(decided, zero_channel):
        q, k, v = (t.permute(1, 2, 0, 3) for t in SelfAttention.get_query_key_value_tensors(att, hidden))
        c = state.settings.channel if zero_channel else None
        if c is not None:
            q, k = q.clone(), k.clone()
            q[..., c], k[..., c] = 0, 0
        out = reference_pre_rope_dmc_attention(q, k, v, decided[0], decided[1], cos, sin,
                                               scale=att.core_attention.softmax_scale, free_channel=c)
        return att.linear_proj(out.permute(2, 0, 1, 3).reshape(s, b, -1))[0]

    res = {}
    with torch.no_grad():
        for mode in ("eval", "train"):
            att.train(mode == "train")
            state.phase = "dmc"
            pre, decided = module_out("pre")
            post, decided_post = module_out("post")
            alpha = decided[0]
            res[mode] = {"ref": float((pre - reference(decided, True)).abs().max()), "scale": float(pre.abs().max()),
                         "post": float((pre - post).abs().max()), "accumulated": decided[2],
                         "same_decisions": bool(torch.equal(alpha, decided_post[0])),
                         "hard": bool(((alpha == 0) | (alpha == 1)).all()),
                         "appends": float((alpha < 0.5).float().mean())}
        att.eval()  # the released code's options reach the module's hard decisions and importance
        _, base = module_out("post")
        settings(decision_threshold=1e9, omega_eps=0.5)
        _, never = module_out("post")
        settings(decision_threshold=-1e9)
        _, always = module_out("post")
        settings(decision_threshold=0.0, omega_eps=1e-6)
        res["options"] = {"threshold_high_appends": bool((never[0] == 0).all()),
                          "threshold_low_merges": bool((always[0][..., 1:] == 1).all()),
                          "omega_shift": float((never[1] - base[1]).min()),
                          "omega_shift_max": float((never[1] - base[1]).max())}
        state.phase = "fixed"
        settings(pool=2)
        pre, decided = module_out("pre")
        res["fixed"] = {"ref": float((pre - reference(decided, False)).abs().max()),
                        "alpha": bool(torch.equal(decided[0][0, 0], decisions.fixed_pooling_alpha(s, 2))),
                        "post": float((pre - module_out("post")[0]).abs().max())}
        state.phase, state.zero_out_factor = "zero_out", 0.5
        pre, decided = module_out("pre")
        res["zero_out"] = {"handoff": decided, "post": float((pre - module_out("post")[0]).abs().max())}
    att.handoff.put = put
    return res


def main(out_path: str, work: str) -> None:
    import torch

    from dmc_train import distributed
    from dmc_train.models.dmc import DMCSelfAttention
    from dmc_train.models.llama_weights import split_qkv
    from dmc_train.recipes import load_config
    from dmc_train.training.checkpoint_dirs import read_meta
    from dmc_train.training.loop import Trainer

    res = {}
    full = run([f"run_dir={work}/full"])
    res["full"] = {k: history(full, k) for k in ("lm_loss", "cr_loss", "cr", "target_cr", "lr", "val_loss",
                                                 "alpha_logit_mean", "alpha_logit_max")}
    res["checkpoints"] = {}
    for step in (3, 6):
        ckpt = f"{work}/full/checkpoints/iter_{step:07d}"
        res["checkpoints"][step] = {"meta": read_meta(ckpt)["method_metadata"],
                                    "png": os.path.getsize(os.path.join(ckpt, "cr_heatmap.png"))}

    run([f"run_dir={work}/split", "train.max_steps_per_job=3"])
    res["resumed"] = history(run([f"run_dir={work}/split"]), "lm_loss")

    trainer = Trainer(load_config(COMMON + DMC + [f"run_dir={work}/rows", "checkpoint.resume=none"]))
    trainer.method.before_step(2, trainer.model)
    rows = []
    for module in trainer.model[0].module.modules():
        if isinstance(module, DMCSelfAttention):
            q, k, v = split_qkv(module.linear_qkv.weight, 8, 4)  # [heads or groups, head dim, hidden]
            qk = torch.cat([q, k])
            rows.append({"qk_decision": float(qk[:, -1].abs().max()), "v_decision": float(v[:, -1].abs().max()),
                         "other": float(qk[:, :-1].abs().min(dim=-1).values.max())})
    res["zeroed_rows"] = rows

    pool = run([f"run_dir={work}/pool", "method.pool=2", "train.max_steps=3"], method=["method=fixed_pooling"])
    res["fixed_pool"] = {k: history(pool, k) for k in ("lm_loss", "val_loss", "cr", "target_cr", "alpha_logit_max")}
    res["fixed_pool"]["meta"] = read_meta(f"{work}/pool/checkpoints/iter_0000003")["method_metadata"]

    pre = ["method.rope_order=pre"]
    trainer = Trainer(load_config(COMMON + DMC + pre + [f"run_dir={work}/rope", "checkpoint.resume=none"]))
    res["rope_pre"] = rope_pre_module(trainer)
    full = run(pre + [f"run_dir={work}/pre_full", "checkpoint.save_interval=0"])
    run(pre + [f"run_dir={work}/pre_split", "train.max_steps_per_job=3"])
    res["pre"] = {"full": {k: history(full, k) for k in ("lm_loss", "cr_loss", "cr", "val_loss")},
                  "resumed": history(run(pre + [f"run_dir={work}/pre_split"]), "lm_loss")}

    with open(out_path, "w") as f:
        json.dump(res, f)
    torch.distributed.barrier()
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
