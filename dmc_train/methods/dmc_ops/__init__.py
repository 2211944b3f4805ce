"""DMC operations in plain PyTorch with autograd (Dynamic Memory Compression, Nawrot et al. 2024).

Each public op is one function so that a Triton/FlexAttention version can later be dispatched
behind it; each sits beside its naive reference.

Layouts: q ``[b, h_q, n, d]``; k, v, k~, v~ ``[b, h_kv, n, d]``; alpha, omega ``[b, h_kv, n]``
(one decision / importance per KV head and token). GQA: ``h_q = G h_kv``, query head j reads KV
head ``j // G``.

- :func:`partial_accumulation` (Eq. 9, ``exact`` or ``window``) and
  :func:`reference_partial_accumulation` (token loop).
- :func:`dmc_attention` (Fig. 3 bias, O(n) memory, custom autograd; fused CPU kernels or a
  portable blocked version) and :func:`dense_dmc_attention` (full n x n bias).
- :func:`simulate_dmc_inference` / :class:`DMCHeadCache` (Algorithm 1 token by token).
"""

from .accumulation import MODES, partial_accumulation, reference_partial_accumulation
from .attention import IMPLS, dense_dmc_attention, dmc_attention, dmc_attention_bias
from .inference import DMCHeadCache, simulate_dmc_inference

__all__ = [
    "IMPLS",
    "MODES",
    "DMCHeadCache",
    "dense_dmc_attention",
    "dmc_attention",
    "dmc_attention_bias",
    "partial_accumulation",
    "reference_partial_accumulation",
    "simulate_dmc_inference",
]
