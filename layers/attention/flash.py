"""FlashAttention-2's forward and FlashDecoding, as readable PyTorch (docs/flash.md; docs/background.md, seeds/00
articles 12 and 13), and the memory traffic each would have between a GPU's HBM and its on-chip memory.

    flash_attention   for each block of B_r queries (FlashAttention-2's outer loop), read Q_i once; for each block of
                      B_c keys some query of the block may see (causal: blocks wholly after its last query are
                      skipped), read K_j, V_j, and
                          S = Q_i·K_jᵀ·scale (masked)      m' = max(m, rowmax S)      P = exp(S − m')
                          c = exp(m − m')                   ℓ = c·ℓ + rowsum P         O = c·O + P·V_j     m = m'
                      then write O_i / ℓ and lse_i = m + log ℓ. The [N × N] scores never exist: one [B_r × B_c] tile
                      at a time, m, ℓ and O kept per row (float32 at least).
    flash_decoding    one query row: the keys split into chunks of a fixed size, each chunk's (o, lse) from one tile,
                      combined by the one log-sum-exp merge (layers/attention/merge.py, which context parallelism
                      uses too). A fixed chunk size, not a fixed number of chunks: a row's reduction order does not
                      depend on how many keys other requests have.

Traffic (counted as the loops run, in elements, per query head; `Traffic`): Q read once, O and lse written once, each
visited key block's K and V read once per query block. `flash_traffic` writes the same count in closed form for this
tiling, `standard_traffic` the materializing algorithm's (Dao et al. 2022, Algorithm 0: S and P written to and read
back from HBM), and `sram_blocks` the paper's block sizes for an on-chip memory of M elements: B_c = ⌈M/4d⌉,
B_r = min(B_c, d). With those, the K,V reads are 2·N·d·⌈N/B_r⌉ ≈ 8·N²·d²/M when B_r = M/4d: Θ(N²d²/M) against the
standard Θ(N·d + N²).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from layers.attention.merge import merge

BLOCK_Q = 64  # the backend's tiles: queries per block (B_r)
BLOCK_K = 64  # keys per block (B_c)
DECODE_SPLIT = 256  # FlashDecoding: keys per chunk, fixed


@dataclass
class Traffic:
    """Elements moved between HBM and on-chip memory, per query head (reads, writes)."""

    reads: int = 0
    writes: int = 0

    @property
    def total(self) -> int:
        return self.reads + self.writes


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor | None = None,
                    k_pos: torch.Tensor | None = None, mask: torch.Tensor | None = None, block_q: int = BLOCK_Q,
                    block_k: int = BLOCK_K, scale: float | None = None, traffic: Traffic | None = None,
                    pad: bool = False, out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [h, Tq, d]; k, v [h_kv, Tk, d] (query head j reads K,V head j // (h/h_kv)). Which keys a query sees: key
    position <= query position where q_pos [Tq] and k_pos [Tk] are given (causal), and `mask` [Tq, Tk] where given;
    neither: every key. Returns (o [h, Tq, d_v] in q's dtype, lse [h, Tq] in float32 at least; −∞ and a zero row for
    a query that sees no key). traffic: counted per query head as the tiles are read and written. pad (the
    batch-invariant mode): every tile exactly block_q × block_k, the short ones padded (padding keys masked, padding
    queries dropped), so a row's products never change shape with the rows and keys around it: its result is the
    same bits whatever the chunk and the batch (key tiles past a row's last key add exact zeros)."""
    h, n_q, d = q.shape
    n_k, d_v = k.shape[1], v.shape[2]
    acc_t = torch.promote_types(q.dtype, torch.float32)
    scale = d ** -0.5 if scale is None else scale
    group = h // k.shape[0]
    if group > 1:  # each query head reads its K,V head's tiles
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    outs, lses = [], []
    for a in range(0, n_q, block_q):
        b = min(a + block_q, n_q)
        rows = block_q if pad else b - a
        qi = _rows(q[:, a:b].to(acc_t), rows)  # read Q_i
        m = torch.full((h, rows), -math.inf, dtype=acc_t, device=q.device)
        ell = torch.zeros((h, rows), dtype=acc_t, device=q.device)
        o = torch.zeros((h, rows, d_v), dtype=acc_t, device=q.device)
        if traffic is not None:
            traffic.reads += (b - a) * d
        last = n_k if q_pos is None else int((k_pos <= q_pos[b - 1]).sum())  # keys sorted: the block's last query's
        for c in range(0, last, block_k):
            e = min(c + block_k, n_k)
            cols = block_k if pad else e - c
            kj, vj = _rows(k[:, c:e].to(acc_t), cols), _rows(v[:, c:e].to(acc_t), cols)  # read K_j, V_j
            if traffic is not None:
                traffic.reads += (e - c) * (d + d_v)
            s = torch.einsum("hqd,hkd->hqk", qi, kj) * scale
            seen = None if q_pos is None else k_pos[c:e][None, :] <= q_pos[a:b][:, None]
            if mask is not None:
                seen = mask[a:b, c:e] if seen is None else seen & mask[a:b, c:e]
            if pad:  # padding queries see what the block's last query sees; padding keys nobody sees
                seen = torch.ones(b - a, e - c, dtype=torch.bool, device=q.device) if seen is None else seen
                seen = torch.cat([seen, seen[-1:].expand(rows - (b - a), -1)])
                seen = torch.cat([seen, seen.new_zeros(rows, cols - (e - c))], dim=1)
            if seen is not None:
                s = s.masked_fill(~seen, -math.inf)
            m_new = torch.maximum(m, s.amax(-1))
            base = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))  # a row with nothing seen yet
            p = torch.exp(s - base[..., None])
            rescale = torch.exp(m - base)  # the one rescale per tile
            ell = rescale * ell + p.sum(-1)
            o = rescale[..., None] * o + torch.einsum("hqk,hkd->hqd", p, vj)
            m = m_new
        o, m, ell = o[:, :b - a], m[:, :b - a], ell[:, :b - a]
        seen_any = ell > 0
        outs.append((o / torch.where(seen_any, ell, torch.ones_like(ell))[..., None]).to(out_dtype or q.dtype))
        lses.append(torch.where(seen_any, m + torch.log(ell), torch.full_like(m, -math.inf)))
        if traffic is not None:
            traffic.writes += (b - a) * (d_v + 1)  # write O_i and lse_i
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """t [h, r, d] with zero rows appended up to n."""
    return t if t.shape[1] == n else torch.cat([t, t.new_zeros(t.shape[0], n - t.shape[1], t.shape[2])], dim=1)


