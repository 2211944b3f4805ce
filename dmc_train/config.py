"""The typed config schema, and the checks of the values a type cannot express.

Registered in Hydra's ConfigStore as ``schema`` by :mod:`dmc_train.recipes`, which composes recipes
on top. Unknown keys, wrong types and invalid values fail at load time (Hydra's structured-config
check plus ``validate``) with a one-line message naming the field and the allowed values. Each
method's own settings (the ``method`` node) are defined and checked with the method
(:mod:`dmc_train.methods.configs`). This module imports neither torch nor megatron.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING, OmegaConf

from dmc_train.errors import ConfigError


@dataclass(unsafe_hash=True)
class RopeScalingConfig:
    """RoPE frequency scaling (``model.rope_scaling``), the fields of Hugging Face's ``rope_parameters``.

    ``type``: ``none`` (unscaled RoPE), ``llama3`` (Llama 3.1 / 3.2 / 3.3: wavelengths longer than
    ``original_max_position_embeddings / low_freq_factor`` are stretched by ``factor``, those shorter than
    ``original_max_position_embeddings / high_freq_factor`` kept, the ones between interpolated) or
    ``linear`` (every frequency divided by ``factor``). Fields a type does not use are ignored. The
    frequencies: :func:`dmc_train.models.rope.rope_inv_freq`."""

    type: str = "none"  # none | llama3 | linear
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


ROPE_SCALING_TYPES = ("none", "llama3", "linear")


@dataclass
class ModelConfig:
    """Llama architecture shape (RMSNorm, SwiGLU, RoPE, GQA, no biases; embeddings tied or untied).

    ``tie_embeddings``: the output layer is the input embedding (Hugging Face ``tie_word_embeddings``):
    one matrix, stored once in checkpoints and trained as one (megatron's
    ``share_embeddings_and_output_weights``)."""

    name: str = MISSING
    num_layers: int = MISSING
    hidden_size: int = MISSING
    ffn_hidden_size: int = MISSING
    num_attention_heads: int = MISSING
    num_query_groups: Optional[int] = None  # None = MHA (groups = heads)
    vocab_size: int = MISSING
    max_position_embeddings: int = 4096
    rotary_base: int = 10000
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)  # type none = unscaled
    norm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    tie_embeddings: bool = False


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
    schedule: str = "cosine"  # constant | linear | cosine | wsd (constant, then cosine over anneal_steps)
    warmup_steps: int = 0
    decay_steps: Optional[int] = None  # default: train.max_steps - warmup
    anneal_steps: int = 0  # wsd: the last anneal_steps of the decay steps follow a cosine to the min lr
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
    # keep the checkpoint with the best validation metric the method names (Method.best_metric; lower is
    # better) from being pruned by keep_last; checkpoints/best names it (dmc_train/training/best_checkpoint.py)
    keep_best: bool = False


@dataclass
class LoggingConfig:
    wandb_project: Optional[str] = None
    wandb_mode: Optional[str] = None  # online | offline | disabled; default offline without API key
    progress: bool = True


@dataclass
class EvalConfig:
    """``launch/evaluate.py``: ``cache=model`` (default) evaluates the checkpoint as trained, at its parallel
    layout (megatron); any cache of the inference engine (``auto``: the checkpoint's own, ``full``, ``dmc``,
    an eviction policy such as ``h2o``, ``lightcache``, ``less``) runs the evaluation harness
    (``dmc_train/evaluation/harness.py``): perplexity and next-token accuracy when every sequence is decoded
    with that cache, the same for ``incremental_sequences`` sequences decoded for real by the engine, the KV
    bytes held per token, and decode throughput at a KV budget of ``kv_budget_seqs`` uncompressed
    sequences (0: not measured). ``budget``: a policy's entries per (sequence, layer, KV head), or a fraction
    of the context (None: 0.25 for a policy; LESS: the budget it was trained at); ``schedule``: the policy's
    ``decode`` or ``prefill``; ``prompt_len``: tokens prefilled first; ``max_sequences``: the first N
    sequences of each split (0: all); ``options``: the cache's own options (``+eval.options.recent_fraction=0.3``);
    ``device``: where the harness runs the inference model (``cpu``, ``cuda``, ``cuda:1``)."""

    cache: str = "model"
    budget: Optional[float] = None
    schedule: str = "decode"
    prompt_len: int = 1
    max_sequences: int = 0
    incremental_sequences: int = 4
    kv_budget_seqs: int = 8
    options: dict[str, Any] = field(default_factory=dict)
    device: str = "cpu"


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
    eval: EvalConfig = field(default_factory=EvalConfig)
    # One structured config per method, chosen with the Hydra group ``method`` (``method=dmc``);
    # the nodes live with the methods (dmc_train/methods/configs.py).
    method: Any = MISSING
    array_task_id: Optional[int] = None  # the task of a job array (launch/submit.py --array sets it)


_CHOICES = {
    "optim.schedule": ("constant", "linear", "cosine", "wsd"),
    "train.precision": ("fp32", "bf16", "fp16"),
    "train.recompute": ("none", "selective", "full"),
    "data.kind": ("synthetic", "indexed"),
}

def validate(cfg: Any, world_size: int) -> ParallelLayout:
    """Check values Hydra's type check cannot (all but the method's own node, which
    :func:`dmc_train.methods.validate_method` checks); raise ConfigError (one line) on the first
    problem. Returns the parallel layout on ``world_size`` processes."""
    check_known_keys(cfg)
    for key, allowed in _CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}")
    m, p, t = cfg.model, cfg.parallel, cfg.train
    check_ranges(cfg)
    check_logging(cfg.logging)
    groups = kv_groups(m)
    if m.hidden_size % m.num_attention_heads:
        raise ConfigError(f"model.hidden_size={m.hidden_size} is not divisible by "
                          f"model.num_attention_heads={m.num_attention_heads}")
    if m.num_attention_heads % groups:
        raise ConfigError(f"model.num_query_groups={groups} does not divide "
                          f"model.num_attention_heads={m.num_attention_heads}")
    check_rope_scaling(rope_scaling_of(m))
    if t.seq_length > m.max_position_embeddings:
        raise ConfigError(f"train.seq_length={t.seq_length} exceeds "
                          f"model.max_position_embeddings={m.max_position_embeddings}")
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
    o = cfg.optim
    after_warmup = (o.decay_steps or t.max_steps) - o.warmup_steps
    if o.schedule == "wsd" and not 1 <= o.anneal_steps <= after_warmup:
        raise ConfigError(f"optim.schedule=wsd needs 1 <= optim.anneal_steps <= the decay steps after warm-up "
                          f"({after_warmup}); got optim.anneal_steps={o.anneal_steps}")
    if cfg.data.kind == "indexed" and not cfg.data.prefixes:
        raise ConfigError("data.kind=indexed needs data.prefixes (run `python launch/prepare_data.py` to make them)")
    c = cfg.checkpoint
    if c.keep_best and (not t.eval_interval or c.save_interval % t.eval_interval):
        raise ConfigError(f"checkpoint.keep_best=true compares the validation of each saved step, so every save "
                          f"needs an evaluation at its step: set train.eval_interval > 0 dividing "
                          f"checkpoint.save_interval (now {t.eval_interval} and {c.save_interval})")
    return layout


def check_rope_scaling(r: Any) -> None:
    """``model.rope_scaling`` (:class:`RopeScalingConfig`'s fields); ConfigError, one line."""
    if r.type not in ROPE_SCALING_TYPES:
        raise ConfigError(f"model.rope_scaling.type={r.type!r} is not one of {', '.join(ROPE_SCALING_TYPES)}")
    if r.type == "none":
        return
    if not (math.isfinite(r.factor) and r.factor > 0):
        raise ConfigError(f"model.rope_scaling.factor={r.factor} is not allowed; use a finite factor > 0 (e.g. 8.0)")
    if r.type == "llama3":
        if not 0 < r.low_freq_factor < r.high_freq_factor:
            raise ConfigError(f"model.rope_scaling needs 0 < low_freq_factor < high_freq_factor; got "
                              f"{r.low_freq_factor} and {r.high_freq_factor}")
        if r.original_max_position_embeddings < 1:
            raise ConfigError(f"model.rope_scaling.original_max_position_embeddings="
                              f"{r.original_max_position_embeddings} is not allowed; use an integer >= 1")


def check_known_keys(cfg: Any) -> None:
    """Refuse a key the schema does not define: Hydra's ``+key=value`` adds one to a structured config (and a
    recipe may), and it would be ignored and saved in config.yaml. Raises ConfigError naming the closest
    known key. Nodes typed by a dataclass (the schema, the method's node) are checked; free-form ones not."""
    import dataclasses
    import difflib

    from omegaconf import DictConfig

    unknown, known = [], []

    def items(node: Any) -> list:  # a node's (key, unresolved value) pairs; none for a null or missing node
        return [] if not isinstance(node, DictConfig) or node._is_none() or node._is_missing() else \
            list(node.items_ex(resolve=False))

    def walk(node: DictConfig, prefix: str) -> None:
        node_type = OmegaConf.get_type(node)
        fields = {f.name for f in dataclasses.fields(node_type)} if dataclasses.is_dataclass(node_type) else None
        for key, value in items(node):
            path = f"{prefix}{key}"
            if fields is not None and key not in fields:
                while items(value):  # name the key as typed: +foo.bar=1
                    inner, value = items(value)[0]
                    path = f"{path}.{inner}"
                unknown.append(path)
                continue
            known.append(path)
            if isinstance(value, DictConfig):
                walk(value, path + ".")

    walk(cfg, "")
    if unknown:
        key = unknown[0]
        closest = difflib.get_close_matches(key, known, n=1, cutoff=0.0)
        raise ConfigError(f"{key} is not a key of the config schema"
                          + (f"; the closest known key is {closest[0]}" if closest else "")
                          + " (check the spelling; +key=value adds keys, key=value sets existing ones)")


_MIN_VALUES = {
    "model.num_layers": 1,
    "model.hidden_size": 1,
    "model.ffn_hidden_size": 1,
    "model.num_attention_heads": 1,
    "model.vocab_size": 2,
    "train.seq_length": 1,
    "train.global_batch_size": 1,
    "train.micro_batch_size": 1,
    "train.log_interval": 1,
    "train.max_nonfinite_steps": 1,
    "train.eval_interval": 0,
    "checkpoint.save_interval": 0,
    "optim.warmup_steps": 0,
}
_ZERO_MEANS = {"train.eval_interval": "never", "checkpoint.save_interval": "only at the end",
               "optim.warmup_steps": "no warm-up"}


def check_ranges(cfg: Any) -> None:
    """Numeric fields with a lower bound, and a finite positive learning rate; raise ConfigError (one line)."""
    lr = cfg.optim.lr
    if not math.isfinite(lr) or lr <= 0:
        raise ConfigError(f"optim.lr={lr} is not allowed; use a finite learning rate > 0 (e.g. 3e-4)")
    for key, low in _MIN_VALUES.items():
        value = OmegaConf.select(cfg, key)
        if value < low:
            meaning = f" (0 = {_ZERO_MEANS[key]})" if key in _ZERO_MEANS else ""
            raise ConfigError(f"{key}={value} is not allowed; use an integer >= {low}{meaning}")


def check_logging(logging: Any) -> None:
    """wandb is optional (not in requirements.txt): a run that logs to it needs it installed."""
    if logging.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"logging.wandb_project={logging.wandb_project} needs wandb, which is not installed; "
                          "pip install wandb==0.31.0, or leave logging.wandb_project unset")


