"""The typed config schema. Registered in Hydra's ConfigStore as ``schema``; recipes compose on top.

Unknown keys, wrong types and invalid values fail at load time (Hydra's structured-config check plus
``validate``) with a one-line message naming the field and the allowed values.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING, OmegaConf

from dmc_train.distributed import ConfigError


@dataclass
class ModelConfig:
    """Llama architecture shape (RMSNorm, SwiGLU, RoPE, GQA, no biases, untied embeddings)."""

    name: str = MISSING
    num_layers: int = MISSING
    hidden_size: int = MISSING
    ffn_hidden_size: int = MISSING
    num_attention_heads: int = MISSING
    num_query_groups: Optional[int] = None  # None = MHA (groups = heads)
    vocab_size: int = MISSING
    max_position_embeddings: int = 4096
    rotary_base: int = 10000
    norm_epsilon: float = 1e-5
    init_method_std: float = 0.02

    @property
    def groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads


@dataclass
class ParallelConfig:
    tensor: int = 1
    pipeline: int = 1
    virtual_pipeline: Optional[int] = None  # model chunks per pipeline rank (interleaved 1F1B)
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    timeout_minutes: int = 30


@dataclass
class OptimConfig:
    lr: float = 3e-4
    min_lr_ratio: float = 0.1  # min lr = lr * min_lr_ratio (cosine / linear decay end)
    schedule: str = "cosine"  # constant | linear | cosine
    warmup_steps: int = 0
    decay_steps: Optional[int] = None  # default: train.max_steps - warmup
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-5
    clip_grad: float = 1.0


@dataclass
class TrainConfig:
    seq_length: int = 128
    micro_batch_size: int = 2
    global_batch_size: int = 8
    max_steps: int = 100
    max_tokens: Optional[int] = None  # stop after this many tokens (whichever budget ends first)
    max_steps_per_job: Optional[int] = None  # stop (and checkpoint) after this many steps in one job
    seed: int = 1234
    precision: str = "fp32"  # fp32 | bf16 | fp16
    recompute: str = "none"  # none | selective | full
    max_nonfinite_steps: int = 5  # stop after this many consecutive steps with a NaN/Inf loss or gradient
    inject_nonfinite_at: list[int] = field(default_factory=list)  # testing: steps whose loss is made NaN
    eval_interval: int = 0  # 0 = never
    eval_iters: int = 2
    log_interval: int = 1


@dataclass
class DataConfig:
    kind: str = "synthetic"  # synthetic | indexed
    prefixes: list[str] = field(default_factory=list)  # indexed: dataset prefixes (blended)
    weights: Optional[list[float]] = None
    valid_prefixes: list[str] = field(default_factory=list)
    test_prefixes: list[str] = field(default_factory=list)
    split: str = "969,30,1"  # used when valid/test prefixes are not given
    tokenizer: Optional[str] = None
    cache_dir: Optional[str] = None


@dataclass
class CheckpointConfig:
    save_interval: int = 0  # steps between saves; 0 = only at the end
    keep_last: int = 3
    resume: str = "auto"  # auto | none | <path to a checkpoint dir>
    init_from: Optional[str] = None  # weights to start from when not resuming (e.g. the base model)
    load_optimizer: bool = True  # false = load weights only (new optimizer, step 0)
    save_at_end: bool = True


@dataclass
class LoggingConfig:
    wandb_project: Optional[str] = None
    wandb_mode: Optional[str] = None  # online | offline | disabled; default offline without API key
    progress: bool = True


@dataclass
class MethodConfig:
    name: str = "none"  # none | dmc | fixed_pooling (registered in dmc_train/methods/)


@dataclass
class DMCConfig:
    """DMC retrofitting (METHODS.md §1); used by ``method.name=dmc`` (and ``fixed_pooling``)."""

    target_cr: float = 2.0  # compression ratio reached at the end of the ramp (>= 1)
    decision_channel: str = "last"  # last (released code) | first (paper)
    init_offset: float = 5.0  # c0: alpha logit = k[c] - c0, omega = sigmoid(q[c] + c0)
    tau: float = 0.1  # Gumbel-sigmoid temperature in training
    accumulation: str = "exact"  # exact (full recurrence = inference) | window (paper, w tokens)
    window: int = 12
    attention_impl: str = "auto"  # auto | fused_cpu | blocked (dmc_ops.dmc_attention)
    cr_loss: str = "paper"  # paper (Eq. 10, soft alphas summed over the model) | released (per-head hard, ST)
    variant: str = "dmc"  # dmc | c (DMC-C: Eq. 13 constraint) | hardc (decisions shared per layer)
    zero_out_steps: int = 0  # stage 1 (Eq. 12); 0 = skip (decision channel already unused)
    zero_out_fraction: float = 1.0  # anneal over this fraction of stage 1 (released code: 0.8)
    ramp_steps: int = 0  # stage 2: target CR rises linearly from 1 to target_cr
    finetune_steps: int = 0  # stage 3: fixed CR, cosine LR down to finetune_min_lr_ratio
    finetune_min_lr_ratio: float = 0.1


@dataclass
class Config:
    run_name: str = "run"
    run_dir: str = "runs/${run_name}"
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    dmc: DMCConfig = field(default_factory=DMCConfig)


RECIPES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes")


def register_schema() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="schema", node=Config)


def load_config(overrides: list[str], config_name: str = "config") -> Any:
    """Compose ``recipes/<config_name>.yaml`` with Hydra overrides (``+recipe=tiny_pretrain``, ``a.b=1``).

    The programmatic twin of ``launch/pretrain.py``'s command line, for tests, tools and benchmarks.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_schema()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=RECIPES_DIR, version_base=None):
        return compose(config_name=config_name, overrides=list(overrides))


