"""Llama on megatron-core ``GPTModel``: RMSNorm, SwiGLU, RoPE (optionally scaled, ``model.rope_scaling``:
``llama3`` or ``linear``, frequencies from :mod:`dmc_train.models.rope`), GQA (``num_query_groups``), no
biases, embeddings untied or tied (``model.tie_embeddings``: megatron's ``share_embeddings_and_output_weights``;
at PP=1 the output layer has no weight of its own, at PP>1 the last stage keeps a copy whose gradient
megatron's ``finalize_model_grads`` adds to the embedding's, and checkpoints store the embedding alone).

The layer spec is ours (``llama_layer_spec``). An attention variant (e.g. :mod:`dmc_train.models.dmc`)
is a ``ModuleSpec`` for ``self_attention`` that a method passes to ``build_model(cfg, attention=...)``;
only this module assembles the spec.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import TransformerLayer, get_transformer_layer_offset

from dmc_train import distributed
from dmc_train.config import kv_groups
from dmc_train.models.attention import SDPACoreAttention
from dmc_train.models.norm import RMSNorm
from dmc_train.models.rope import model_inv_freq

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def transformer_config(cfg: Any) -> TransformerConfig:
    """megatron ``TransformerConfig`` from our config (model shape, parallel layout, precision)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    dtype = DTYPES[t.precision]
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=kv_groups(m),
        kv_channels=m.hidden_size // m.num_attention_heads,
        normalization="RMSNorm",
        layernorm_epsilon=m.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=m.init_method_std,
        tensor_model_parallel_size=p.tensor,
        pipeline_model_parallel_size=p.pipeline,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline,
        sequence_parallel=p.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=t.precision == "bf16",
        fp16=t.precision == "fp16",
        # Initial weights identical for every TP/PP layout (full tensors built, then split).
        use_cpu_initialization=True,
        perform_initialization=True,
        recompute_granularity=None if t.recompute == "none" else t.recompute,
        recompute_method="uniform" if t.recompute == "full" else None,
        recompute_num_layers=1 if t.recompute == "full" else None,
        calculate_per_token_loss=True,
        # Interleaved PP with batched p2p gives silently wrong gradients on gloo
        # (docs/DESIGN.md#megatron-core-traps-on-cpu).
        batch_p2p_comm=False,
        deallocate_pipeline_outputs=True,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
    )


class LlamaLayer(TransformerLayer):
    """A megatron ``TransformerLayer`` whose initial weights depend only on (seed, global layer number).

    megatron draws all initial weights from one CPU generator stream, so with pipeline parallelism
    a stage that does not build the embedding and earlier layers would draw different weights.
    Re-seeding per global layer makes the model identical for every TP/PP/VPP layout (the output
    layer follows the last layer on every layout, the embedding comes first).
    """

    def __init__(self, config, submodules, layer_number: int = 1, init_seed: int = 0, vp_stage=None, **kwargs):
        global_number = layer_number + get_transformer_layer_offset(config, vp_stage)
        torch.manual_seed(init_seed * 10007 + global_number)
        super().__init__(config, submodules, layer_number=layer_number, vp_stage=vp_stage, **kwargs)


def llama_layer_spec(init_seed: int = 0, attention: Optional[ModuleSpec] = None) -> ModuleSpec:
    """Transformer layer spec with our RMSNorm and SDPA core attention.

    ``attention`` replaces the ``self_attention`` module: its ``module`` and ``params`` are used with
    the stock Llama submodules (fused QKV projection, core attention, output projection) unless it
    brings its own ``submodules``.
    """
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    stock = spec.submodules.self_attention
    stock.submodules.core_attention = SDPACoreAttention
    if attention is not None:
        stock = ModuleSpec(module=attention.module, params={**stock.params, **attention.params},
                           submodules=attention.submodules or stock.submodules)
    spec.module = LlamaLayer
    spec.params = {**spec.params, "init_seed": init_seed}
    spec.submodules.input_layernorm = RMSNorm
    spec.submodules.pre_mlp_layernorm = RMSNorm
    spec.submodules.self_attention = stock
    return spec


def block_spec(config: TransformerConfig, layer_spec: ModuleSpec,
               vp_stage: Optional[int]) -> TransformerBlockSubmodules:
    n = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * n, layer_norm=RMSNorm)


def build_model(cfg: Any, attention: Optional[ModuleSpec] = None) -> list[GPTModel]:
    """Build this rank's model chunks (one per virtual pipeline stage), unwrapped, on this process's device
    (:func:`dmc_train.distributed.device`): initialised on the CPU (the same weights for every layout and
    device), then moved, as megatron's own training does.

    ``attention``: the ``self_attention`` spec of a method's attention variant (``llama_layer_spec``).
    """
    config = transformer_config(cfg)
    layer_spec = llama_layer_spec(init_seed=cfg.train.seed, attention=attention)
    vpp = cfg.parallel.virtual_pipeline
    torch.manual_seed(cfg.train.seed)
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        chunks.append(GPTModel(
            config=config,
            transformer_layer_spec=block_spec(config, layer_spec, stage),
            vocab_size=cfg.model.vocab_size,
            max_sequence_length=cfg.model.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            parallel_output=True,
            share_embeddings_and_output_weights=bool(getattr(cfg.model, "tie_embeddings", False)),
            position_embedding_type="rope",
            rotary_base=cfg.model.rotary_base,
            vp_stage=stage,
        ))
    # this process's device; meta when built under torch.device("meta") (the layout alone: streaming checkpoints)
    device = torch.device("meta") if torch.empty(0).is_meta else distributed.device()
    inv_freq = model_inv_freq(cfg.model).to(device)
    for chunk in chunks:
        # megatron-core's RotaryEmbedding computes its angles from ``inv_freq`` (fp32, not a parameter or
        # buffer: never cast, saved or loaded); the project's frequencies, scaled by model.rope_scaling,
        # replace the unscaled ones it computed (equal to them without scaling). DMC's rope_order=pre
        # rotates the accumulated keys with this same embedding.
        chunk.rotary_pos_emb.inv_freq = inv_freq.clone()
        chunk.to(device=device, dtype=config.params_dtype)
    return chunks
