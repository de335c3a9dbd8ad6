"""What each rank holds under head-aligned tensor parallelism: the few facts every layer, model and engine reads,
each in one function. Plain Python (no torch), so the scheduler and the block manager can read them too.

    ceil_div(n, b)              blocks of b that hold n (KV blocks for n positions, rows per rank)
    padded(n, p)                n rounded up to a multiple of p: v2sp's rows n', the padded vocabulary V'
    kv_head_range(h_kv, r, p)   the K,V heads rank r holds (grouped-query attention: replicated once p > h_kv)
    kv_heads_per_rank(h_kv, p)  how many: h_kv/p, at least 1
    kv_bytes_per_token(L, heads, d_head, e)   K and V of `heads` heads in every layer, for one token: 2·L·heads·d_head·e
    llama_block(cfg)            whether the formulas take cfg's blocks as Llama's or GPT-2's
"""

from __future__ import annotations

from typing import Protocol


class ModelShape(Protocol):
    """What the analytic models (tp/traffic_model.py, tp/memory_model.py) read of a model's config: the shape every
    family's config has (layers/models/config.py ModelConfig and its kin); the family's own fields are read by name
    where a formula needs them. Declared here so that tp/ never imports layers/."""

    family: str
    d_model: int
    n_heads: int
    n_layers: int
    vocab_size: int


def llama_block(cfg) -> bool:
    """Whether the analytic models count cfg's blocks as Llama's (RMSNorm, grouped-query attention, SwiGLU with gate
    and up one matmul, no biases), which the config says (layers/models/llama.LlamaConfig.llama_block), or as
    GPT-2's."""
    return getattr(cfg, "llama_block", False)


def ceil_div(n: int, b: int) -> int:
    return -(-n // b)


def padded(n: int, p: int) -> int:
    """n rounded up to a multiple of p (GPT-2's vocabulary 50257 -> 50258 at p = 2, 50264 at p = 8)."""
    return p * ceil_div(n, p)


def kv_head_range(n_kv_heads: int, rank: int, p: int) -> range:
    """The K,V heads rank r of p holds under head-aligned TP: h_kv/p of them while p ≤ h_kv; once
    p > h_kv one, the same head on p/h_kv ranks. Multi-head attention is h_kv = h."""
    if p <= n_kv_heads:
        per = n_kv_heads // p
        return range(rank * per, (rank + 1) * per)
    head = rank * n_kv_heads // p
    return range(head, head + 1)


def kv_heads_per_rank(n_kv_heads: int, p: int) -> int:
    return max(n_kv_heads // p, 1)


def kv_bytes_per_token(n_layers: int, heads: int, d_head: int, elem_bytes: int) -> int:
    """K and V of `heads` heads in every layer, for one token (a rank's share: heads = kv_heads_per_rank)."""
    return 2 * n_layers * heads * d_head * elem_bytes


def mla_kv_bytes_per_token(n_layers: int, d_latent: int, d_rope: int, elem_bytes: int) -> int:
    """MLA's cache of one token, every layer: the latent c_KV and the shared rotary key k_R, L·(c + r)·e. The same
    on every TP rank at every p: the latent is every head's, so each rank holds all of it."""
    return n_layers * (d_latent + d_rope) * elem_bytes
