"""dmc_train.models.llama_weights against real tiny megatron models (1 CPU process); JSON for
tests/models/test_llama_weights.py.

    python tests/scripts/llama_weights_checks.py OUT.json

For a GQA (8 heads, 2 groups) and an MHA tiny model (fp32, 2 layers):
  megatron_keys     the state-dict names (``_extra_state`` entries excluded), and the HF names/shapes
  count             count_parameters(cfg.model) and the built model's parameter count
  qkv_error         split_qkv of linear_qkv.weight vs megatron's own get_query_key_value_tensors
  round_trip        megatron -> HF -> megatron: names equal, tensors bit-equal
  reload            the round-tripped state dict loaded (strict=False) into a model built with another
                    seed: missing/unexpected keys and its logits vs the source's (must be equal)
  hf_logits_error   a plain-torch forward written with Hugging Face LlamaForCausalLM semantics
                    (rotate-half RoPE, repeat_kv, silu(gate) * up) on the HF state dict vs megatron's logits
"""

import json
import os
import sys

import torch
import torch.nn.functional as F

COMMON = ["model=tiny", "model.num_layers=2", "train.precision=fp32"]


def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def hf_llama_logits(sd, m, tokens):
    """LlamaForCausalLM.forward (no cache, causal) on a Hugging Face state dict, in plain torch."""
    heads, groups = m.num_attention_heads, m.num_query_groups or m.num_attention_heads
    d = m.hidden_size // heads
    b, s = tokens.shape
    inv_freq = 1.0 / (m.rotary_base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.outer(torch.arange(s, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    x = sd["model.embed_tokens.weight"][tokens]
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        h = rms_norm(x, sd[p + "input_layernorm.weight"], m.norm_epsilon)
        q = (h @ sd[p + "self_attn.q_proj.weight"].T).view(b, s, heads, d).transpose(1, 2)
        k = (h @ sd[p + "self_attn.k_proj.weight"].T).view(b, s, groups, d).transpose(1, 2)
        v = (h @ sd[p + "self_attn.v_proj.weight"].T).view(b, s, groups, d).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = (t.repeat_interleave(heads // groups, dim=1) for t in (k, v))  # HF repeat_kv
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + a @ sd[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, sd[p + "post_attention_layernorm.weight"], m.norm_epsilon)
        gate, up = h @ sd[p + "mlp.gate_proj.weight"].T, h @ sd[p + "mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    return rms_norm(x, sd["model.norm.weight"], m.norm_epsilon) @ sd["lm_head.weight"].T


def megatron_logits(model, tokens):
    pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        return model(tokens, pos, None)  # [b, s, vocab]


def check(overrides):
    from dmc_train import distributed
    from dmc_train.config import kv_groups
    from dmc_train.models.llama import build_model
    from dmc_train.models.llama_weights import count_parameters, hf_to_megatron, megatron_to_hf, split_qkv
    from dmc_train.recipes import load_config

    cfg = load_config(COMMON + overrides)
    m = cfg.model
    heads, groups = m.num_attention_heads, kv_groups(m)
    distributed.initialize(1, 1, None, cfg.train.seed)
    model = build_model(cfg)[0].eval()
    res = {"count": count_parameters(m), "numel": sum(p.numel() for p in model.parameters())}

    state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    res["megatron_keys"] = list(state)

    attn = model.decoder.layers[0].self_attention
    hidden = torch.randn(5, 2, m.hidden_size)
    with torch.no_grad():
        mq, mk, mv = attn.get_query_key_value_tensors(hidden)[:3]  # [s, b, heads | groups, d]
        q, k, v = split_qkv(attn.linear_qkv.weight, heads, groups)
        ours = [torch.einsum("sbh,ndh->sbnd", hidden, w) for w in (q, k, v)]
    res["qkv_error"] = max(float((a - b).abs().max()) for a, b in zip(ours, (mq, mk, mv)))

    hf = megatron_to_hf(state, heads, groups)
    res["hf_shapes"] = {k: list(v.shape) for k, v in hf.items()}
    back = hf_to_megatron(hf, heads, groups)
    res["round_trip"] = {"same_keys": set(back) == set(state),
                         "bit_equal": all(torch.equal(back[k], state[k]) for k in state)}

    tokens = torch.arange(40).reshape(2, 20) * 7 % m.vocab_size
    source = megatron_logits(model, tokens)
    other_cfg = load_config(COMMON + overrides + [f"train.seed={cfg.train.seed + 1}"])
    other = build_model(other_cfg)[0].eval()
    before = megatron_logits(other, tokens)
    missing, unexpected = other.load_state_dict(back, strict=False)
    res["reload"] = {"missing": list(missing), "unexpected": list(unexpected),
                     "differed_before": float((before - source).abs().max()),
                     "error": float((megatron_logits(other, tokens) - source).abs().max())}
    with torch.no_grad():
        res["hf_logits_error"] = float((hf_llama_logits(hf, m, tokens) - source).abs().max())
    return res


def main(out_path: str) -> None:
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    res = {"gqa": check(["model.num_query_groups=2"]), "mha": check([])}
    with open(out_path, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(sys.argv[1])
