"""Causal multi-head attention on whichever heads this rank holds.

The same function serves the dense block (all h heads) and a tensor-parallel
rank (its h/p heads): heads never talk to each other, which is why a
head-aligned split needs no communication inside attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange


def causal_attention(qkv: torch.Tensor, d_head: int) -> torch.Tensor:
    """qkv: [n, 3*h*d_head] laid out [Q | K | V], heads contiguous inside each part.

    Returns [n, h*d_head], heads concatenated in the same order.
    """
    q, k, v = rearrange(qkv, "n (three h d) -> three h n d", three=3, d=d_head)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [h, n, d_head]
    return rearrange(out, "h n d -> n (h d)")
