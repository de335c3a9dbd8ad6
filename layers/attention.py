"""Causal multi-head (and grouped-query) attention on whichever heads this rank holds.

The same function serves the dense block (all h heads) and a tensor-parallel
rank (its h/p heads): heads never talk to each other, which is why a
head-aligned split needs no communication inside attention.

With `requests` (many requests flattened into one [T, ...] tensor, see
layers/varlen.py) each request attends causally within itself only, and only
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

Two ways to run it, chosen per iteration (`PagedBatch.mode`):
    batched     the default, as a GPU runs it: one scatter writes every new row's K,V; all decodes attend in one
                SDPA call (or, when one long context would pad the others more than 4x, in one ragged pass over
                their keys laid end to end); prompt chunks in at most three SDPA calls for fresh ones (q_start = 0:
                causal, no mask) and three for chunks after a cached prefix, chunks of similar length together
                (serve/inputs.py), each padded to the longest of its call and masked. The number of kernels does
                not grow with the number of requests.
    reference   the readable form it is checked against: one request at a time, its own write and its own SDPA.
Both read the keys by gathering the block table's slots into a contiguous [kv_length] run (SDPA has no block
table input; a GPU kernel such as FlashAttention's paged KV reads the blocks in place). The prompt calls pay for
their fixed shape in padding: a call's mask is [B, max_q, max_kv] booleans and its gathered K,V B·max_kv positions,
so one long context widens every chunk of its call for that iteration (a varlen or paged GPU kernel does not pad).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from einops import rearrange
from torch.nn.utils.rnn import pad_sequence

from layers.varlen import Requests


@dataclass(frozen=True)
class AttentionGroup:
    """Requests that attend in one SDPA call (batched mode): B requests, queries padded to max_q, keys to max_kv.

    rows [B, max_q]      the flat row of each query (padding: row 0, its output dropped)
    slots [B, max_kv]    the pool slot of each key position (padding: slot 0, masked)
    mask [B, 1, max_q, max_kv]   key j visible to query i iff j <= q_start + i and j < kv_length; None for fresh
                         prompt chunks (q_start = 0): SDPA's is_causal is exact on a right-padded causal square
    src, dst [n]         real queries: position in the flattened [B·max_q] output -> flat row
    """

    rows: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor | None
    src: torch.Tensor
    dst: torch.Tensor


@dataclass(frozen=True)
class DecodeGroup:
    """Every decode row of an iteration, attending in one ragged pass (batched mode): no padding at all.

    rows [B]      the flat row of each decode's one query
    slots [N]     the pool slots of every decode's keys [0, kv_length), one request after another (N = Σ kv_length)
    owner [N]     which decode (0 .. B-1) each key belongs to
    """

    rows: torch.Tensor
    slots: torch.Tensor
    owner: torch.Tensor


@dataclass(frozen=True)
class PagedBatch:
    """What attention needs for one serving iteration, built once (serve/inputs.py), shared by every layer.

    positions [T]      each row's position in its request (RoPE, GPT-2's position embedding)
    slot_mapping [T]   where each new row's K,V go in a layer's flat pool view
    groups             batched mode: at most 7 AttentionGroups (decodes; fresh prompt chunks; chunks after a prefix)
    decodes            batched mode: the decodes as one ragged group instead (when padding would dominate)
    spans, q_starts, slots   reference mode: per request, its rows, first position, and slots of [0, kv_length)
    """

    mode: str  # "batched" or "reference"
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    decodes: DecodeGroup | None = None
    groups: tuple[AttentionGroup, ...] = ()
    spans: tuple[tuple[int, int], ...] = ()
    q_starts: tuple[int, ...] = ()
    slots: tuple[torch.Tensor, ...] = ()
    tables: dict = field(default_factory=dict)  # per-iteration memo (RoPE's cos/sin), filled by the first layer


@dataclass(frozen=True)
class PagedLayer:
    """One layer of one iteration: the shared batch and this layer's pool, [2, slots, K,V heads, d_head]."""

    batch: PagedBatch
    pool: torch.Tensor


def prefix_causal_mask(q_start: int, q_rows: int, kv_length: int, device=None) -> torch.Tensor:
    """[q_rows, kv_length] booleans: query i (position q_start + i) sees key j iff j <= q_start + i."""
    keys = torch.arange(kv_length, device=device)
    return keys[None, :] <= (q_start + torch.arange(q_rows, device=device))[:, None]


def positions_of(requests: Requests | PagedLayer | None, n_rows: int, device=None) -> torch.Tensor:
    """[T] the position of every row: 0.. within each request (Requests), q_start.. (PagedLayer), or 0..T-1."""
    if requests is None:
        return torch.arange(n_rows, device=device)
    if isinstance(requests, PagedLayer):
        return requests.batch.positions
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
    group = q.shape[0] // kv.shape[1]
    k, v = (t.repeat_interleave(group, dim=0) if group > 1 else t for t in kv)
    # Each [1, h, T, d_head]: a batch dim of 1, because on CPU PyTorch's SDPA takes its fused kernel
    # only for 4-D inputs (3-D ones fall back to the math path, ~4x slower here).
    q, k, v = q[None], k[None], v[None]
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


