"""Causal multi-head (and grouped-query) attention on whichever heads this rank holds.

The same function serves the dense block (all h heads) and a tensor-parallel
rank (its h/p heads): heads never talk to each other, which is why a
head-aligned split needs no communication inside attention.

With `requests` (many requests flattened into one [T, ...] tensor, see
layers/attention/varlen.py) each request attends causally within itself only, and only
its own [Lᵢ × Lᵢ] block of scores is computed: the work is Σ Lᵢ², not (Σ Lᵢ)².
`requests.padded` selects the baseline: pad every request to the longest, mask.

With `PagedLayer` (serving) each request brings only its new rows, positions
[q_start, q_end); their K,V are written into the paged pool at their slots (the slot mapping) and the
queries attend to the request's keys [0, kv_length = q_end), read through its block table:

                 keys 0 .. q_start-1 (cached prefix)   keys q_start .. q_end-1 (this chunk)
    query i      all visible                            visible iff key <= q_start + i

A fresh prompt (q_start = 0) is the plain causal square; a decode (one row) sees everything.
SDPA's `is_causal` puts the triangle at the top-left when q_rows != kv_length, which is
wrong here, so a chunk after a cached prefix gets an explicit mask.

How the pool is written and read is the iteration's attention backend (layers/attention/backends.py: reference,
batched as a GPU runs it, cpu without padding; `auto` picks per device), chosen once per run and built once per
iteration (serve/model_runner.py prepare_step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch.nn.utils.rnn import pad_sequence

from layers.attention.backends import PagedBatch
from layers.attention.context_parallel import RingPrefill, SplitKVDecode
from layers.attention.eviction import reference_mask
from layers.attention.flash import flash_causal
from layers.attention.kv_quant import QuantizedLayer, reference_round_trip
from layers.attention.varlen import Requests


@dataclass(frozen=True)
class PagedLayer:
    """One layer of one iteration: the shared batch and this layer's pool, [2, slots, K,V heads, d_head]."""

    batch: PagedBatch
    pool: torch.Tensor


def positions_of(requests: Requests | PagedLayer | None, n_rows: int, device=None) -> torch.Tensor:
    """[T] the position of every row: 0.. within each request (Requests), q_start.. (PagedLayer), or 0..T-1."""
    if requests is None:
        return torch.arange(n_rows, device=device)
    if isinstance(requests, PagedLayer):
        return requests.batch.positions
    if isinstance(requests, RingPrefill):
        return requests.local_positions
    if isinstance(requests, SplitKVDecode):
        return torch.tensor(requests.new_positions, device=device)
    return torch.cat([torch.arange(e - s, device=device) for s, e in requests.spans])


def causal_attention(qkv: torch.Tensor, d_head: int, requests: Requests | PagedLayer | None = None) -> torch.Tensor:
    """qkv: [T, 3*h*d_head] laid out [Q | K | V], heads contiguous inside each part.

    Returns [T, h*d_head], heads concatenated in the same order.
    """
    qkv = rearrange(qkv, "n (three h d) -> three h n d", three=3, d=d_head)  # views: K,V stay one tensor
    return attention(qkv[0], qkv[1:], requests)


def attention(q: torch.Tensor, kv: torch.Tensor, requests: Requests | PagedLayer | None = None) -> torch.Tensor:
    """q [h, T, d_head]; kv [2, h_kv, T, d_head], K then V, h a multiple of h_kv: query head j reads K,V head
    j // (h/h_kv) (grouped-query attention; h_kv = h is plain multi-head). Returns [T, h*d_head]."""
    if isinstance(requests, PagedLayer):
        return paged_attention(q, kv, requests)
    if isinstance(requests, (RingPrefill, SplitKVDecode)):  # context parallelism: layers/attention/context_parallel.py
        return requests.attend(q, kv)
    kv = reference_round_trip(kv)  # inside kv_quant.pseudo_quantized: K,V as a quantized cache would give them
    if requests is not None and requests.flash:  # training: FlashAttention-2's tiles, forward and backward
        out = torch.cat([flash_causal(q[:, s:e], kv[0][:, s:e], kv[1][:, s:e], pad=requests.invariant)
                         for s, e in requests.spans], dim=1)
        return rearrange(out, "h n d -> n (h d)")
    group = q.shape[0] // kv.shape[1]
    k, v = (t.repeat_interleave(group, dim=0) if group > 1 else t for t in kv)
    # Each [1, h, T, d_head]: a batch dim of 1, because on CPU PyTorch's SDPA takes its fused kernel
    # only for 4-D inputs (3-D ones fall back to the math path, ~4x slower here).
    q, k, v = q[None], k[None], v[None]
    if requests is None:  # one sequence: causal, or inside eviction.streaming_reference its window's mask
        mask = reference_mask(q.shape[2], q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
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


def paged_attention(q: torch.Tensor, kv: torch.Tensor, layer: PagedLayer) -> torch.Tensor:
    """Write the new rows' K,V into the pool at their slots, then attend over each request's context, as the
    iteration's attention backend does it (layers/attention/backends.py). q [h, T, d_head], kv [2, h_kv, T, d_head]:
    the pool holds the h_kv K,V heads only."""
    if isinstance(layer.pool, QuantizedLayer):  # kv_cache_dtype fp8/int8: the new rows as the cache will give them
        kv = layer.pool.prepare(kv)
    return layer.batch.backend.forward(q, kv, layer.pool, layer.batch)
