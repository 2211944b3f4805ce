"""The structured config of every training method and its validation (no torch, no megatron).

Each class is one option of the Hydra group ``method`` (``method=dmc`` on the command line, or
``- override /method: dmc`` in a recipe's defaults); its fields are set as ``method.<field>=...``.
``check`` raises a one-line :class:`~dmc_train.errors.ConfigError` for settings that cannot work,
before any model is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from dmc_train.errors import ConfigError
from dmc_train.models.dmc_settings import DMCSettings
from dmc_train.models.less_settings import LESSSettings


@dataclass
class NoMethodConfig:
    """Plain (continued) pre-training; also GQA up-training of a converted checkpoint."""

    name: str = "none"

    @staticmethod
    def check(cfg: Any) -> None:
        pass


DECISION_CHANNELS = ("last", "first")
ACCUMULATIONS = ("exact", "window")
ATTENTION_IMPLS = ("auto", "fused", "blocked")
CR_LOSS_FORMS = ("paper", "released", "per_head", "per_layer_head")
DMC_VARIANTS = ("dmc", "c", "hardc")
ROPE_ORDERS = ("post", "pre")


@dataclass
class DMCAttentionConfig:
    """The fields DMC and Fixed Memory Pooling share (docs/DMC.md): the DMC attention's and the schedule's.
    Fixed pooling learns no decisions and ignores the decision, CR-loss and schedule fields (they stay so
    that a DMC recipe composes with ``method=fixed_pooling``); each method adds its own compression field."""

    name: str = ""  # each method's own (first in a saved config)
    decision_channel: str = "last"  # last (released code) | first (paper)
    init_offset: float = 5.0  # c0: alpha logit = k[c] - c0, omega = sigmoid(q[c] + c0)
    omega_eps: float = 1e-6  # added to omega (keeps z > 0); released code: finfo(dtype).eps (bf16 0.0078125)
    decision_threshold: float = 0.0  # hard alpha = [logit > threshold]; released bf16 inference ~ 0.00785
    tau: float = 0.1  # Gumbel-sigmoid temperature in training
    accumulation: str = "exact"  # exact (full recurrence = inference) | window (paper, w tokens)
    window: int = 12
    attention_impl: str = "auto"  # auto | fused | blocked (kernels.dmc.dmc_attention)
    cr_loss: str = "paper"  # paper (Eq. 10, soft) | released (hard, ST, hinge per sequence) | per_head | per_layer_head
    variant: str = "dmc"  # dmc | c (DMC-C: Eq. 13 constraint) | hardc (decisions shared per layer)
    rope_order: str = "post"  # post: accumulate RoPE-rotated keys | pre (released code): raw keys, k~_t rotated at t
    zero_out_steps: int = 0  # stage 1 (Eq. 12); 0 = skip (decision channel already unused)
    zero_out_fraction: float = 1.0  # anneal over this fraction of stage 1 (released code: 0.8)
    ramp_steps: int = 0  # stage 2: target CR rises linearly from 1 to target_cr
    finetune_steps: int = 0  # stage 3: fixed CR, cosine LR down to finetune_min_lr_ratio
    finetune_min_lr_ratio: float = 0.1

    @staticmethod
    def check(cfg: Any) -> None:
        d, m = cfg.method, cfg.model
        head_dim = m.hidden_size // m.num_attention_heads
        for key, allowed in (("decision_channel", DECISION_CHANNELS), ("accumulation", ACCUMULATIONS),
                             ("attention_impl", ATTENTION_IMPLS), ("cr_loss", CR_LOSS_FORMS),
                             ("variant", DMC_VARIANTS), ("rope_order", ROPE_ORDERS)):
            if d[key] not in allowed:
                raise ConfigError(f"method.{key}={d[key]!r} is not one of {', '.join(allowed)}")
        if d.window < 1:
            raise ConfigError(f"method.window={d.window} must be >= 1")
        if not d.omega_eps > 0:
            raise ConfigError(f"method.omega_eps={d.omega_eps} must be > 0 (it keeps the normaliser z positive)")
        if not abs(d.decision_threshold) < float("inf"):
            raise ConfigError(f"method.decision_threshold={d.decision_threshold} must be a finite number")
        if d.tau <= 0:
            raise ConfigError(f"method.tau={d.tau} must be > 0")
        if min(d.zero_out_steps, d.ramp_steps, d.finetune_steps) < 0:
            raise ConfigError("method.zero_out_steps, method.ramp_steps and method.finetune_steps must be >= 0")
        if not 0 < d.zero_out_fraction <= 1:
            raise ConfigError(f"method.zero_out_fraction={d.zero_out_fraction} must be in (0, 1]")
        if head_dim < 2:
            raise ConfigError(f"DMC needs a head dimension >= 2 to free a decision channel; "
                              f"model.hidden_size / model.num_attention_heads = {head_dim}")
        if cfg.train.recompute != "none":
            raise ConfigError(f"train.recompute={cfg.train.recompute!r} is not supported with DMC (its attention "
                              f"is already O(n) in memory); set train.recompute=none")
        if cfg.train.precision == "fp16":
            raise ConfigError("train.precision=fp16 is not supported with DMC (loss scaling of the CR gradient); "
                              "use bf16 or fp32")


@dataclass
class DMCConfig(DMCAttentionConfig):
    """DMC retrofitting (docs/METHODS.md, DMC): decisions, accumulation, CR loss and schedule."""

    name: str = "dmc"
    target_cr: float = 2.0  # compression ratio reached at the end of the ramp (>= 1)

    @staticmethod
    def check(cfg: Any) -> None:
        DMCAttentionConfig.check(cfg)
        d = cfg.method
        if not d.target_cr >= 1:
            raise ConfigError(f"method.target_cr={d.target_cr} must be >= 1 (1 = no compression)")
        if d.finetune_steps > 0 and cfg.optim.schedule != "constant":
            raise ConfigError(f"method.finetune_steps={d.finetune_steps} decays the learning rate itself (a cosine "
                              f"factor on the scheduler's LR); set optim.schedule=constant as the DMC recipes do, "
                              f"or method.finetune_steps=0 to keep optim.schedule={cfg.optim.schedule}")


@dataclass
class FixedPoolingConfig(DMCAttentionConfig):
    """Fixed Memory Pooling, the DMC paper's ablation: average every ``pool`` tokens into one slot."""

    name: str = "fixed_pooling"
    pool: int = 2  # tokens averaged into one slot: the compression ratio (1 = no compression)

    @staticmethod
    def check(cfg: Any) -> None:
        DMCAttentionConfig.check(cfg)
        if cfg.method.pool < 1:
            raise ConfigError(f"method.pool={cfg.method.pool} must be >= 1 (tokens averaged into one slot)")


