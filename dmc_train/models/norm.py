"""RMSNorm usable with sequence parallelism.

megatron's torch-norm wrapper asserts when ``sequence_parallel`` is on; its weight must be marked
``sequence_parallel`` so ``finalize_model_grads`` all-reduces its gradient across tensor ranks
(each rank saw only its slice of the sequence).
"""

import torch

from kernels.layer import rms_norm  # the one RMSNorm function: training's, and the engine's tensor path


class RMSNorm(torch.nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim; input ``[s, b, h]``."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
