"""DMC training attention (Nawrot et al. 2024, Fig. 3 and App. H) in O(n) memory.

Query i attends to the partially accumulated states k~_j, v~_j (see ``accumulation.py``) with the
additive bias

    bias[i, j] = log(1 - alpha_{j+1})   for j < i    (state j survives iff token j+1 appended)
               = 0                      for j = i    (own current state, always visible)
               = -inf                   for j > i    (future)

so with hard alpha in {0, 1} it is exactly the inference-time visibility of Algorithm 1.

``dmc_attention`` is a flash-style ``torch.autograd.Function``: queries are processed in blocks of
``block`` rows. For each block the diagonal square (the only place needing a 2-D bias) is done
first, so the running max is finite from the first step and no row is ever all ``-inf``; the keys
before the block follow in ranges of ``key_block`` columns with an online softmax and a per-column
bias. Only q, k~, v~, alpha, the output and the row log-sum-exp are saved; backward recomputes the
blocks. Nothing of size n x n is allocated: the largest temporary is
``[b, h_q, block, max(block, key_block)]``.

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

# Backward forms U = exp(s - lse), which is only large where the gate is ~0 (there P = U g ~ 0):
# clamping the exponent keeps such entries finite, so inf * 0 never appears.
_MAX_EXPONENT = 60.0
# Finite stand-in for log(0) = -inf when the bias is folded into a matmul; exp() of it is exactly 0.
_NEG_BIG = -1e30


def dmc_attention(
    q: torch.Tensor,
    k_tilde: torch.Tensor,
    v_tilde: torch.Tensor,
    alpha: torch.Tensor,
    scale: float | None = None,
    block: int = 128,
    key_block: int = 512,
) -> torch.Tensor:
    """DMC training attention with the Fig. 3 bias, without any n x n tensor.

    Args:
        q: queries ``[b, h_q, n, d]`` (h_q = G * h_kv).
        k_tilde: partially accumulated keys ``[b, h_kv, n, d]``.
        v_tilde: partially accumulated values ``[b, h_kv, n, d_v]``.
        alpha: accumulate *probabilities* ``[b, h_kv, n]`` in [0, 1] (not logits); the bias of key
            j is ``log(1 - alpha[..., j + 1])`` (-inf for alpha = 1). ``alpha[..., 0]`` is unused.
        scale: score scale, default ``1 / sqrt(d)``.
        block: query rows per block (also the size of the diagonal square).
        key_block: key columns per online-softmax step over the keys before the block.

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


def _past_ranges(i0: int, key_block: int):
    """Key ranges ``(j0, j1)`` covering [0, i0) (strictly before query block [i0, i1)), in steps of
    ``key_block`` going back from the block."""
    j1 = i0
    while j1 > 0:
        j0 = max(0, j1 - key_block)
        yield j0, j1
        j1 = j0


