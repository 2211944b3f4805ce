"""LSH-E (locality-sensitive eviction): evict the kept key least similar in angle to the current query,
judged by the Hamming distance of SimHash codes; no attention weights are needed.

Codes: ``h(x) = [R x >= 0]`` with ``R`` a ``bits x d`` matrix of N(0, 1) entries (one per policy,
seeded), stored packed, ``ceil(bits / 8)`` bytes per kept key; they count in the cache's state. At
decode step t the victim is the key with the largest ``Hamming(h(q_t), h(k_j))`` (Algorithm 1: the
current query, no accumulation), summed over the G query heads of a KV head (GQA). The first
``n_sink`` (4) and the ``n_recent`` (10) newest tokens are always kept (the paper's setting).

After a prompt, the paper fills the cache with its first B tokens and runs the eviction over the rest
of the prompt; the project compresses once like the other policies, ranking each prompt key by its
mean Hamming distance to the prompt queries that see it (the paper's own global ranking, App. E).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dmc_train.errors import ConfigError
from dmc_train.policies.base import PolicyConfig, Scorer
from kernels.eviction import hamming, hamming_sums


def on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` (itself when it is there already: no call)."""
    return t if t.device == device else t.to(device)


@dataclass
class LSHEConfig(PolicyConfig):
    bits: int = 16
    n_sink: int = 4
    n_recent: int = 10
    seed: int = 0  # the random projection

    def check(self) -> None:
        super().check()
        if not 1 <= self.bits <= 256:
            raise ConfigError(f"bits={self.bits} must be in [1, 256]")
        if self.n_sink < 0 or self.n_recent < 0:
            raise ConfigError(f"n_sink={self.n_sink} and n_recent={self.n_recent} must be >= 0")


class LSHE(Scorer):
    name = "lsh_e"
    label = "LSH-E"
    Config = LSHEConfig
    query_priority = True

    def __init__(self, cfg, head_dim, group, scale):
        super().__init__(cfg, head_dim, group, scale)
        self.code_bits = cfg.bits
        gen = torch.Generator().manual_seed(cfg.seed)
        self.projection = torch.randn(cfg.bits, head_dim, generator=gen)  # R [bits, d]
        self.bit_weights = (2 ** torch.arange(8)).to(torch.uint8)

    def fixed(self, budget):
        return self.cfg.n_sink, self.cfg.n_recent

    def codes(self, x):
        x = x if x.dtype == torch.float32 else x.float()
        bits = x @ on(self.projection, x.device).T >= 0  # [..., bits] bool
        pad = (-bits.shape[-1]) % 8
        if pad:
            bits = torch.nn.functional.pad(bits, (0, pad))
        bits = bits.unflatten(-1, (-1, 8))  # bit i of a byte weighs 2^i (bool * uint8: uint8, at most 255 a byte)
        return (bits * on(self.bit_weights, x.device)).sum(-1, dtype=torch.uint8)

    def prompt_scores(self, q, k, layer, elements: int = 1 << 22):
        b, hk, n = k.shape[:3]
        kc = self.codes(k)  # [b, H_kv, n, nbytes]
        qc = self.codes(q).view(b, hk, -1, n, kc.shape[-1])  # [b, H_kv, G, n, nbytes]
        block = max(1, elements // qc[:, :, :, 0].numel() // n)  # query blocks of at most ~elements codes
        total = torch.zeros(b, hk, n, dtype=torch.float32, device=k.device)
        for start in range(0, n, block):
            end = min(n, start + block)
            dist = hamming(qc[:, :, :, start:end, None], kc[:, :, None, None]).sum(2).float()  # [b, H_kv, m, n]
            causal = torch.arange(n, device=k.device)[None, :] <= torch.arange(start, end, device=k.device)[:, None]
            total += (dist * causal).sum(2)
        seen_by = (n - torch.arange(n, device=k.device)).float()  # queries i >= j
        return -total / seen_by

    def priority(self, entries, q, step):
        return -hamming_sums(self.codes(q), entries.codes).float()  # query codes [N, G, nbytes]