@dataclass
class LESSConfig:
    """LESS distillation (docs/METHODS.md, LESS): per-head kernels learn, from the frozen model, the
    attention the eviction ``policy`` loses at ``budget`` (entries per sequence, layer and KV head: a
    count >= 1 or a fraction of train.seq_length)."""

    name: str = "less"
    policy: str = "h2o"  # an eviction policy of dmc_train/policies (h2o, streaming_llm, tova, ...)
    budget: float = 0.05
    policy_options: dict[str, Any] = field(default_factory=dict)  # the policy's own, e.g. recent_fraction
    # the kernels' settings, defaults from LESSSettings (models/less_settings.py), read by less_settings()
    hidden: int = LESSSettings.hidden
    rank: int = LESSSettings.rank
    dropout: float = LESSSettings.dropout
    init_scale: float = LESSSettings.init_scale

    @staticmethod
    def check(cfg: Any) -> None:
        m = cfg.method
        from dmc_train.policies import policy_config  # torch: only when a LESS config is checked

        try:  # the policy's options, the budget included (dmc_train/policies/budget.py)
            policy_config(m.policy, {"budget": m.budget, **dict(m.policy_options)})
        except ConfigError as e:
            raise ConfigError(f"method=less with method.policy={m.policy}: {e}") from None
        if m.hidden < 1 or m.rank < 1:
            raise ConfigError(f"method.hidden={m.hidden} and method.rank={m.rank} must be >= 1")
        if not 0 <= m.dropout < 1:
            raise ConfigError(f"method.dropout={m.dropout} must be in [0, 1)")
        if cfg.parallel.sequence_parallel:
            raise ConfigError("parallel.sequence_parallel=true is not supported with LESS (its per-layer loss needs "
                              "the whole sequence on every tensor-parallel rank); set it to false")
        if cfg.train.recompute != "none":
            raise ConfigError(f"train.recompute={cfg.train.recompute!r} is not supported with LESS (the base model is "
                              f"frozen: nothing to recompute); set train.recompute=none")


def less_settings(method: Any) -> LESSSettings:
    """The one :class:`LESSSettings` of a LESS ``method`` config (OmegaConf node or dict), for the training
    attention's layers and kernels."""
    return LESSSettings(**{f.name: method[f.name] for f in fields(LESSSettings)})


def dmc_settings(method: Any, head_dim: int, step: int | None = None) -> DMCSettings:
    """The one :class:`DMCSettings` of a ``method`` config (OmegaConf node, dataclass or ``meta.json``
    dict), for training, inference and the Hugging Face export; options missing from an older
    ``meta.json`` take their defaults.

    Raises a one-line ConfigError for a method that does not compress (``none``) and, given the
    checkpoint's ``step``, for a DMC checkpoint still in the zero-out stage (attention is vanilla there).
    """
    def field(name: str, default: Any = None) -> Any:
        return method.get(name, default) if hasattr(method, "get") else getattr(method, name, default)

    name = field("name")
    if name not in ("dmc", "fixed_pooling"):
        raise ConfigError(f"method.name={name!r}: the checkpoint was not trained with DMC (method=dmc) or "
                          f"fixed pooling, so it has no DMC decisions")
    channel = field("decision_channel", "last")
    if channel not in DECISION_CHANNELS:
        raise ConfigError(f"method.decision_channel={channel!r}; expected one of {', '.join(DECISION_CHANNELS)}")
    zero_out = int(field("zero_out_steps", 0) or 0)
    if name == "dmc" and step is not None and zero_out and step <= zero_out:  # rows are zeroed as step zero_out starts
        raise ConfigError(f"the checkpoint (step {step}) is still in DMC's zero-out stage "
                          f"(method.zero_out_steps={zero_out}), where attention is vanilla; use a later checkpoint")
    pooling = name == "fixed_pooling"
    return DMCSettings(
        channel=None if pooling else (head_dim - 1 if channel == "last" else 0),
        init_offset=float(field("init_offset", 5.0)),
        omega_eps=float(field("omega_eps", 1e-6)),
        decision_threshold=float(field("decision_threshold", 0.0)),
        tau=float(field("tau", 0.1)),
        accumulation=str(field("accumulation", "exact")),
        window=int(field("window", 12)),
        attention_impl=str(field("attention_impl", "auto")),
        variant=str(field("variant", "dmc")),
        pool=int(field("pool")) if pooling else None,
        rope_order=str(field("rope_order", "post")),
    )
