"""LESS as an attention variant of the Llama layer spec: per-head kernels (``kernels.py``) and the
attention that distils them layer by layer from the frozen model (``attention.py``).

A method selects it with ``build_model(cfg, attention=less_self_attention_spec(state))``.
"""

from __future__ import annotations

from megatron.core.transformer.spec_utils import ModuleSpec

from dmc_train.models.less.attention import LESSCoreAttention, LESSSelfAttention, LESSState
from dmc_train.models.less.kernels import KernelShape, LESSKernels

__all__ = ["KernelShape", "LESSCoreAttention", "LESSKernels", "LESSSelfAttention", "LESSState",
           "less_self_attention_spec"]


def less_self_attention_spec(state: LESSState) -> ModuleSpec:
    """The ``self_attention`` entry of the layer spec for LESS; every layer shares ``state``."""
    return ModuleSpec(module=LESSSelfAttention, params={"less_state": state})
