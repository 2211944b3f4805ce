"""Keyformer (Adnan et al., MLSys 2024): a recent window plus the "key tokens" with the largest score
accumulated over the prompt and the generation, where each query adds a Gumbel-regularised softmax
over the unnormalised logits ``x`` of the entries it sees (Eq. 9):

    f_j += exp((x_j + zeta_j) / tau) / sum_i exp((x_i + zeta_i) / tau),   zeta ~ Gumbel(0, 1)

``tau`` is ``tau_init`` over the prompt and grows by one increment per decode step (Eq. 10): the
paper's ``(tau_end - tau_init) / T`` with ``T`` the sequence's generation length
(``tau_schedule=paper``), or the authors' code's ``tau_step`` (``tau_schedule=code``).

GQA (the project's choice; the official code supports only MHA models): ``x`` of a KV head is the
mean logit of its G query heads. The noise ``zeta`` is a counter-based function of (seed, layer,
KV head, query position, key position), so the engine and the parallel form draw the same noise
for the same pair, whatever the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dmc_train.errors import ConfigError
from dmc_train.policies.base import RecentWindowConfig, Scorer
from kernels.paged import attention_column_sums

TAU_SCHEDULES = ("paper", "code")
_MASK32 = 0xFFFFFFFF


def _mix(x):
    """A 32-bit integer hash of an int64 tensor or a Python int (int64 arithmetic that never overflows: both
    give the same values)."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    return x ^ (x >> 16)


def gumbel_noise(seed: int, layer: int, heads: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor):
    """Gumbel(0, 1) noise for every (KV head, query position, key position), broadcasting the three int64
    tensors against each other; fp32."""
    h = _mix((seed * 1_000_003 + layer) & _MASK32)  # a Python int: no tensor calls
    for part in (heads, query_pos, key_pos):
        h = _mix(h ^ ((part if part.dtype == torch.int64 else part.long()) & _MASK32))
    u = (h.double() + 0.5) / 2.0**32
    return (-torch.log(-torch.log(u))).float()


@dataclass
class KeyformerConfig(RecentWindowConfig):
    recent_fraction: float = 0.3  # share of the budget for the recent window (the paper's default ratio)
    tau_init: float = 1.0
    tau_end: float = 2.0
    tau_schedule: str = "paper"  # paper: (tau_end - tau_init) / T per step | code: + tau_step per step
    tau_step: float = 0.01
    noise: bool = True  # False: the accumulated softmax with temperature, no Gumbel noise
    seed: int = 0  # the Gumbel noise

    def check(self) -> None:
        super().check()
        if self.tau_schedule not in TAU_SCHEDULES:
            raise ConfigError(f"tau_schedule={self.tau_schedule!r} is not one of {', '.join(TAU_SCHEDULES)}")
        if self.tau_init <= 0 or self.tau_end <= 0:
            raise ConfigError(f"tau_init={self.tau_init} and tau_end={self.tau_end} must be > 0")


class Keyformer(Scorer):
    name = "keyformer"
    label = "Keyformer"
    Config = KeyformerConfig
    attention = "logits"

    def fixed(self, budget):
        return 0, self.cfg.recent(budget)

    def tau(self, step) -> torch.Tensor:
        """``[N]`` temperature of the current decode step."""
        c = self.cfg
        if c.tau_schedule == "code":
            per_step = torch.full_like(step.decoded, c.tau_step, dtype=torch.float32)
        else:
            per_step = (c.tau_end - c.tau_init) / step.horizon.clamp(min=1).float()
        return c.tau_init + step.decoded.float() * per_step

    def prompt_scores(self, q, k, layer):
        b, hk = k.shape[:2]
        q_mean = q.float().view(b, hk, -1, *q.shape[2:]).mean(2)  # mean logit = logit of the mean query
        heads = torch.arange(hk, device=k.device)[:, None, None]
        noise = None
        if self.cfg.noise:
            def noise(qp, kp):
                return gumbel_noise(self.cfg.seed, layer, heads, qp[:, None], kp[None, :])
        return attention_column_sums(q_mean, k, self.scale, tau=self.cfg.tau_init, noise=noise)

    def update(self, entries, attention, step):
        x = attention / self.group
        if self.cfg.noise:
            x = x + gumbel_noise(self.cfg.seed, step.layer, step.heads[:, None], step.t[:, None], entries.positions)
        x = (x / self.tau(step)[:, None]).masked_fill(~entries.valid, float("-inf"))
        entries.scores += torch.softmax(x, dim=-1)
