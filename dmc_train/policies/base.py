"""What every eviction / selection policy shares: its options, the per-entry state, and the keep rule.

A policy is a **scorer** (one file per policy, one idea each): it says how each kept entry is scored
and how the scores change when a query attends. Everything else is shared and lives here or in the
one evicting cache of the engine (``dmc_train/inference/caches/evicting.py``):

- the **budget** ``B``: entries kept per (sequence, layer, KV head) = the entries a query attends
  over, its own included (H2O's and LESS's convention: query t sees B entries);
- the **fixed part**: ``n_sink`` first tokens and a window of the ``n_recent`` newest tokens (the
  incoming one included) that are never evicted (:meth:`Scorer.fixed`);
- the **keep rule**: when a row is full, the entry with the lowest *priority* outside the fixed
  part is the victim (:func:`victims`); after a prompt, the ``keep`` entries with the highest
  priority, the fixed part first, stay (:func:`select`).

Two schedules: ``decode`` (the papers'): the prompt is prefilled with full causal attention,
compressed once to ``B`` with the scores the prompt produced, and every decode step t then evicts
one entry before token t is written (``B`` held at every step); ``prefill`` (kvpress's): the prompt
is compressed to ``max(1, int(P * (1 - compression_ratio)))`` entries and decoded tokens are appended.

State of ``N`` rows with ``L`` entry slots each (:class:`Entries`): ``positions [N, L]`` int64 or int32 (token
position of the entry, -1 = empty slot; the engine keeps int32), ``scores [N, L]`` fp32, and for hashing policies
``codes [N, L, nbytes]`` uint8. The engine's slots are page entries; the parallel form fills its slots as the
engine does. Rows are ordered ``[sequence, KV head]`` (``N = b * H_kv``), which layer-wide aggregation relies on.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, fields
from types import UnionType
from typing import Any, ClassVar, Optional

import torch
import torch.nn.functional as F

from dmc_train.errors import ConfigError
from dmc_train.policies.budget import DEFAULT as DEFAULT_BUDGET
from dmc_train.policies.budget import Budget
from kernels import eviction
from kernels.paged import attention_column_sums

SCHEDULES = ("decode", "prefill")
AGGREGATES = ("kv_head", "layer")


@dataclass
class PolicyConfig:
    """Options every policy has. ``budget``: entries per (sequence, layer, KV head), a number of entries or a
    fraction of the context evaluated or generated (:class:`~dmc_train.policies.budget.Budget`); ``schedule``:
    ``decode`` | ``prefill``;
    ``compression_ratio``: the fraction of the prompt the ``prefill`` schedule removes (kvpress's);
    ``aggregate``: priorities per KV head, or averaged over the KV heads of a layer (every KV head then
    keeps the same positions). A policy with randomness adds ``seed`` (Keyformer's noise, LSH-E's projection)."""

    budget: float = DEFAULT_BUDGET
    schedule: str = "decode"
    compression_ratio: float = 0.5
    aggregate: str = "kv_head"

    def check(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule={self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        if self.aggregate not in AGGREGATES:
            raise ConfigError(f"aggregate={self.aggregate!r} is not one of {', '.join(AGGREGATES)}")
        Budget.of(self.budget)
        if not 0 <= self.compression_ratio < 1:
            raise ConfigError(f"compression_ratio={self.compression_ratio} must be in [0, 1) (the fraction of the "
                              f"prompt removed)")


@dataclass
class RecentWindowConfig(PolicyConfig):
    """A policy whose fixed part is a window of the ``recent_fraction`` newest entries of the budget."""

    recent_fraction: float = 0.5

    def check(self) -> None:
        super().check()
        if not 0 <= self.recent_fraction <= 1:
            raise ConfigError(f"recent_fraction={self.recent_fraction} must be in [0, 1]")

    def recent(self, budget: int) -> int:
        return int(round(self.recent_fraction * budget))


def make_config(config_type: type, options: dict[str, Any], policy: str) -> PolicyConfig:
    """``config_type(**options)`` checked by the one schema of the policies' options: a known name
    (:func:`check_names`), the field's type (:func:`checked_value`), then the config's own ranges and names
    (``check()``); ``compression_ratio`` only with the ``prefill`` schedule, the one that reads it. One-line
    :class:`ConfigError` naming the option and the fix."""
    types = option_types(config_type)
    check_names(options, types, policy)
    cfg = config_type(**{key: checked_value(policy, key, value, types[key]) for key, value in options.items()})
    cfg.check()
    if "compression_ratio" in options and cfg.schedule != "prefill":
        raise ConfigError(f"{policy}: compression_ratio is read by the prefill schedule only (this one is "
                          f"{cfg.schedule!r}); add schedule=prefill or leave compression_ratio out")
    return cfg


def option_types(config_type: type, rename: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """Option name -> type of every field of the dataclass ``config_type`` (``rename``: field -> option name)."""
    hints = typing.get_type_hints(config_type)
    rename = rename or {}
    return {rename.get(f.name, f.name): hints[f.name] for f in fields(config_type)}


def check_names(options: dict[str, Any], types: dict[str, Any], owner: str) -> None:
    """One-line :class:`ConfigError` for an option ``owner`` does not have, listing the ones it has."""
    unknown = sorted(set(options) - set(types))
    if unknown:
        raise ConfigError(f"{owner} has no option {unknown[0]!r}; its options are {', '.join(types)}")


def checked_value(owner: str, key: str, value: Any, kind: Any) -> Any:
    """``value`` of option ``key`` if it fits the field type ``kind`` (float: a number; int: a whole number;
    bool: true or false; str: a name; ``Optional[...]``: also None), ints given for whole-number fields as int;
    else a one-line :class:`ConfigError`."""
    if typing.get_origin(kind) in (typing.Union, UnionType):
        if value is None:
            return None
        kind = next(k for k in typing.get_args(kind) if k is not type(None))
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is float and number:
        return value
    if kind is int and number and float(value).is_integer():
        return int(value)
    if (kind is bool and isinstance(value, bool)) or (kind is str and isinstance(value, str)):
        return value
    wanted = {float: "a number", int: "a whole number", bool: "true or false", str: "a name"}[kind]
    raise ConfigError(f"{owner} option {key}={value!r} must be {wanted}")


@dataclass
class Entries:
    """Per-entry state of ``N`` rows (module docstring): ``positions [N, L]`` (-1 empty), ``scores [N, L]``,
    ``codes [N, L, nbytes]`` or None."""

    positions: torch.Tensor
    scores: torch.Tensor
    codes: Optional[torch.Tensor] = None

    @property
    def valid(self) -> torch.Tensor:
        return self.positions >= 0


@dataclass
class Step:
    """Where the rows are. ``layer``; ``heads [N]``: each row's KV head; ``t [N]``: position of the current
    (incoming) token; ``decoded [N]``: decode steps since the prompt (0 for its first generated token);
    ``horizon [N]``: tokens the sequence will generate (0 = unknown); ``num_kv_heads``. ``layer`` is an int, or
    for an :meth:`Scorer.update` of several layers' entries at once (``[layers, N, L]``) their indices ``[layers,
    1, 1]`` (int64)."""

    layer: int | torch.Tensor
    heads: torch.Tensor
    t: torch.Tensor
    decoded: torch.Tensor
    horizon: torch.Tensor
    num_kv_heads: int


class Scorer:
    """One policy's scoring idea. Subclasses set ``name`` (the registry's key: ``--cache``, ``eval.cache``),
    ``label`` (how tables and plots name it, e.g. ``H2O``), ``Config`` and override what they use.

    The hooks are the scoring ones: :meth:`fixed`, :meth:`prompt_scores`, :meth:`new_scores`, :meth:`codes`,
    :meth:`priority` and :meth:`update`; batching layers, writing state and choosing slots are the caches'.

    ``attention``: what the decode attention must return per kept entry for :meth:`update` (None,
    ``"probs"``: probabilities summed over the G query heads of the row, ``"logits"``: pre-softmax
    logits summed over them). ``code_bits``: bits of a per-entry hash code (0: none). ``query_priority``:
    :meth:`priority` reads the current query; when False it depends on the entries alone, so a caller may
    choose the victims of several layers at once, before their queries exist (the engine's decode step).
    """

    name: ClassVar[str] = "base"
    label: ClassVar[str] = "base"
    Config: ClassVar[type] = PolicyConfig
    attention: ClassVar[Optional[str]] = None
    query_priority: ClassVar[bool] = False
    code_bits: int = 0

    def __init__(self, cfg: PolicyConfig, head_dim: int, group: int, scale: float):
        self.cfg, self.head_dim, self.group, self.scale = cfg, head_dim, group, scale

    def fixed(self, budget: int) -> tuple[int, int]:
        """``(n_sink, n_recent)`` never evicted at this budget (default: none)."""
        return 0, 0

    @property
    def key_scores(self) -> bool:
        """:meth:`new_scores` reads the keys (the scorer overrides it); when False new entries score 0, so a caller
        may record the new tokens of several layers at once (:func:`record_token`), before their keys exist."""
        return type(self).new_scores is not Scorer.new_scores

    def budget(self, context: Optional[int]) -> int:
        """The configured budget in entries for ``context`` tokens evaluated or generated (None: unknown, entries
        only), checked against the fixed part (:meth:`check_budget`)."""
        budget = Budget.of(self.cfg.budget).entries(context)
        self.check_budget(budget)
        return budget

    def check_budget(self, budget: int) -> None:
        """One-line :class:`ConfigError` unless ``budget`` holds the fixed part and, beside the sinks, at least one
        entry (the incoming token)."""
        sink, recent = self.fixed(budget)
        if budget < max(sink + recent, sink + 1):
            raise ConfigError(f"budget {budget} leaves {self.name} no room beside its fixed part ({sink} sink + "
                              f"{recent} recent entries); raise the budget or shrink the fixed part")

    # -- scores -----------------------------------------------------------------------------------
    def prompt_scores(self, q: torch.Tensor, k: torch.Tensor, layer: int) -> torch.Tensor:
        """Scores of a prompt's keys after its prefill: ``q [b, H, P, d]``, ``k [b, H_kv, P, d]`` (RoPE
        applied) -> ``[b, H_kv, P]`` fp32. Default: with ``attention = "probs"``, the probability each key received
        from the prompt's queries, summed over them (its column sum: :func:`prompt_attention` computes it in the
        prompt's attention pass); otherwise zeros."""
        if self.attention == "probs":
            return attention_column_sums(q, k, self.scale)
        return k.new_zeros(k.shape[:3], dtype=torch.float32)

    def new_scores(self, k: torch.Tensor) -> torch.Tensor:
        """Score of freshly written entries ``k [N, d]`` -> ``[N]`` (before the query attends). Default: zeros; a
        scorer that overrides it with scores of the keys sets ``key_scores``."""
        return torch.zeros(k.shape[0], dtype=torch.float32, device=k.device)

    def codes(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """Hash codes of ``x [..., d]`` -> ``[..., nbytes]`` uint8 (policies with ``code_bits``)."""
        return None

    def priority(self, entries: Entries, q: torch.Tensor, step: Step) -> torch.Tensor:
        """Keep priority ``[N, L]`` of the kept entries when token ``step.t`` (query ``q [N, G, d]``) comes
        in; the lowest outside the fixed part is evicted. Default: the scores."""
        return entries.scores

    def update(self, entries: Entries, attention: Optional[torch.Tensor], step: Step) -> None:
        """After the current query attended: ``attention [N, L]`` as declared by ``attention`` (0 on empty
        slots). Updates ``entries.scores`` in place. Default: nothing. The entries and ``attention`` may have a
        leading dim, the layers of a decode step (``[layers, N, L]``, ``step.layer`` then ``[layers, 1, 1]``)."""


def prompt_attention(scorer: Scorer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt's causal attention ``[b, H, P, d_v]`` and its :meth:`Scorer.prompt_scores` ``[b, H_kv, P]``
    (layouts there; ``v [b, H_kv, P, d_v]``): from one pass when the scores are the default column sums."""
    if scorer.attention == "probs" and type(scorer).prompt_scores is Scorer.prompt_scores:
        return attention_column_sums(q, k, scale, v=v)
    g = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=g > 1)
    return out, scorer.prompt_scores(q, k, layer)


# -- the keep rule ------------------------------------------------------------------------------------
def protected(positions: torch.Tensor, newest: torch.Tensor, sink: int, recent: int) -> torch.Tensor:
    """Entries in the fixed part: ``positions [N, L]``, ``newest [N]`` = the newest token of the window
    (the incoming one at an eviction, the prompt's last at a compression)."""
    return (positions >= 0) & ((positions < sink) | (positions > newest[:, None] - recent))


def aggregate(priority: torch.Tensor, how: str, num_kv_heads: int) -> torch.Tensor:
    """``layer``: the mean over the KV heads of each (sequence, layer) (rows ordered [sequence, KV head]);
    ``priority [..., N, L]``."""
    if how == "kv_head" or num_kv_heads == 1:
        return priority
    *lead, n, length = priority.shape
    return priority.view(*lead, n // num_kv_heads, num_kv_heads, length).mean(-2, keepdim=True).expand(
        *lead, -1, num_kv_heads, -1).reshape(priority.shape)


def victims(priority: torch.Tensor, entries: Entries, newest: torch.Tensor, sink: int, recent: int) -> torch.Tensor:
    """Slot ``[N]`` of each row's victim: the lowest priority among valid entries outside the fixed part;
    ties go to the oldest position, so the result does not depend on the order of the slots. ``newest [N]``:
    the incoming token (every entry is older). ``priority`` and the entries may have leading dims
    (``[..., N, L]`` -> ``[..., N]``: e.g. the layers of a step). :func:`kernels.eviction.victims`."""
    return eviction.victims(priority, entries.positions, newest, sink, recent)


def select(priority: torch.Tensor, positions: torch.Tensor, keep: int, newest: torch.Tensor, sink: int,
           recent: int) -> torch.Tensor:
    """Slots ``[N, keep]`` (ascending) of the ``keep`` entries that stay: the fixed part, then the highest
    priority, ties to the newest position (``keep`` <= valid entries of every row)."""
    fixed = protected(positions, newest, sink, recent)
    ranked = priority.masked_fill(fixed, float("inf")).masked_fill(positions < 0, float("-inf"))
    by_position = positions.argsort(dim=-1, descending=True, stable=True)
    order = ranked.gather(-1, by_position).argsort(dim=-1, descending=True, stable=True)
    return by_position.gather(-1, order[:, :keep]).sort(-1).values


def victim_slots(scorer: Scorer, entries: Entries, q: torch.Tensor, step: Step, budget: int) -> torch.Tensor:
    """Slot ``[N]`` each row would give up before token ``step.t`` is written (``q [N, G, d]`` the current
    queries): the victim of the scorer's priority, aggregated as configured. Meaningful for full rows only.
    Without ``scorer.query_priority`` the entries may have leading dims (``[..., N, L]`` -> ``[..., N]``)."""
    priority = aggregate(scorer.priority(entries, q, step), scorer.cfg.aggregate, step.num_kv_heads)
    return victims(priority, entries, step.t, *scorer.fixed(budget))


def choose_victims(scorer: Scorer, entries: Entries, q: torch.Tensor, step: Step, budget: int):
    """The decode schedule's eviction before token ``step.t`` is written: ``(full [N] bool, victim [N])``,
    the rows at their budget and the slot each would give up (``q [N, G, d]`` the current queries)."""
    full = entries.valid.sum(-1) >= budget
    if not bool(full.any()):
        return full, torch.zeros_like(step.t)
    return full, victim_slots(scorer, entries, q, step, budget)


def insert(scorer: Scorer, entries: Entries, slot: torch.Tensor, k: torch.Tensor, t: torch.Tensor) -> None:
    """Record token ``t [N]`` with keys ``k [N, d]`` (or ``[B, N / B, d]``) in slot ``slot [N]`` of every row:
    :func:`record_token`, then :func:`record_keys`."""
    record_token(scorer, entries, slot, t)
    record_keys(scorer, entries, slot, k)


def record_token(scorer: Scorer, entries: Entries, slot: torch.Tensor, t: torch.Tensor) -> None:
    """The part of :func:`insert` that does not read the keys: token ``t [N]``'s position in slot ``slot [..., N]``
    of every row and, when the scorer's new scores are zeros (``scorer.key_scores`` False), its score. The entries
    and ``slot`` may have leading dims (``[..., N, L]``: e.g. every layer of a decode step at once)."""
    index = slot.unsqueeze(-1)  # [..., N, 1]
    t = t if t.dtype == entries.positions.dtype else t.to(entries.positions.dtype)
    entries.positions.scatter_(-1, index, t[:, None].expand(index.shape))
    if not scorer.key_scores:
        entries.scores.scatter_(-1, index, 0.0)


def record_keys(scorer: Scorer, entries: Entries, slot: torch.Tensor, k: torch.Tensor) -> None:
    """The part of :func:`insert` that reads the keys ``k [N, d]`` (or ``[B, N / B, d]``, e.g. a view of a layer's
    heads) written in slot ``slot [N]`` of every row: their scores (``scorer.key_scores``) and hash codes
    (``scorer.code_bits``). The entries, ``slot`` and ``k`` may have leading dims (``[..., N]``: every layer of a
    decode step at once)."""
    if not (scorer.key_scores or entries.codes is not None):
        return
    index, k = slot.unsqueeze(-1), k.reshape(-1, k.shape[-1])  # [..., N, 1], [... N, d]
    if scorer.key_scores:
        entries.scores.scatter_(-1, index, scorer.new_scores(k).view(index.shape))
    if entries.codes is not None:
        codes = scorer.codes(k).view(*index.shape, -1)  # [..., N, 1, nbytes]
        entries.codes.scatter_(-2, index.unsqueeze(-1).expand(codes.shape), codes)