def _diagonal_range(per_key: torch.Tensor, i0: int, i1: int, j0: int, j1: int, on_diag: float, future: float):
    """``[..., i1-i0, j1-j0]``: ``per_key[..., j]`` below the diagonal, ``on_diag`` on it, ``future``
    above it (rows i in [i0, i1), columns j in [j0, j1); ``per_key [..., n]``)."""
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
    """Blocked attention on 3-D views ``[(b h_kv), rows, d]``; the G query heads of a KV head are
    stacked along rows (``G * block`` rows per block).

    Per query block [i0, i1): the diagonal square [i0, i1) x [i0, i1) carries the only 2-D bias; the
    keys before i0 are visited in ranges of ``key_block`` with a per-column bias, folded into the
    score matmul as an extra channel (``[q, 1] . [k, bias]``).
    """

    @staticmethod
    def forward(ctx, q, k, v, alpha, scale, block, key_block):
        b, hq, n, d = q.shape
        hk, dv = k.shape[1], v.shape[-1]
        G, BH = hq // hk, b * hk
        wd = work_dtype(q)
        qs = (q.to(wd) * scale).view(BH, G, n, d)  # head j -> (j // G, j % G)
        kw, vw = k.to(wd).reshape(BH, n, d), v.to(wd).reshape(BH, n, dv)
        _, bias = _gate_and_bias(alpha.to(wd).reshape(BH, n))
        k_bias = torch.cat([kw, bias.clamp_min(_NEG_BIG).unsqueeze(-1)], dim=-1)
        out = torch.empty(BH, G, n, dv, dtype=wd, device=q.device)
        lse = torch.empty(BH, G, n, dtype=wd, device=q.device)

        for i0 in range(0, n, block):
            i1 = min(i0 + block, n)
            B = i1 - i0
            qb = qs[:, :, i0:i1].reshape(BH, G * B, d)
            # Diagonal square first: every row sees its own state with bias 0, so the running max m
            # is finite from here on and no row is ever all -inf.
            s = (qb @ kw[:, i0:i1].transpose(1, 2)).view(BH, G, B, B)
            s = s.add_(_diagonal_range(bias, i0, i1, i0, i1, 0.0, -math.inf).unsqueeze(1)).view(BH, G * B, B)
            m = s.amax(-1, keepdim=True)
            p = s.sub_(m).exp_()
            l = p.sum(-1, keepdim=True)
            acc = p @ vw[:, i0:i1]
            if i0 > 0:
                q_one = torch.cat([qb, qb.new_ones(BH, G * B, 1)], dim=-1)
                for j0, j1 in _past_ranges(i0, key_block):
                    s = q_one @ k_bias[:, j0:j1].transpose(1, 2)  # scores + log(1 - alpha_{j+1})
                    m_new = torch.maximum(m, s.amax(-1, keepdim=True))
                    corr = (m - m_new).exp_()
                    p = s.sub_(m_new).exp_()
                    l.mul_(corr).add_(p.sum(-1, keepdim=True))
                    acc.mul_(corr).baddbmm_(p, vw[:, j0:j1])
                    m = m_new
            out[:, :, i0:i1] = (acc / l).view(BH, G, B, dv)
            lse[:, :, i0:i1] = (m + l.log()).view(BH, G, B)

        ctx.save_for_backward(q, k, v, alpha, out, lse)
        ctx.scale, ctx.block, ctx.key_block = scale, block, key_block
        return out.view(b, hq, n, dv).to(q.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        """With ``U = exp(s - lse)``, ``P = U g`` and ``W = U (dP - D)``: ``dS = W g``,
        ``dL/dg_j = sum_i W_ij``. Off the diagonal square g depends on the column only, so it is
        applied to k and v (``dq += W (g k)``, ``dk += g (W^T q)``, ``dv += g (U^T dO)``) and no
        P or dS is formed there."""
        q, k, v, alpha, out, lse = ctx.saved_tensors
        scale, block, key_block = ctx.scale, ctx.block, ctx.key_block
        b, hq, n, d = q.shape
        hk, dv = k.shape[1], v.shape[-1]
        G, BH = hq // hk, b * hk
        wd = out.dtype
        dev = q.device
        want_alpha = ctx.needs_input_grad[3]

        qs = (q.to(wd) * scale).view(BH, G, n, d)
        kw, vw = k.to(wd).reshape(BH, n, d), v.to(wd).reshape(BH, n, dv)
        gate, _ = _gate_and_bias(alpha.to(wd).reshape(BH, n))
        do = grad_out.to(wd).reshape(BH, G, n, dv)
        delta = (do * out).sum(-1)  # D_i = <dO_i, O_i>
        ones = kw.new_ones(BH, n, 1)
        k_one = torch.cat([kw, ones], dim=-1)  # [q, -lse] . [k, 1] = s - lse
        v_one = torch.cat([vw, ones], dim=-1)  # [dO, -D] . [v, 1] = dP - D
        gk = gate.unsqueeze(-1) * kw

        dq = torch.empty(BH, G, n, d, dtype=wd, device=dev)
        dk = torch.zeros(BH, n, d, dtype=wd, device=dev)
        dvv = torch.zeros(BH, n, dv, dtype=wd, device=dev)
        dk_past = torch.zeros_like(dk)  # sum_i W_ij q_i over i in later blocks (times g_j at the end)
        dv_past = torch.zeros_like(dvv)  # sum_i U_ij dO_i over i in later blocks (times g_j at the end)
        dgate = torch.zeros(BH, n, dtype=wd, device=dev)

        for i0 in range(0, n, block):
            i1 = min(i0 + block, n)
            B = i1 - i0
            qb = qs[:, :, i0:i1].reshape(BH, G * B, d)
            dob = do[:, :, i0:i1].reshape(BH, G * B, dv)
            q_lse = torch.cat([qb, -lse[:, :, i0:i1].reshape(BH, G * B, 1)], dim=-1)
            do_delta = torch.cat([dob, -delta[:, :, i0:i1].reshape(BH, G * B, 1)], dim=-1)

            # Diagonal square: gate g_j below the diagonal, 1 on it, 0 above.
            g = _diagonal_range(gate, i0, i1, i0, i1, 1.0, 0.0).unsqueeze(1)  # [BH, 1, B, B]
            u = (q_lse @ k_one[:, i0:i1].transpose(1, 2)).clamp_max_(_MAX_EXPONENT).exp_().view(BH, G, B, B)
            p = (u * g).view(BH, G * B, B)
            dvv[:, i0:i1] += p.transpose(1, 2) @ dob
            w = (do_delta @ v_one[:, i0:i1].transpose(1, 2)).view(BH, G, B, B).mul_(u)
            if want_alpha:
                below = torch.ones(B, B, dtype=torch.bool, device=dev).tril_(-1)
                dgate[:, i0:i1] += (w.sum(1) * below).sum(-2)
            ds = w.mul_(g).view(BH, G * B, B)
            dqb = ds @ kw[:, i0:i1]
            dk[:, i0:i1] += ds.transpose(1, 2) @ qb

            # Earlier keys, per-column gates.
            for j0, j1 in _past_ranges(i0, key_block):
                u = (q_lse @ k_one[:, j0:j1].transpose(1, 2)).clamp_max_(_MAX_EXPONENT).exp_()
                dv_past[:, j0:j1].baddbmm_(u.transpose(1, 2), dob)
                w = (do_delta @ v_one[:, j0:j1].transpose(1, 2)).mul_(u)
                if want_alpha:
                    dgate[:, j0:j1] += w.sum(-2)
                dqb.baddbmm_(w, gk[:, j0:j1])
                dk_past[:, j0:j1].baddbmm_(w.transpose(1, 2), qb)
            dq[:, :, i0:i1] = dqb.view(BH, G, B, d)

        dk.addcmul_(gate.unsqueeze(-1), dk_past)
        dvv.addcmul_(gate.unsqueeze(-1), dv_past)
        dq = dq.mul_(scale).view(b, hq, n, d).to(q.dtype)
        dalpha = None
        if want_alpha:
            dalpha = torch.zeros_like(dgate)
            dalpha[:, 1:] = -dgate[:, :-1]  # gate_j = 1 - alpha_{j+1}
            dalpha = dalpha.view(alpha.shape).to(alpha.dtype)
        return dq, dk.view(k.shape).to(k.dtype), dvv.view(v.shape).to(v.dtype), dalpha, None, None, None


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
