"""The settings of LESS's kernels (torch-free, outside ``models/less/`` so that the method configs can
build them without importing megatron).

:class:`LESSSettings` owns the kernels' options and their defaults: the method config
(:class:`dmc_train.methods.configs.LESSConfig`) takes its fields' defaults from it, and one
:class:`LESSSettings` derived from a method config by :func:`dmc_train.methods.configs.less_settings`
is read by the training attention (``models/less``: the layers' shared state and each layer's kernels).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LESSSettings:
    """How LESS's per-head kernels are shaped and trained.

    ``hidden``: the kernels' hidden width R'; ``rank``: the state's rank R (``H [rank, d_v]``, ``z [rank]`` per
    row); ``dropout``: after the kernels' first layer, in training; ``init_scale``: where ``D1`` and ``D2`` start
    (the state starts near zero, so the sparse policy alone is the warm start)."""

    hidden: int = 512
    rank: int = 8
    dropout: float = 0.3
    init_scale: float = 1e-4
