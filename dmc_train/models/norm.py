"""RMSNorm usable with sequence parallelism.

megatron's torch-norm wrapper asserts when ``sequence_parallel`` is on; its weight must be marked
``sequence_parallel`` so ``finalize_model_grads`` all-reduces its gradient across tensor ranks
(each rank saw only its slice of the sequence).
"""

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim, in fp32, back in ``x``'s dtype."""
    if x.dtype == weight.dtype == torch.float32:  # the same operations without the casts (each a no-op call)
        if not torch.is_grad_enabled():  # inference: torch's rms_norm, one call for the same operations (on CPU
            return torch.rms_norm(x, x.shape[-1:], weight, eps)  # bit for bit); its backward is not the same
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


class RMSNorm(torch.nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim; input ``[s, b, h]``."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
