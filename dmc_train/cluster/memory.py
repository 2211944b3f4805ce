"""Per-GPU memory and checkpoint-size estimates for a config on ``world_size`` GPUs.

What is counted follows what this project builds (megatron-core ``GPTModel`` with our Llama spec,
``dmc_train/training/setup.py``), so change the constants here when those change:

* weights in the param dtype (bf16/fp16: 2 bytes, fp32: 4);
* gradients: megatron DDP's grad buffer, fp32 (``grad_reduce_in_fp32=True``): 4 bytes;
* optimizer: fp32 main params (16-bit training only, 4 bytes) + Adam's two moments (8 bytes),
  divided across data-parallel ranks with ``parallel.distributed_optimizer`` (megatron's
  "bf16 params, fp32 grads" row: 18 bytes/param, or 6 + 12/DP with the distributed optimizer);
* activations stored for backward, per layer and micro-batch (``layer_activation_bytes``), times
  the layer-micro-batches a pipeline rank holds at its peak (1F1B warm-up), plus the logits;
* torch AdamW's transient (``foreach`` computes ``sqrt(exp_avg_sq)`` for all params at once: 4 bytes
  per optimizer-owned param; ~0 with apex / Transformer Engine FusedAdam). It does not coincide
  with activations, so the peak is ``weights + grads + optimizer + max(activations, transient)``.

Not counted: CUDA context and NCCL buffers (~1-2 GiB), allocator fragmentation, communication and
weight-gradient temporaries. Leave 10-15% headroom. The per-layer activation formula was checked
against ``torch.autograd.graph.saved_tensors_hooks`` on CPU (exact for TP=1, bf16 and fp32).
"""

from __future__ import annotations

import math
from typing import Any

from dmc_train.config import ParallelLayout, check_layout, kv_groups, num_microbatches
from dmc_train.models.shape import count_parameters, layer_parameters

GiB = 1024 ** 3

# Bytes per element of the RMSNorm input that our plain-PyTorch RMSNorm (dmc_train/models/norm.py)
# keeps for backward: ``x.float()`` and ``y`` (both fp32). A fused norm would keep ~2 (its input).
NORM_SAVED_BYTES = 8
ADAM_STATE_BYTES = 8  # exp_avg + exp_avg_sq, fp32
GRAD_BYTES = 4  # fp32 grad buffer (grad_reduce_in_fp32=True)


def _act_bytes(cfg: Any) -> int:
    return 4 if cfg.train.precision == "fp32" else 2


def layout_of(cfg: Any, world_size: int) -> ParallelLayout:
    """The parallel layout of ``cfg`` on ``world_size`` GPUs (raises ConfigError if it does not fit).
    Sequence parallelism is read from ``cfg.parallel``, the micro-batch count from ``cfg.train``."""
    m, p = cfg.model, cfg.parallel
    return check_layout(world_size, p.tensor, p.pipeline, p.virtual_pipeline, m.num_layers,
                        m.num_attention_heads, kv_groups(m))


def _micro_batches(cfg: Any, lay: ParallelLayout) -> int:
    """Micro-batches per step per data-parallel rank."""
    return max(1, num_microbatches(cfg, lay.data))


