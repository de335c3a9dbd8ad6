"""Load dense, then shard: cut a dense model's weights into this rank's pieces.

The model code does not know it is parallel; these functions decide which
slice each rank holds. Both sides of the equivalence check therefore use the
same numbers.
"""

from __future__ import annotations

import torch
from einops import rearrange


def column_shard(weight: torch.Tensor, bias: torch.Tensor | None, rank: int, p: int):
    """nn.Linear weight [out, in]: rank r keeps output rows [r*out/p, (r+1)*out/p) and their bias."""
    w = weight.chunk(p, dim=0)[rank]
    b = None if bias is None else bias.chunk(p, dim=0)[rank]
    return w, b


def row_shard(weight: torch.Tensor, bias: torch.Tensor | None, rank: int, p: int):
    """nn.Linear weight [out, in]: rank r keeps input columns [r*in/p, (r+1)*in/p); the bias stays whole."""
    return weight.chunk(p, dim=1)[rank], bias


def qkv_head_aligned_shard(weight: torch.Tensor, bias: torch.Tensor | None, n_heads: int, rank: int, p: int):
    """Fused GPT-2 QKV [3k, d], rows [Q | K | V] -> rank r's heads of Q, of K and of V, re-fused.

        dense rows:  Q: h0 h1 .. h7 | K: h0 h1 .. h7 | V: h0 h1 .. h7
        rank 0 of 2: Q: h0 .. h3    | K: h0 .. h3    | V: h0 .. h3      -> [3k/p, d]
        rank 1 of 2: Q: h4 .. h7    | K: h4 .. h7    | V: h4 .. h7

    This is NOT the contiguous slice weight[r*3k/p : (r+1)*3k/p], which for p=2
    would hand rank 0 all of Q and half of K.
    """
    if n_heads % p:
        raise ValueError(f"n_heads={n_heads} is not divisible by {p} ranks")
    hp = n_heads // p

    def take(t: torch.Tensor) -> torch.Tensor:
        parts = rearrange(t, "(three h dh) ... -> three h dh ...", three=3, h=n_heads)
        mine = parts[:, rank * hp:(rank + 1) * hp]
        return rearrange(mine, "three h dh ... -> (three h dh) ...").contiguous()

    return take(weight), None if bias is None else take(bias)


def qkv_intra_head_shard(weight: torch.Tensor, bias: torch.Tensor | None, n_heads: int, rank: int, p: int):
    """The counterfactual cut INSIDE heads: rank r keeps dims [r*dh/p, (r+1)*dh/p) of every head of Q, K, V.

    Each rank then holds a partial Q·Kᵀ for every head, which must be all-reduced before softmax.
    """
    def take(t: torch.Tensor) -> torch.Tensor:
        parts = rearrange(t, "(three h dh) ... -> three h dh ...", three=3, h=n_heads)
        dhp = per_rank(parts.shape[2], p, "d_head")
        return rearrange(parts[:, :, rank * dhp:(rank + 1) * dhp], "three h dh ... -> (three h dh) ...").contiguous()

    return take(weight), None if bias is None else take(bias)


def out_proj_intra_head_shard(weight: torch.Tensor, bias: torch.Tensor | None, n_heads: int, rank: int, p: int):
    """Row shard of the output projection [d, k] matching qkv_intra_head_shard: dims r of every head."""
    cols = rearrange(weight, "o (h dh) -> o h dh", h=n_heads)
    dhp = per_rank(cols.shape[2], p, "d_head")
    return rearrange(cols[:, :, rank * dhp:(rank + 1) * dhp], "o h dh -> o (h dh)").contiguous(), bias


def per_rank(features: int, p: int, what: str) -> int:
    """features / p, or a ValueError naming the numbers."""
    if features % p:
        raise ValueError(f"{what}={features} is not divisible by {p} ranks")
    return features // p


def heads_of_rank(n_heads: int, rank: int, p: int) -> range:
    hp = n_heads // p
    return range(rank * hp, (rank + 1) * hp)


@torch.no_grad()
def load_(module: torch.nn.Module, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Copy a shard into a (parallel) linear, checking the shapes agree."""
    if module.weight.shape != weight.shape:
        raise ValueError(f"shard shape {tuple(weight.shape)} does not fit weight {tuple(module.weight.shape)}")
    module.weight.copy_(weight)
    if bias is not None:
        module.bias.copy_(bias)