def flash_decoding(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split: int = DECODE_SPLIT,
                   scale: float | None = None, traffic: Traffic | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [h, 1, d] against every key of k, v [h_kv, Tk, d]: the keys in chunks of `split` (on a GPU, in parallel),
    each chunk's (o, lse) as one tile, then the log-sum-exp merge. Returns (o [h, 1, d_v], lse [h, 1])."""
    acc = torch.promote_types(q.dtype, torch.float32)  # the partials and their merge in float32 at least
    parts = [flash_attention(q, k[:, c:c + split], v[:, c:c + split], block_q=1, block_k=split, scale=scale,
                             traffic=traffic, out_dtype=acc) for c in range(0, k.shape[1], split)]
    if traffic is not None:  # the partial results go through HBM once more: written above, read by the merge
        traffic.reads += len(parts) * (v.shape[2] + 1)
    o, lse = merge([o for o, _ in parts], [lse for _, lse in parts])
    return o.to(q.dtype), lse


# ---- the traffic in closed form -----------------------------------------------------------------------------------


def flash_traffic(n_q: int, n_k: int, d: int, block_q: int, block_k: int, causal: bool = False, q_start: int = 0,
                  d_v: int | None = None) -> int:
    """Elements flash_attention moves per query head, written out for its tiling: Q read and O, lse written once
    (n_q·(d + d_v + 1)); per query block [a, b), the keys it visits read as K and V: all n_k, or, causal (query
    positions q_start + i, keys 0..n_k − 1), the key blocks up to the one holding position q_start + b − 1."""
    d_v = d if d_v is None else d_v
    keys = 0
    for a in range(0, n_q, block_q):
        b = min(a + block_q, n_q)
        seen = n_k if not causal else min(n_k, q_start + b)
        keys += min(n_k, -(-seen // block_k) * block_k)
    return n_q * (d + d_v + 1) + keys * (d + d_v)


def standard_traffic(n_q: int, n_k: int, d: int) -> int:
    """Algorithm 0 of Dao et al. (2022) per head: read Q, K (n_q·d + n_k·d), write S (n_q·n_k); read S, write P
    (2·n_q·n_k); read P, V (n_q·n_k + n_k·d), write O (n_q·d). For n_q = n_k = N: 4·N·d + 4·N²."""
    return 2 * n_q * d + 2 * n_k * d + 4 * n_q * n_k


def sram_blocks(m: int, d: int) -> tuple[int, int]:
    """The paper's blocks for an on-chip memory of m elements: (B_r, B_c) = (min(⌈m/4d⌉, d), ⌈m/4d⌉)."""
    b_c = -(-m // (4 * d))
    return min(b_c, d), b_c


# ---- FlashAttention-2's backward ----------------------------------------------------------------------------------


class FlashAttentionFunction(torch.autograd.Function):
    """Causal attention of one sequence, q [h, T, d], k, v [h_kv, T, d], with FlashAttention-2's backward: nothing of
    the forward's [T × T] is kept, only O and lse; the backward recomputes each tile's probabilities from them.

        D = rowsum(dO ∘ O)                                             per query row
        for each block of keys (outer), each block of queries (inner):
            P = exp(Q_i·K_jᵀ·scale − lse_i) (0 where masked)
            dV_j += Pᵀ·dO_i      dP = dO_i·V_jᵀ      dS = P ∘ (dP − D_i)
            dQ_i += dS·K_j·scale      dK_j += dSᵀ·Q_i·scale

    Grouped-query heads: each K,V head's gradient sums its query heads'."""

    @staticmethod
    def forward(ctx, q, k, v, block_q: int, block_k: int, pad: bool):
        positions = torch.arange(q.shape[1], device=q.device)
        with torch.autocast(q.device.type, enabled=False):  # the tiles in float32 at least, as the backward recomputes
            o, lse = flash_attention(q, k, v, positions, positions, block_q=block_q, block_k=block_k, pad=pad)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.blocks = (block_q, block_k)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        block_q, block_k = ctx.blocks
        h, n, d = q.shape
        group = h // k.shape[0]
        acc = torch.promote_types(q.dtype, torch.float32)
        scale = d ** -0.5
        kk = (k.repeat_interleave(group, dim=0) if group > 1 else k).to(acc)
        vv = (v.repeat_interleave(group, dim=0) if group > 1 else v).to(acc)
        qq, do_, lse = q.to(acc), do.to(acc), lse.to(acc)
        dq, dk, dv = torch.zeros_like(qq), torch.zeros_like(kk), torch.zeros_like(vv)
        big_d = (do_ * o.to(acc)).sum(-1)  # [h, T]
        pos = torch.arange(n, device=q.device)
        for c in range(0, n, block_k):
            e = min(c + block_k, n)
            kj, vj = kk[:, c:e], vv[:, c:e]
            for a in range(c - c % block_q, n, block_q):  # query blocks that can see these keys (causal)
                b = min(a + block_q, n)
                s = torch.einsum("hqd,hkd->hqk", qq[:, a:b], kj) * scale
                seen = pos[c:e][None, :] <= pos[a:b][:, None]
                p = torch.exp(s - lse[:, a:b, None]).masked_fill(~seen, 0.0)
                dv[:, c:e] += torch.einsum("hqk,hqd->hkd", p, do_[:, a:b])
                dp = torch.einsum("hqd,hkd->hqk", do_[:, a:b], vj)
                ds = p * (dp - big_d[:, a:b, None])
                dq[:, a:b] += torch.einsum("hqk,hkd->hqd", ds, kj) * scale
                dk[:, c:e] += torch.einsum("hqk,hqd->hkd", ds, qq[:, a:b]) * scale
        if group > 1:
            dk, dv = (t.view(k.shape[0], group, n, -1).sum(1) for t in (dk, dv))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def flash_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_q: int = BLOCK_Q,
                 block_k: int = BLOCK_K, pad: bool = False) -> torch.Tensor:
    """Causal attention of one sequence through FlashAttentionFunction (differentiable): [h, T, d_v]. pad: the
    forward's tiles padded as the serving engine's batch-invariant mode pads them (flash_attention's `pad`), so a
    row's output is the engine's bits (the backward is the same either way)."""
    return FlashAttentionFunction.apply(q, k, v, block_q, block_k, pad)