def layer_activation_bytes(cfg: Any, tp: int = 1, sequence_parallel: bool = False) -> int:
    """Bytes one transformer layer stores for backward for one micro-batch (no recompute).

    Per token (``s*b`` of them), ``e`` = activation bytes, ``g/a`` = query groups / heads:
      2 RMSNorms: ``2 * (8h + 4)`` (fp32 copy of the input + fp32 normalised output + rstd),
      their outputs (inputs of linear_qkv and linear_fc1): ``2 * e*h``,
      attention: ``e*h*(3 + 3g/a) + 4a``: the fused QKV output (V is a view of it, so all of it stays),
      rotated Q and K, the SDPA output (= linear_proj input), the fp32 log-sum-exp (flash-style SDPA:
      no ``s x s`` term),
      SwiGLU MLP: ``5 * e*f``: fc1 output (gate and up, 2), silu(gate), ``up + glu_linear_offset`` (a copy
      megatron's unfused GLU makes), the product (= linear_fc2 input),
    plus the RoPE cos/sin per layer (``4 * s * head_dim * e``, not split).
    Under TP the attention/MLP terms are split; the norm terms only with sequence parallelism.
    """
    m, t = cfg.model, cfg.train
    s, b, e = t.seq_length, t.micro_batch_size, _act_bytes(cfg)
    h, f, a = m.hidden_size, m.ffn_hidden_size, m.num_attention_heads
    g = kv_groups(m)
    tokens = s * b
    norms = tokens * (2 * (NORM_SAVED_BYTES * h + 4) + 2 * e * h)
    attention = tokens * (e * h * 3 + e * h * 3 * g // a + 4 * a)
    mlp = tokens * 5 * e * f
    rope = 4 * s * (h // a) * e
    weight_casts = 2 * 4 * h if e == 2 else 0  # ``weight.float()`` in each norm
    return (norms // tp if sequence_parallel else norms) + (attention + mlp) // tp + rope + weight_casts


def _inflight_layer_microbatches(cfg: Any, lay: ParallelLayout, pipeline_rank: int) -> float:
    """Layer x micro-batch activation sets a pipeline rank holds at its peak (megatron 1F1B schedules)."""
    virtual = lay.virtual_pipeline or 1
    layers_per_chunk = cfg.model.num_layers / (lay.pipeline * virtual)
    if lay.pipeline == 1:
        return cfg.model.num_layers
    warmup = (lay.pipeline - pipeline_rank - 1) * (2 if virtual > 1 else 1)
    warmup += (virtual - 1) * lay.pipeline
    chunks = min(warmup + 1, _micro_batches(cfg, lay) * virtual)
    return chunks * layers_per_chunk


def _stage(cfg: Any, lay: ParallelLayout, first: bool, last: bool, pipeline_rank: int) -> dict[str, int]:
    m, t, p = cfg.model, cfg.train, cfg.parallel
    split, replicated = layer_parameters(m)
    layers = m.num_layers // lay.pipeline
    params = layers * (split // lay.tensor + replicated)
    vocab_shard = m.vocab_size * m.hidden_size // lay.tensor
    one_stage_tied = first and last and getattr(m, "tie_embeddings", False)  # one matrix (PP>1: a copy per end)
    params += vocab_shard * (int(first) + int(last) - int(one_stage_tied)) + (m.hidden_size if last else 0)

    sixteen_bit = t.precision != "fp32"
    weights = params * (2 if sixteen_bit else 4)
    grads = params * GRAD_BYTES
    opt_params = math.ceil(params / lay.data) if p.distributed_optimizer else params
    optimizer = opt_params * ((4 if sixteen_bit else 0) + ADAM_STATE_BYTES)

    e, tokens, sp = _act_bytes(cfg), t.seq_length * t.micro_batch_size, bool(p.sequence_parallel)
    per_layer = layer_activation_bytes(cfg, lay.tensor, sp)
    inflight = _inflight_layer_microbatches(cfg, lay, pipeline_rank)
    if t.recompute == "full":  # each layer keeps only its input; one layer is recomputed at a time
        layer_input = tokens * m.hidden_size * e // (lay.tensor if sp else 1)
        activations = inflight * layer_input + per_layer
    else:
        if t.recompute == "selective":  # core attention recomputed: only the log-sum-exp is not kept
            per_layer -= tokens * 4 * m.num_attention_heads // lay.tensor
        activations = inflight * per_layer
    if last:  # final norm + its output, fp32 logits kept by the loss (+ the 16-bit logits transiently)
        norm = tokens * (NORM_SAVED_BYTES * m.hidden_size + 4 + e * m.hidden_size)
        activations += (norm // lay.tensor if sp else norm) + tokens * m.vocab_size * (4 + e) // lay.tensor
    temp = opt_params * 4
    total = weights + grads + optimizer + max(int(activations), temp)
    return {"parameters": weights, "gradients": grads, "optimizer": optimizer,
            "activations": int(activations), "optimizer_step_temp": temp, "total": total}


def estimate_memory(cfg: Any, world_size: int) -> dict[str, int]:
    """Bytes per GPU on the most loaded pipeline rank, and checkpoint sizes (whole model).

    Keys: ``parameters``, ``gradients``, ``optimizer``, ``activations``, ``optimizer_step_temp``,
    ``total`` (per GPU), ``checkpoint_model_bf16``, ``checkpoint_model_fp32``,
    ``checkpoint_with_optimizer`` (weights in the param dtype + fp32 main params + Adam moments).
    """
    lay = layout_of(cfg, world_size)
    stages = [_stage(cfg, lay, first=True, last=lay.pipeline == 1, pipeline_rank=0)]
    if lay.pipeline > 1:
        stages.append(_stage(cfg, lay, first=False, last=True, pipeline_rank=lay.pipeline - 1))
    out = max(stages, key=lambda d: d["total"])
    n = count_parameters(cfg.model)
    sixteen_bit = cfg.train.precision != "fp32"
    out.update(checkpoint_model_bf16=2 * n, checkpoint_model_fp32=4 * n,
               checkpoint_with_optimizer=n * ((2 + 4) if sixteen_bit else 4) + n * ADAM_STATE_BYTES)
    return out


# ------------------------------------------------------------------------------------------
# The table in docs/CLUSTER.md
# ------------------------------------------------------------------------------------------
DOC_BASE = ["train.precision=bf16", "train.seq_length=4096", "train.micro_batch_size=1",
            "train.global_batch_size=1024"]

_SP, _DO = "parallel.sequence_parallel=true", "parallel.distributed_optimizer=true"
_TP = {n: f"parallel.tensor={n}" for n in (2, 4, 8)}
_PP = {n: f"parallel.pipeline={n}" for n in (4, 8)}

# (model, nodes, gpus per node, overrides)
DOC_LAYOUTS = [
    ("llama2_7b", 1, 8, [_DO]),
    ("llama2_7b", 1, 8, [_DO, "train.recompute=full"]),
    ("llama2_7b", 1, 8, [_TP[2], _SP]),
    ("llama2_7b", 1, 8, [_TP[2], _SP, _DO]),
    ("llama2_7b", 1, 8, [_TP[4], _SP, _DO]),
    ("llama2_13b", 1, 8, [_TP[4], _SP]),
    ("llama2_13b", 1, 8, [_TP[4], _SP, _DO]),
    ("llama2_13b", 1, 8, [_TP[4], _SP, _DO, "train.recompute=selective"]),
    ("llama2_13b", 4, 8, [_TP[4], _SP, _DO]),
    ("llama2_13b", 1, 8, [_TP[8], _SP]),
    ("llama2_70b", 4, 8, [_TP[8], _PP[4], _SP]),
    ("llama2_70b", 8, 8, [_TP[8], _PP[4], _SP, _DO]),
    ("llama2_70b", 8, 8, [_TP[8], _PP[4], "parallel.virtual_pipeline=5", _SP, _DO]),
    ("llama2_70b", 8, 8, [_TP[8], _PP[4], _SP, _DO, "train.recompute=full"]),
    ("llama2_70b", 16, 8, [_TP[8], _PP[8], _SP, _DO]),
]

_HEADER = ("| model | nodes x GPUs | TP | PP | VPP | DP | SP | dist. opt. | recompute | "
           "weights+grads+optim GiB | activations GiB | AdamW temp GiB | total GiB/GPU |")


def _gib(x: float) -> str:
    return f"{x / GiB:.1f}"


def markdown_row(cfg: Any, nodes: int, gpus: int) -> str:
    """One row of the per-GPU memory table for ``cfg`` on ``nodes x gpus``."""
    est, lay, p = estimate_memory(cfg, nodes * gpus), layout_of(cfg, nodes * gpus), cfg.parallel
    static = est["parameters"] + est["gradients"] + est["optimizer"]
    yes = lambda v: "yes" if v else "no"  # noqa: E731
    return (f"| {cfg.model.name} | {nodes}x{gpus} | {lay.tensor} | {lay.pipeline} | "
            f"{p.virtual_pipeline or '-'} | {lay.data} | {yes(p.sequence_parallel)} | "
            f"{yes(p.distributed_optimizer)} | {cfg.train.recompute} | {_gib(static)} | "
            f"{_gib(est['activations'])} | {_gib(est['optimizer_step_temp'])} | {_gib(est['total'])} |")


def doc_tables(load_config) -> str:
    """The memory and checkpoint tables of docs/CLUSTER.md (``load_config``: dmc_train.config.load_config)."""
    lines = [_HEADER, "|" + "---|" * (_HEADER.count("|") - 1)]
    for model, nodes, gpus, over in DOC_LAYOUTS:
        lines.append(markdown_row(load_config([f"model={model}", *DOC_BASE, *over]), nodes, gpus))
    lines += ["", "| model | parameters | model bf16 GiB | model fp32 GiB | model + optimizer GiB |",
              "|---|---|---|---|---|"]
    for model in ("llama2_7b", "llama2_13b", "llama2_70b"):
        cfg = load_config([f"model={model}", *DOC_BASE])
        est = estimate_memory(cfg, 1)
        lines.append(f"| {model} | {count_parameters(cfg.model) / 1e9:.2f}B | {_gib(est['checkpoint_model_bf16'])} | "
                     f"{_gib(est['checkpoint_model_fp32'])} | {_gib(est['checkpoint_with_optimizer'])} |")
    return "\n".join(lines)


def describe(cfg: Any, world_size: int) -> str:
    """A human-readable breakdown (for ``launch/estimate_memory.py``)."""
    est, lay = estimate_memory(cfg, world_size), layout_of(cfg, world_size)
    head = (f"{cfg.model.name} on {world_size} GPUs: TP={lay.tensor} PP={lay.pipeline}"
            f"{f' VPP={lay.virtual_pipeline}' if lay.virtual_pipeline else ''} DP={lay.data}"
            f"{' SP' if cfg.parallel.sequence_parallel else ''}; {cfg.train.precision}, seq {cfg.train.seq_length}, "
            f"micro-batch {cfg.train.micro_batch_size}, recompute={cfg.train.recompute}, "
            f"distributed optimizer={'on' if cfg.parallel.distributed_optimizer else 'off'}")
    keys = ("parameters", "gradients", "optimizer", "activations", "optimizer_step_temp", "total",
            "checkpoint_model_bf16", "checkpoint_model_fp32", "checkpoint_with_optimizer")
    return head + "\n" + "\n".join(f"  {k:<26} {est[k] / GiB:8.2f} GiB" for k in keys)
