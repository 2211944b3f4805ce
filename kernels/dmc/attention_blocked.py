"""Portable DMC training attention: a blocked, flash-style ``torch.autograd.Function``.

Runs on any device with plain tensor ops (the fallback until a Triton / FlexAttention version
exists on CUDA). Queries are processed in blocks of ``block`` rows, on 3-D views
``[(b h_kv), G * block, d]`` that stack the G query heads of a KV head (k~ / v~ are never repeated).
Per block:

- the diagonal square [i0, i1) x [i0, i1) first, the only place needing a 2-D bias (g below the
  diagonal, 0 on it, -inf above); every row has its finite diagonal entry, so the running max is
  finite from the first step and no row is ever all -inf;
- then the keys before i0 in ranges of ``key_block`` columns with an online softmax; their bias is
  per column and is folded into the score matmul as an extra channel: ``[q, 1] . [k, bias] = s + bias``.

Saved for backward: q, k~, v~, alpha, the output and the row log-sum-exp; blocks are recomputed.
The largest temporary is ``[(b h_kv), G * block, max(block, key_block)]``.

Backward, with ``g_j = 1 - alpha_{j+1}`` (per entry on the diagonal square: g below, 1 on, 0 above),
``U = exp(s - lse)``, ``P = U g``, ``D_i = <dO_i, O_i>`` and ``W = U (dP - D)``:

    dS = g W,   dv_j = sum_i P_ij dO_i,   dL/dg_j = sum_{i > j} W_ij   (d alpha_{j+1} = -dL/dg_j)

``dL/dg`` uses U, not P, so it is the exact one-sided derivative also at alpha = 1 (g = 0). Off the
diagonal square g depends on the key only and is applied to k / v / the column sums instead of the
``[rows, keys]`` blocks: ``dq += W (g k)``, ``dk_j += g_j sum_i W_ij q_i``, ``dv_j += g_j sum_i U_ij dO_i``.
U is formed with its exponent clamped at 60: only entries with g ~ 0 (where P = U g ~ 0) can reach
that, and the clamp keeps ``inf * 0`` out.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ._checks import empty_in_layout_of, work_dtype

# Finite stand-in for log(0) = -inf inside matmuls; exp() of it is exactly 0.
NEG_BIG = -1e30
_MAX_EXPONENT = 60.0


def gate_and_bias(alpha: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``alpha [..., n]`` -> per key j: gate ``1 - alpha_{j+1}`` and bias ``log(1 - alpha_{j+1})``.

    The last key has no successor (only its own query sees it, through the diagonal): gate 1, bias 0.
    """
    a_next = alpha[..., 1:]
    gate = F.pad(1.0 - a_next, (0, 1), value=1.0)
    bias = F.pad(torch.log1p(-a_next), (0, 1), value=0.0)  # log1p(-1) = -inf: invisible
    return gate, bias


def diagonal_range(per_key: torch.Tensor, i0: int, i1: int, j0: int, j1: int, on_diag: float, future: float):
    """``[..., i1-i0, j1-j0]``: ``per_key[..., j]`` below the diagonal, ``on_diag`` on it, ``future``
    above it (rows i in [i0, i1), columns j in [j0, j1); ``per_key [..., n]``)."""
    dev = per_key.device
    i = torch.arange(i0, i1, device=dev)[:, None]
    j = torch.arange(j0, j1, device=dev)[None, :]
    fill = torch.where(j == i, on_diag, future).to(per_key.dtype)
    return torch.where(j < i, per_key[..., None, j0:j1], fill)


def _past_ranges(i0: int, key_block: int):
    """Key ranges ``(j0, j1)`` covering [0, i0), in steps of ``key_block`` going back from i0."""
    j1 = i0
    while j1 > 0:
        j0 = max(0, j1 - key_block)
        yield j0, j1
        j1 = j0


def _extend(x: torch.Tensor, *columns) -> torch.Tensor:
    """Append channels to ``x [..., r, c]``; each column is a scalar or a ``[..., r]`` tensor."""
    cols = [c.unsqueeze(-1) if isinstance(c, torch.Tensor) else torch.full_like(x[..., :1], c) for c in columns]
    return torch.cat([x, *cols], dim=-1)


