"""Column sums of causal prefill attention, blockwise over queries (PyTorch only, any device).

The scores an eviction policy (H2O, TOVA, Keyformer) needs after the prompt: how much attention each
key received from all later queries. Queries are taken ``block`` at a time; a block of queries
``[i0, i1)`` sees only the keys ``[0, i1)``, so its logits are ``[b, H, block, i1]``: never the
``n x n`` matrix. GQA is handled by viewing the H query heads as ``[H_kv, G]`` (no repeat of k).
"""

from __future__ import annotations

from typing import Callable

import torch


def attention_column_sums_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    tau: float,
    noise: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
    block: int,
    v: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`kernels.paged.attention_column_sums` on validated inputs; ``[b, H_kv, n]`` float32 (with ``v``: the
    attention's output first, from the same probabilities)."""
    b, H, n, d = q.shape
    H_kv = k.shape[1]
    G = H // H_kv
    kf = k.float()
    out = torch.zeros(b, H_kv, n, dtype=torch.float32, device=q.device)
    if v is not None:
        vf, attn = v.float(), q.new_empty(b, H, n, v.shape[-1])
    pos = torch.arange(n, device=q.device)
    for i0 in range(0, n, block):
        i1 = min(i0 + block, n)
        m = i1 - i0
        qb = q[:, :, i0:i1].float().reshape(b, H_kv, G * m, d)  # head h = (h // G, h % G)
        logits = (qb @ kf[:, :, :i1].transpose(-1, -2)).view(b, H, m, i1)  # [b, H, m, i1]
        logits.mul_(scale)
        if noise is not None:
            logits.add_(noise(pos[i0:i1], pos[:i1]).to(device=q.device, dtype=torch.float32))
        if tau != 1.0:
            logits.div_(tau)
        logits.masked_fill_(pos[None, :i1] > pos[i0:i1, None], float("-inf"))  # causal: key j <= query i
        probs = torch.softmax(logits, dim=-1).view(b, H_kv, G * m, i1)
        out[:, :, :i1] += probs.sum(2)
        if v is not None:
            attn[:, :, i0:i1] = (probs @ vf[:, :, :i1]).view(b, H, m, -1)
    return out if v is None else (attn, out)
