"""DMC training attention (Nawrot et al. 2024, Fig. 3 and App. H) in O(n) memory.

Query i attends to the partially accumulated states k~_j, v~_j (see ``accumulation.py``) with the
additive bias

    bias[i, j] = log(1 - alpha_{j+1})   for j < i    (state j survives iff token j+1 appended)
               = 0                      for j = i    (own current state, always visible)
               = -inf                   for j > i    (future)

so with hard alpha in {0, 1} it is exactly the inference-time visibility of Algorithm 1.

``dmc_attention`` is a flash-style ``torch.autograd.Function``: queries are processed in blocks of
``block`` rows; for each block the visible keys are visited in ranges of ``key_block`` columns with
an online softmax, starting with the range that holds the diagonal (so the running max is finite
from the first step and no row is ever all ``-inf``). Only q, k~, v~, alpha, the output and the row
log-sum-exp are saved; backward recomputes the blocks. Nothing of size n x n is allocated: the
largest temporary is ``[b, h_q, block, key_block]``.

Gradient w.r.t. alpha: with the gate ``g_j = 1 - alpha_{j+1}`` the unnormalised weight of (i, j < i) is
``exp(s_ij) g_j``, smooth in alpha on all of [0, 1]. Backward therefore forms
``U_ij = exp(s_ij - lse_i)`` (so ``P = U g``) and ``dL/dg_j = sum_i U_ij (dP_ij - D_i)``: the exact
(one-sided) derivative even at alpha = 1, where ``d log(1 - alpha)`` would be ``0 * inf``.

GQA: ``h_q = G h_kv``; query head j uses KV head ``j // G``. The G query heads of a group are
stacked along the row axis of one matmul, so k~ / v~ are never repeated.

``dense_dmc_attention`` builds the full ``[b, h_q, n, n]`` bias of Fig. 3 and applies a plain
softmax under autograd: the reference for tests.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ._checks import check_gqa, check_kv, check_per_head, check_positive_int, work_dtype

# exp(s - lse) is only large for entries whose gate is ~0 (there P = U g ~ 0 anyway); clamping the
# exponent keeps them finite so that inf * 0 never appears.
_MAX_EXPONENT = 60.0


def dmc_attention(
    q: torch.Tensor,
    k_tilde: torch.Tensor,
    v_tilde: torch.Tensor,
    alpha: torch.Tensor,
    scale: float | None = None,
    block: int = 128,
    key_block: int = 1024,
) -> torch.Tensor:
    """DMC training attention with the Fig. 3 bias, without any n x n tensor.

    Args:
        q: queries ``[b, h_q, n, d]`` (h_q = G * h_kv).
        k_tilde: partially accumulated keys ``[b, h_kv, n, d]``.
        v_tilde: partially accumulated values ``[b, h_kv, n, d_v]``.
        alpha: accumulate *probabilities* ``[b, h_kv, n]`` in [0, 1] (not logits); the bias of key
            j is ``log(1 - alpha[..., j + 1])`` (-inf for alpha = 1). ``alpha[..., 0]`` is unused.
        scale: score scale, default ``1 / sqrt(d)``.
        block: query rows per block.
        key_block: key columns per online-softmax step (the diagonal step may be longer:
            ``max(key_block, block)``).

    Returns:
        ``out [b, h_q, n, d_v]`` in the dtype of ``q``; computed in float32 (float64 stays float64).
        Differentiable w.r.t. q, k_tilde, v_tilde and alpha.
    """
    check_kv(k_tilde, v_tilde, "k_tilde", "v_tilde")
    check_gqa(q, k_tilde, "k_tilde")
    check_per_head("alpha", alpha, k_tilde, "k_tilde")
    check_positive_int("block", block)
    check_positive_int("key_block", key_block)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    # CUDA: FlexAttention (with backward) or a Triton kernel is dispatched here; CPU uses PyTorch.
    return _DMCAttentionFunction.apply(q, k_tilde, v_tilde, alpha, float(scale), block, key_block)


def _key_ranges(i0: int, i1: int, key_block: int):
    """Key column ranges visible to query rows [i0, i1): first the one holding the diagonal, then
    earlier ranges going back to 0. Yields ``(is_diagonal_range, j0, j1)``."""
    j0 = max(0, i1 - max(key_block, i1 - i0))
    yield True, j0, i1
    while j0 > 0:
        j1, j0 = j0, max(0, j0 - key_block)
        yield False, j0, j1


def _diagonal_range(per_key: torch.Tensor, i0: int, i1: int, j0: int, j1: int, on_diag: float, future: float):
    """``[b, h_kv, i1-i0, j1-j0]`` of ``per_key[..., j]`` below the diagonal, ``on_diag`` on it,
    ``future`` above it (rows i in [i0, i1), columns j in [j0, j1))."""
    dev = per_key.device
    i = torch.arange(i0, i1, device=dev)[:, None]
    j = torch.arange(j0, j1, device=dev)[None, :]
    fill = torch.where(j == i, on_diag, future).to(per_key.dtype)
    return torch.where(j < i, per_key[..., None, j0:j1], fill)


def _gate_and_bias(alpha: torch.Tensor):
    """Per key j: gate ``1 - alpha_{j+1}`` and bias ``log(1 - alpha_{j+1})``; the last key has no
    successor (only its own query sees it, through the diagonal) and gets gate 1, bias 0."""
    a_next = alpha[..., 1:]
    gate = F.pad(1.0 - a_next, (0, 1), value=1.0)
    bias = F.pad(torch.log1p(-a_next), (0, 1), value=0.0)  # log1p(-1) = -inf: invisible
    return gate, bias


class _DMCAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, alpha, scale, block, key_block):
        b, hq, n, d = q.shape
        hk, dv = k.shape[1], v.shape[-1]
        G = hq // hk
        wd = work_dtype(q)
        qs = (q.to(wd) * scale).view(b, hk, G, n, d)  # group-major: head j -> (j // G, j % G)
        kw, vw = k.to(wd), v.to(wd)
        _, bias = _gate_and_bias(alpha.to(wd))
        out = torch.empty(b, hk, G, n, dv, dtype=wd, device=q.device)
        lse = torch.empty(b, hk, G, n, dtype=wd, device=q.device)

        for i0 in range(0, n, block):
            i1 = min(i0 + block, n)
            B = i1 - i0
            qb = qs[:, :, :, i0:i1].reshape(b, hk, G * B, d)
            m = l = acc = None
            for diagonal, j0, j1 in _key_ranges(i0, i1, key_block):
                s = qb @ kw[:, :, j0:j1].transpose(-1, -2)  # [b, hk, G*B, L]
                if diagonal:
                    bias_ij = _diagonal_range(bias, i0, i1, j0, j1, 0.0, -math.inf)
                    s = s.view(b, hk, G, B, j1 - j0).add_(bias_ij.unsqueeze(2)).view(b, hk, G * B, j1 - j0)
                else:
                    s.add_(bias[:, :, None, j0:j1])
                s_max = s.amax(-1, keepdim=True)
                if m is None:  # diagonal range: every row has its finite diagonal entry
                    m = s_max
                    p = s.sub_(m).exp_()
                    l = p.sum(-1, keepdim=True)
                    acc = p @ vw[:, :, j0:j1]
                else:  # m stays finite even if a row of this range is all -inf
                    m_new = torch.maximum(m, s_max)
                    corr = (m - m_new).exp_()
                    p = s.sub_(m_new).exp_()
                    l = l.mul_(corr).add_(p.sum(-1, keepdim=True))
                    acc = acc.mul_(corr).add_(p @ vw[:, :, j0:j1])
                    m = m_new
            out[:, :, :, i0:i1] = (acc / l).view(b, hk, G, B, dv)
            lse[:, :, :, i0:i1] = (m + l.log()).view(b, hk, G, B)

        ctx.save_for_backward(q, k, v, alpha, out, lse)
        ctx.scale, ctx.block, ctx.key_block = scale, block, key_block
        return out.view(b, hq, n, dv).to(q.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, alpha, out, lse = ctx.saved_tensors
        scale, block, key_block = ctx.scale, ctx.block, ctx.key_block
        b, hq, n, d = q.shape
        hk, dv = k.shape[1], v.shape[-1]
        G = hq // hk
        wd = out.dtype
        want_alpha = ctx.needs_input_grad[3]

        qs = (q.to(wd) * scale).view(b, hk, G, n, d)
        kw, vw = k.to(wd), v.to(wd)
        gate, _ = _gate_and_bias(alpha.to(wd))
        do = grad_out.to(wd).reshape(b, hk, G, n, dv)
        delta = (do * out).sum(-1)  # D_i = <dO_i, O_i>, [b, hk, G, n]

        dq = torch.empty(b, hk, G, n, d, dtype=wd, device=q.device)
        dk = torch.zeros(b, hk, n, d, dtype=wd, device=q.device)
        dvv = torch.zeros(b, hk, n, dv, dtype=wd, device=q.device)
        dgate = torch.zeros(b, hk, n, dtype=wd, device=q.device)

        for i0 in range(0, n, block):
            i1 = min(i0 + block, n)
            B = i1 - i0
            qb = qs[:, :, :, i0:i1].reshape(b, hk, G * B, d)
            dob = do[:, :, :, i0:i1].reshape(b, hk, G * B, dv)
            lse_b = lse[:, :, :, i0:i1].reshape(b, hk, G * B, 1)
            delta_b = delta[:, :, :, i0:i1].reshape(b, hk, G * B, 1)
            dqb = torch.zeros(b, hk, G * B, d, dtype=wd, device=q.device)
            for diagonal, j0, j1 in _key_ranges(i0, i1, key_block):
                L = j1 - j0
                kr, vr = kw[:, :, j0:j1], vw[:, :, j0:j1]
                u = (qb @ kr.transpose(-1, -2)).sub_(lse_b).clamp_max_(_MAX_EXPONENT).exp_()  # U = exp(s - lse)
                if diagonal:
                    g = _diagonal_range(gate, i0, i1, j0, j1, 1.0, 0.0).unsqueeze(2)  # [b, hk, 1, B, L]
                    p = (u.view(b, hk, G, B, L) * g).view(b, hk, G * B, L)
                else:
                    g = gate[:, :, None, j0:j1]  # [b, hk, 1, L]
                    p = u * g
                dvv[:, :, j0:j1] += p.transpose(-1, -2) @ dob
                w = (dob @ vr.transpose(-1, -2)).sub_(delta_b).mul_(u)  # U (dP - D)
                if diagonal:
                    w = w.view(b, hk, G, B, L)
                    if want_alpha:
                        below = torch.arange(j0, j1, device=q.device)[None, :] < torch.arange(i0, i1, device=q.device)[:, None]
                        dgate[:, :, j0:j1] += (w.sum(2) * below).sum(-2)
                    ds = w.mul_(g).view(b, hk, G * B, L)  # dS = P (dP - D)
                else:
                    if want_alpha:
                        dgate[:, :, j0:j1] += w.sum(-2)
                    ds = w.mul_(g)
                dqb += ds @ kr
                dk[:, :, j0:j1] += ds.transpose(-1, -2) @ qb
            dq[:, :, :, i0:i1] = dqb.view(b, hk, G, B, d)

        dq = dq.mul_(scale).view(b, hq, n, d).to(q.dtype)
        dalpha = None
        if want_alpha:
            dalpha = torch.zeros_like(dgate)
            dalpha[..., 1:] = -dgate[..., :-1]  # gate_j = 1 - alpha_{j+1}
            dalpha = dalpha.to(alpha.dtype)
        return dq, dk.to(k.dtype), dvv.to(v.dtype), dalpha, None, None, None


# ---------------------------------------------------------------------------------------------
# Dense reference (Fig. 3 literally)
# ---------------------------------------------------------------------------------------------


def dmc_attention_bias(alpha: torch.Tensor) -> torch.Tensor:
    """The Fig. 3 additive bias ``[b, h, n, n]`` for ``alpha [b, h, n]`` (n x n: tests and small n).

    ``log(1 - alpha)`` is computed so that alpha = 1 gives -inf with a zero (not NaN) gradient.
    """
    n = alpha.shape[-1]
    a_next = alpha[..., 1:]
    keep = a_next < 1
    safe = torch.where(keep, a_next, torch.zeros_like(a_next))
    per_key = torch.where(keep, torch.log1p(-safe), torch.full_like(a_next, -math.inf))
    per_key = F.pad(per_key, (0, 1))
    return _diagonal_range(per_key, 0, n, 0, n, 0.0, -math.inf)


def dense_dmc_attention(
    q: torch.Tensor,
    k_tilde: torch.Tensor,
    v_tilde: torch.Tensor,
    alpha: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Reference for :func:`dmc_attention`: full ``[b, h_q, n, n]`` bias + softmax under autograd.

    Same layouts and semantics; k~ / v~ / alpha are repeated over the query heads of each group.
    At alpha = 1 exactly its alpha-gradient is 0 (the flash version returns the one-sided derivative).
    """
    check_kv(k_tilde, v_tilde, "k_tilde", "v_tilde")
    G = check_gqa(q, k_tilde, "k_tilde")
    check_per_head("alpha", alpha, k_tilde, "k_tilde")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    wd = work_dtype(q)
    k = k_tilde.to(wd).repeat_interleave(G, dim=1)
    v = v_tilde.to(wd).repeat_interleave(G, dim=1)
    bias = dmc_attention_bias(alpha.to(wd)).repeat_interleave(G, dim=1)
    scores = (q.to(wd) @ k.transpose(-1, -2)) * scale + bias
    return (torch.softmax(scores, dim=-1) @ v).to(q.dtype)