class BlockedDMCAttention(torch.autograd.Function):
    """``apply(q [b, hq, n, d], k [b, hk, n, d], v [b, hk, n, dv], alpha [b, hk, n], scale, block,
    key_block) -> out [b, hq, n, dv]`` (inputs validated by ``dmc_attention``; out's dims lie in
    memory like q's, see ``empty_in_layout_of``)."""

    @staticmethod
    def forward(ctx, q, k, v, alpha, scale, block, key_block):
        b, hq, n, d = q.shape
        hk, dv = k.shape[1], v.shape[-1]
        G, BH = hq // hk, b * hk
        wd = work_dtype(q)
        qs = (q.to(wd) * scale).view(BH, G, n, d)  # head j -> (j // G, j % G)
        kw, vw = k.to(wd).reshape(BH, n, d), v.to(wd).reshape(BH, n, dv)
        _, bias = gate_and_bias(alpha.to(wd).reshape(BH, n))
        k_bias = _extend(kw, bias.clamp_min(NEG_BIG))  # [k, bias]
        out = empty_in_layout_of(q, dv, wd).view(BH, G, n, dv)
        lse = torch.empty(BH, G, n, dtype=wd, device=q.device)

        for i0 in range(0, n, block):
            i1 = min(i0 + block, n)
            B = i1 - i0
            qb = qs[:, :, i0:i1].reshape(BH, G * B, d)
            s = (qb @ kw[:, i0:i1].transpose(1, 2)).view(BH, G, B, B)
            s = s.add_(diagonal_range(bias, i0, i1, i0, i1, 0.0, -math.inf).unsqueeze(1)).view(BH, G * B, B)
            m = s.amax(-1, keepdim=True)
            p = s.sub_(m).exp_()
            l = p.sum(-1, keepdim=True)
            acc = p @ vw[:, i0:i1]
            if i0 > 0:
                q_one = _extend(qb, 1.0)
                for j0, j1 in _past_ranges(i0, key_block):
                    s = q_one @ k_bias[:, j0:j1].transpose(1, 2)  # s + log(1 - alpha_{j+1})
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
        q, k, v, alpha, out, lse = ctx.saved_tensors
        scale, block, key_block = ctx.scale, ctx.block, ctx.key_block
        b, hq, n, d = q.shape
        hk, dv = k.shape[1], v.shape[-1]
        G, BH = hq // hk, b * hk
        wd, dev = out.dtype, q.device
        want_alpha = ctx.needs_input_grad[3]

        qs = (q.to(wd) * scale).view(BH, G, n, d)
        kw, vw = k.to(wd).reshape(BH, n, d), v.to(wd).reshape(BH, n, dv)
        gate, _ = gate_and_bias(alpha.to(wd).reshape(BH, n))
        do = grad_out.to(wd).reshape(BH, G, n, dv)
        delta = (do * out).sum(-1)  # D_i
        k_one = _extend(kw, 1.0)  # [q, -lse] . [k, 1] = s - lse
        v_one = _extend(vw, 1.0)  # [dO, -D] . [v, 1] = dP - D
        gk = gate.unsqueeze(-1) * kw

        dq = torch.empty(BH, G, n, d, dtype=wd, device=dev)
        dk = torch.zeros(BH, n, d, dtype=wd, device=dev)
        dvv = torch.zeros(BH, n, dv, dtype=wd, device=dev)
        dgate = torch.zeros(BH, n, dtype=wd, device=dev)
        dk_past, dv_past = torch.zeros_like(dk), torch.zeros_like(dvv)  # times g_j at the end
        below = torch.ones(block, block, dtype=torch.bool, device=dev).tril_(-1)

        for i0 in range(0, n, block):
            i1 = min(i0 + block, n)
            B = i1 - i0
            qb = qs[:, :, i0:i1].reshape(BH, G * B, d)
            dob = do[:, :, i0:i1].reshape(BH, G * B, dv)
            q_lse = _extend(qb, -lse[:, :, i0:i1].reshape(BH, G * B))
            do_delta = _extend(dob, -delta[:, :, i0:i1].reshape(BH, G * B))

            # Diagonal square: per-entry gates.
            g = diagonal_range(gate, i0, i1, i0, i1, 1.0, 0.0).unsqueeze(1)  # [BH, 1, B, B]
            u = (q_lse @ k_one[:, i0:i1].transpose(1, 2)).clamp_max_(_MAX_EXPONENT).exp_().view(BH, G, B, B)
            p = (u * g).view(BH, G * B, B)
            dvv[:, i0:i1] += p.transpose(1, 2) @ dob
            w = (do_delta @ v_one[:, i0:i1].transpose(1, 2)).view(BH, G, B, B).mul_(u)
            if want_alpha:
                dgate[:, i0:i1] += (w.sum(1) * below[:B, :B]).sum(-2)
            ds = w.mul_(g).view(BH, G * B, B)
            dqb = ds @ kw[:, i0:i1]
            dk[:, i0:i1] += ds.transpose(1, 2) @ qb

            # Earlier keys: gates per column.
            for j0, j1 in _past_ranges(i0, key_block):
                u = (q_lse @ k_one[:, j0:j1].transpose(1, 2)).clamp_max_(_MAX_EXPONENT).exp_()
                dv_past[:, j0:j1] += u.transpose(1, 2) @ dob
                w = (do_delta @ v_one[:, j0:j1].transpose(1, 2)).mul_(u)
                if want_alpha:
                    dgate[:, j0:j1] += w.sum(-2)
                dqb.baddbmm_(w, gk[:, j0:j1])
                dk_past[:, j0:j1] += w.transpose(1, 2) @ qb
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