def kv_groups(model: Any) -> int:
    """Number of KV heads (query groups) of a model config: ``num_query_groups``, or the number of
    attention heads for MHA (``num_query_groups: null``)."""
    return model.num_query_groups or model.num_attention_heads


def rope_scaling_of(model: Any) -> RopeScalingConfig:
    """The RoPE scaling of a model config (``model.rope_scaling``) as a :class:`RopeScalingConfig`; type ``none``
    for configs saved before the option existed (no such key)."""
    node = model.get("rope_scaling") if hasattr(model, "get") else getattr(model, "rope_scaling", None)
    if node is None:
        return RopeScalingConfig()
    if isinstance(node, RopeScalingConfig):
        return node
    return RopeScalingConfig(**{k: node[k] for k in node})


@dataclass(frozen=True)
class ParallelLayout:
    """A process layout: tensor x pipeline (x virtual stages per pipeline rank) x data parallel."""

    tensor: int = 1
    pipeline: int = 1
    virtual_pipeline: Optional[int] = None
    data: int = 1


def check_layout(world_size: int, tp: int, pp: int, vpp: Optional[int], num_layers: int,
                 num_heads: int, num_query_groups: int) -> ParallelLayout:
    """Validate a parallel layout against the world size and the model; raise ConfigError in one line."""
    if tp < 1 or pp < 1:
        raise ConfigError(f"parallel.tensor={tp} and parallel.pipeline={pp} must be >= 1")
    if num_heads % tp:
        raise ConfigError(f"parallel.tensor={tp} does not divide model.num_attention_heads={num_heads}; "
                          f"choose a tensor size that divides it")
    if num_query_groups % tp:
        raise ConfigError(f"parallel.tensor={tp} does not divide model.num_query_groups={num_query_groups}; "
                          f"choose a tensor size that divides it")
    if world_size % (tp * pp):
        raise ConfigError(
            f"world size {world_size} is not divisible by parallel.tensor x parallel.pipeline = {tp}x{pp}; "
            f"launch a multiple of {tp * pp} processes or change the layout")
    stages = pp * (vpp or 1)
    if num_layers % stages:
        raise ConfigError(f"model.num_layers={num_layers} is not divisible by pipeline x virtual stages = {stages}")
    if vpp is not None and pp < 2:
        raise ConfigError("parallel.virtual_pipeline needs parallel.pipeline >= 2")
    return ParallelLayout(tp, pp, vpp, world_size // (tp * pp))


def num_microbatches(cfg: Any, data_parallel: int) -> int:
    return cfg.train.global_batch_size // (cfg.train.micro_batch_size * data_parallel)
