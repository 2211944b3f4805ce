"""Next-token sampling and stop rules for the inference engine.

``SamplingParams`` holds one request's options, ``sample`` picks the next token of every row of a
batch (greedy rows by one argmax, :func:`kernels.sampling.argmax`; sampled rows one at a time on the row's own
generator, so a seeded request draws the same tokens whatever else is in the batch), and ``StopChecker``
decides when a request is finished.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from dmc_train.errors import InferenceError
from kernels.sampling import argmax

# Cumulative sums carry float32 rounding, so a nucleus that reaches top_p up to this relative
# error counts as reaching it (probs [0.5, 0.3, 0.2] at top_p=0.5 keep token 0 only).
_TOP_P_RTOL = 1e-6

STOP_REASONS = ("stop_token", "eos", "stop_string", "length")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling options; lists are accepted for the tuple fields (``stop`` also takes a
    single string)."""

    max_new_tokens: int = 64  # >= 1
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # in (0, 1]; 1 = off
    seed: Optional[int] = None  # None = nondeterministic (torch's global generator)
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings
    ignore_eos: bool = False

    def __post_init__(self):
        def fail(field, allowed):
            raise InferenceError(f"{field} must be {allowed}, got {getattr(self, field)!r}")

        def set_(field, value):  # frozen: normalise in place once, here
            object.__setattr__(self, field, value)

        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            fail("max_new_tokens", "an integer >= 1")
        if not _is_real(self.temperature) or not self.temperature >= 0:  # `not >=` also rejects NaN
            fail("temperature", "a number >= 0 (0 = greedy)")
        if not _is_int(self.top_k) or self.top_k < 0:
            fail("top_k", "an integer >= 0 (0 = off)")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            fail("top_p", "in (0, 1]")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**64):
            fail("seed", "None or an integer in [0, 2**64)")
        if isinstance(self.stop, str):
            set_("stop", (self.stop,))
        if not isinstance(self.stop_token_ids, Sequence) or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "a list of token ids (integers >= 0)")
        if not isinstance(self.stop, Sequence) or not all(isinstance(s, str) and s for s in self.stop):
            fail("stop", "a list of non-empty strings")
        if not isinstance(self.ignore_eos, bool):
            fail("ignore_eos", "true or false")
        set_("max_new_tokens", int(self.max_new_tokens))
        set_("temperature", float(self.temperature))
        set_("top_k", int(self.top_k))
        set_("top_p", float(self.top_p))
        set_("seed", None if self.seed is None else int(self.seed))
        set_("stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        set_("stop", tuple(self.stop))


def make_generator(params: SamplingParams) -> Optional[torch.Generator]:
    """A CPU generator seeded with ``params.seed``; None (torch's global generator) when unseeded."""
    if params.seed is None:
        return None
    return torch.Generator(device="cpu").manual_seed(params.seed)


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[Optional[torch.Generator]]
) -> torch.Tensor:
    """Next tokens ``[B]`` (int64) from ``logits [B, V]`` (any float dtype, computed in fp32), with one
    ``SamplingParams`` and one generator (or None) per row.

    Greedy rows (temperature 0) take the argmax (ties: the lowest index). Other rows scale by
    1 / temperature, keep the ``top_k`` largest logits, then the nucleus (the fewest most likely
    tokens whose probability sums to ``top_p``), and draw one token with the row's generator.
    """
    if logits.dim() != 2 or not len(params) == len(generators) == logits.shape[0]:
        raise ValueError(
            f"sample needs logits [B, V] and B params and generators, got logits {tuple(logits.shape)}, "
            f"{len(params)} params, {len(generators)} generators"
        )
    logits = logits.float()
    if all(p.temperature == 0 for p in params):  # every row greedy: one argmax
        return argmax(logits)  # kernels.sampling: one compiled call on CPU (argmax itself is a scalar loop there)
    tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    greedy_rows = [i for i, p in enumerate(params) if p.temperature == 0]
    if greedy_rows:
        rows = torch.tensor(greedy_rows, device=logits.device)
        tokens[rows] = argmax(logits[rows])
    for i, (p, gen) in enumerate(zip(params, generators)):
        if p.temperature > 0:
            tokens[i] = _draw(logits[i], p, gen)
    return tokens


def _draw(logits: torch.Tensor, p: SamplingParams, gen: Optional[torch.Generator]) -> torch.Tensor:
    """One token (a 0-dim int64 tensor) from one row's fp32 ``logits [V]``."""
    # Subtracting the max first: a tiny temperature then gives -inf for the others, never inf - inf.
    scaled = (logits - logits.max()) / p.temperature
    vocab = scaled.numel()
    if not 0 < p.top_k < vocab and p.top_p == 1:
        return _multinomial(torch.softmax(scaled, -1), gen)
    # A stable sort keeps ties in index order, so top_k=1 picks the same token as argmax.
    values, order = torch.sort(scaled, descending=True, stable=True)
    if 0 < p.top_k < vocab:
        values[p.top_k :] = float("-inf")
    probs = torch.softmax(values, -1)
    if p.top_p < 1:
        mass_before = probs.cumsum(-1) - probs  # 0 for the most likely token, so it is always kept
        probs = probs.masked_fill(mass_before >= p.top_p * (1 - _TOP_P_RTOL), 0.0)
    return order[_multinomial(probs, gen)]


def _multinomial(probs: torch.Tensor, gen: Optional[torch.Generator]) -> torch.Tensor:
    # The generators live on the CPU (make_generator), so the draw does too, whatever the device.
    return torch.multinomial(probs.cpu(), 1, generator=gen)[0].to(probs.device)


class StopChecker:
    """Decides when one request is finished; call ``check`` once per generated token."""

    def __init__(self, params: SamplingParams, eos_token_id: Optional[int]):
        self.params = params
        self.eos_token_id = eos_token_id
        self.num_tokens = 0

    def check(self, token_id: int, text_so_far: str) -> tuple[bool, Optional[str], str]:
        """``(finished, reason, text)`` after ``token_id`` whose decoded output so far is ``text_so_far``.

        ``reason`` is one of ``STOP_REASONS`` or None. ``text`` is ``text_so_far`` cut just before the
        first stop string when one stopped the request, else ``text_so_far`` unchanged.
        """
        self.num_tokens += 1
        p = self.params
        if token_id in p.stop_token_ids:
            return True, "stop_token", text_so_far
        if token_id == self.eos_token_id and not p.ignore_eos:
            return True, "eos", text_so_far
        found = [i for i in (text_so_far.find(s) for s in p.stop) if i >= 0]
        if found:
            return True, "stop_string", text_so_far[: min(found)]
        if self.num_tokens >= p.max_new_tokens:
            return True, "length", text_so_far
        return False, None, text_so_far