_CHOICES = {
    "optim.schedule": ("constant", "linear", "cosine"),
    "train.precision": ("fp32", "bf16", "fp16"),
    "train.recompute": ("none", "selective", "full"),
    "data.kind": ("synthetic", "indexed"),
}

# Features megatron-core offers only with CUDA / Transformer Engine (see DESIGN.md).
GPU_ONLY = ("context parallel, the Transformer Engine spec, RoPE fusion, gradient accumulation fusion, "
            "CUDA graphs, optimizer CPU offload, FSDP, the MoE all-to-all dispatcher")


def validate(cfg: Any, world_size: int) -> None:
    """Check values Hydra's type check cannot; raise ConfigError (one line) on the first problem."""
    for key, allowed in _CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}")
    m, p, t = cfg.model, cfg.parallel, cfg.train
    groups = m.num_query_groups or m.num_attention_heads
    if m.hidden_size % m.num_attention_heads:
        raise ConfigError(f"model.hidden_size={m.hidden_size} is not divisible by "
                          f"model.num_attention_heads={m.num_attention_heads}")
    if m.num_attention_heads % groups:
        raise ConfigError(f"model.num_query_groups={groups} does not divide "
                          f"model.num_attention_heads={m.num_attention_heads}")
    if t.seq_length > m.max_position_embeddings:
        raise ConfigError(f"train.seq_length={t.seq_length} exceeds "
                          f"model.max_position_embeddings={m.max_position_embeddings}")
    from dmc_train.distributed import check_layout

    layout = check_layout(world_size, p.tensor, p.pipeline, p.virtual_pipeline, m.num_layers,
                          m.num_attention_heads, groups)
    per_step = t.micro_batch_size * layout.data
    if t.global_batch_size % per_step:
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} is not divisible by "
                          f"train.micro_batch_size x data-parallel size = {t.micro_batch_size}x{layout.data}")
    if p.virtual_pipeline and (t.global_batch_size // per_step) % p.pipeline:
        raise ConfigError(f"interleaved pipeline needs the number of micro-batches "
                          f"({t.global_batch_size // per_step}) to be a multiple of parallel.pipeline={p.pipeline}")
    if p.sequence_parallel and p.tensor == 1:
        raise ConfigError("parallel.sequence_parallel=true needs parallel.tensor > 1")
    if t.max_steps < 1 and not t.max_tokens:
        raise ConfigError("set train.max_steps >= 1 or train.max_tokens")
    if cfg.method.name in ("dmc", "fixed_pooling"):
        from dmc_train.methods.dmc import validate_dmc

        validate_dmc(cfg)
    if cfg.data.kind == "indexed" and not cfg.data.prefixes:
        raise ConfigError("data.kind=indexed needs data.prefixes (run `python launch/prepare_data.py` to make them)")


def num_microbatches(cfg: Any, data_parallel: int) -> int:
    return cfg.train.global_batch_size // (cfg.train.micro_batch_size * data_parallel)
