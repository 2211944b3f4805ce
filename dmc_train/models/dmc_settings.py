"""The frozen settings of DMC attention (torch-free, outside ``models/dmc/`` so that the method configs
can build them without importing megatron).

One :class:`DMCSettings` is derived from a method config by
:func:`dmc_train.methods.configs.dmc_settings` and read by the training attention
(``models/dmc``), the inference engine and the Hugging Face export alike.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DMCSettings:
    """How a DMC (or Fixed Memory Pooling) model decides and attends, from its method config.

    ``channel``: index of the decision channel within a head (None for fixed pooling, which uses every
    channel); ``pool``: fixed pooling's tokens per slot (None for learned decisions); ``variant``:
    ``dmc`` | ``c`` (DMC-C, Eq. 13) | ``hardc`` (DMC-HardC: one decision and importance per layer).
    ``tau`` and ``attention_impl`` matter to training only.
    """

    channel: int | None
    init_offset: float = 5.0  # c0: alpha logit = k[c] - c0, omega = sigmoid(q[c] + c0)
    omega_eps: float = 1e-6  # added to omega
    decision_threshold: float = 0.0  # hard (evaluation) alpha = [logit > threshold]
    tau: float = 0.1  # Gumbel-sigmoid temperature in training
    accumulation: str = "exact"  # exact | window (the last ``window`` tokens)
    window: int = 12
    attention_impl: str = "auto"  # training's kernel choice (kernels.dmc.dmc_attention)
    variant: str = "dmc"
    pool: int | None = None
    rope_order: str = "post"  # post: rotated keys accumulated; pre: raw keys accumulated, rotated at the newest token

    @property
    def shared(self) -> bool:
        """DMC-HardC: every head of a layer shares one decision and one importance."""
        return self.variant == "hardc"