def paged_attention(q: torch.Tensor, kv: torch.Tensor, layer: PagedLayer) -> torch.Tensor:
    """Write the new rows' K,V into the pool at their slots, then attend over each request's context (module
    docstring). q [h, T, d_head], kv [2, h_kv, T, d_head]: the pool holds the h_kv K,V heads only."""
    batch, pool = layer.batch, layer.pool  # pool [2, slots, h_kv, d_head]
    if batch.mode == "reference":
        return _reference(q, kv, batch, pool)
    pool.index_copy_(1, batch.slot_mapping, kv.transpose(1, 2))  # one scatter: every new row's K,V into its slot
    h, T, dh = q.shape
    group = h // kv.shape[1]
    out = q.new_empty(T, h, dh)
    if batch.decodes is not None:
        out.index_copy_(0, batch.decodes.rows, _decode(q, pool, batch.decodes))
    for g in batch.groups:  # at most 7 calls: decodes, fresh prompt chunks, chunks after a prefix
        B, max_q = g.rows.shape
        queries = q.index_select(1, g.rows.flatten()).view(h, B, max_q, dh).transpose(0, 1)  # [B, h, max_q, dh]
        context = pool.index_select(1, g.slots.flatten())  # [2, B·max_kv, h_kv, dh]: the keys through the tables
        keys, values = context.view(2, B, -1, *pool.shape[2:]).permute(0, 1, 3, 2, 4)  # each [B, h_kv, max_kv, dh]
        if group > 1:  # query head j reads K,V head j // group
            keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=g.mask, is_causal=g.mask is None)
        out.index_copy_(0, g.dst, o.transpose(1, 2).reshape(B * max_q, h, dh).index_select(0, g.src))  # real rows
    return out.flatten(1)


def _decode(q: torch.Tensor, pool: torch.Tensor, g: DecodeGroup) -> torch.Tensor:
    """Every decode's one query against its own keys, all decodes at once and without padding: the keys of all
    requests in one flat [N] run, a softmax per request (segment max and sum by `owner`), the values summed back per
    request. One long context does not widen the others (a padded SDPA would score every decode to the longest).
    Scores and sums in float32 at least. Returns [B, h, dh]."""
    h, _, dh = q.shape
    h_kv = pool.shape[2]
    B, N, acc = g.rows.numel(), g.owner.numel(), torch.promote_types(q.dtype, torch.float32)
    queries = q.index_select(1, g.rows).transpose(0, 1).to(acc).index_select(0, g.owner)  # [N, h, dh]: each key's query
    keys, values = pool.index_select(1, g.slots)  # each [N, h_kv, dh]: through the block tables
    queries = queries.view(N, h_kv, h // h_kv, dh)  # query head j reads K,V head j // (h/h_kv)
    scores = (queries * keys[:, :, None].to(acc)).sum(-1).view(N, h) * dh ** -0.5  # [N, h]
    owner = g.owner[:, None].expand(N, h)
    top = scores.new_full((B, h), float("-inf")).scatter_reduce_(0, owner, scores, "amax")  # per request, per head
    weights = (scores - top.index_select(0, g.owner)).exp()  # [N, h]
    total = scores.new_zeros(B, h).index_add_(0, g.owner, weights)
    mixed = (weights.view(N, h_kv, -1, 1) * values[:, :, None].to(acc)).view(N, h, dh)
    out = scores.new_zeros(B, h, dh).index_add_(0, g.owner, mixed)
    return (out / total[..., None]).to(q.dtype)


def _reference(q: torch.Tensor, kv: torch.Tensor, batch: PagedBatch, pool: torch.Tensor) -> torch.Tensor:
    """The per-request form the batched path is checked against: write, gather, attend, one request at a time."""
    group = q.shape[0] // kv.shape[1]
    outs = []
    for (s, e), q_start, slots in zip(batch.spans, batch.q_starts, batch.slots):
        q_rows, kv_length = e - s, q_start + e - s
        pool[:, slots[q_start:]] = kv[:, :, s:e].transpose(1, 2)  # [2, q_rows, h_kv, dh] into its new slots
        context = pool[:, slots].transpose(1, 2)  # [2, h_kv, kv_length, dh]: its block table, read in order
        if group > 1:
            context = context.repeat_interleave(group, dim=1)
        keys, values = context[:, None]  # each [1, h, kv_length, d_head]
        if q_rows == 1:  # decode: the one new query sees every key
            mask, causal = None, False
        elif q_start == 0:  # a whole prompt, or its first chunk: the plain causal square
            mask, causal = None, True
        else:  # a chunk after a cached prefix: full on the prefix, causal on the chunk
            mask, causal = prefix_causal_mask(q_start, q_rows, kv_length, q.device), False
        outs.append(F.scaled_dot_product_attention(q[None, :, s:e], keys, values, attn_mask=mask, is_causal=causal))
    return rearrange(torch.cat(outs, dim=2), "1 h n d -> n (h d)")
