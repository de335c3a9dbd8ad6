"""Causal multi-head attention on whichever heads this rank holds.

The same function serves the dense block (all h heads) and a tensor-parallel
rank (its h/p heads): heads never talk to each other, which is why a
head-aligned split needs no communication inside attention.

With `requests` (many requests flattened into one [T, ...] tensor, see
layers/varlen.py) each request attends causally within itself only, and only
its own [Lᵢ × Lᵢ] block of scores is computed: the work is Σ Lᵢ², not (Σ Lᵢ)².
`requests.padded` selects the baseline: pad every request to the longest, mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch.nn.utils.rnn import pad_sequence

from layers.varlen import Requests


def causal_attention(qkv: torch.Tensor, d_head: int, requests: Requests | None = None) -> torch.Tensor:
    """qkv: [T, 3*h*d_head] laid out [Q | K | V], heads contiguous inside each part.

    Returns [T, h*d_head], heads concatenated in the same order.
    """
    # Each [1, h, T, d_head]: a batch dim of 1, because on CPU PyTorch's SDPA takes its fused kernel
    # only for 4-D inputs (3-D ones fall back to the math path, ~4x slower here).
    q, k, v = rearrange(qkv, "n (three h d) -> three 1 h n d", three=3, d=d_head)
    if requests is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    elif requests.padded:
        out = _padded(q[0], k[0], v[0], requests.lengths)[None]
    else:  # varlen: one request at a time, cross-request blocks never computed
        out = torch.cat([F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True)
                         for s, e in requests.spans], dim=2)
    return rearrange(out, "1 h n d -> n (h d)")


def _padded(q, k, v, lengths: list[int]) -> torch.Tensor:
    """The baseline: [R, h, max_len, d] with a causal + key-padding mask, then the padding dropped."""
    def pad(t):  # [h, T, d] -> [R, h, max_len, d]
        return pad_sequence([part.transpose(0, 1) for part in t.split(lengths, dim=1)], batch_first=True).transpose(1, 2)

    longest = max(lengths)
    pos = torch.arange(longest, device=q.device)
    causal = pos[None, :] <= pos[:, None]  # [max_len, max_len]
    real_key = pos[None, :] < torch.tensor(lengths, device=q.device)[:, None]  # [R, max_len]
    mask = causal[None, None] & real_key[:, None, None, :]  # [R, 1, max_len, max_len]
    out = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), attn_mask=mask)
    return torch.cat([out[r, :, :n] for r, n in enumerate(lengths)], dim=1)  # [h, T, d]
