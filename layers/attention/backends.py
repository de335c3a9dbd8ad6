"""Attention over the paged KV cache, one backend per platform (vLLM's attention backends, in one small module).

A backend does two things, on the two sides of the iteration's one host-to-device copy:

    finish = backend.build(chunks, spans, block_size, slots, put)   host, once per iteration: the integer tensors its
                                                              forward reads (block tables, slots, groups), appended
                                                              with put() to the iteration's one copy
    meta = finish(parts)                                      device: those tensors, masks built from them
    out = backend.forward(q, kv, pool, batch)                 every layer: write the new rows' K,V at their slots
                                                              (batch.slot_mapping), attend, return [T, h·d_head]

`chunks` are the iteration's requests in row order, each with q_start, q_rows, kv_length, decode and blocks (its
block table; serve/plan.py's ScheduledRequest); `spans` their rows in the flat batch; `slots(chunk, start, end)` the pool slots
of positions [start, end) of its request (serve/block_manager.py's slot mapping). The backends:

    reference   the readable one the others are checked against: one request at a time, its own write, its
                keys read through its block table, one SDPA call.
    batched     as a GPU runs it: one scatter writes every new row's K,V; all decodes attend in one SDPA call
                (or, when one long context would pad the others more than RAGGED_BELOW times, in one ragged pass
                over their keys laid end to end); prompt chunks in at most PROMPT_GROUPS SDPA calls for fresh ones
                (q_start = 0: causal, no mask) and as many for chunks after a cached prefix, chunks of similar
                length together, each call padded to its longest and masked. The number of kernels does not
                grow with the number of requests (the aten-op count is tested constant).
    cpu         as a CPU wants it, where a launch costs microseconds and padded FLOPs are paid in full: one
                scatter writes the new rows, then one SDPA call per request on its own lengths, nothing padded.
                A fresh prompt chunk attends to its own rows' K,V as computed (no read of the pool at all); a
                decode or a chunk after a prefix reads its whole blocks through its block table (one
                index_select of whole blocks, then the first kv_length positions), grouped-query heads shared in
                the kernel (enable_gqa), not copied. A decode goes further: the query heads of one K,V head become
                that head's query rows, one matmul per K,V head (MLA's 16 heads on one 576-wide latent, 4096 keys:
                149 ms through enable_gqa, 3.5 ms folded, on this CPU; the batched backend folds its decodes too).
    flash       the reference's reads and writes, attended as FlashAttention-2 and FlashDecoding do it
                (layers/attention/flash.py): tiles with the online softmax, a decode's keys in fixed-size chunks
                merged by their log-sum-exps. A readable form of GPU kernels, exact; slower than `cpu` on a CPU.

`auto` (the default setting) is `cpu` on a CPU device and `batched` on CUDA. The choice on a CPU was measured
(benchmarks/bench_paged.py's `backends` part, docs/benchmarks.md): a decode iteration with the batched backend
takes up to 2× the cpu one's (64 requests), 1.47× at 32 requests of 512 positions, and about the same for 1 to 8
requests; the batched backend's ragged pass (a segment softmax over all keys at once) makes several passes over
[keys, heads, d_head] temporaries, which a per-request SDPA call does not.

Every backend touches the pool through store (a scatter of the new rows), load (a gather of
slots) and load_blocks (whole blocks): a plain tensor, or a quantized cache (kv_cache_dtype fp8/int8: codes and
per-head scales, quantized on write and dequantized on read: layers/attention/kv_quant.py), the same code either way.

The cpu backend reads whole blocks through a [2, blocks, block_size, h_kv, d_head] view of the pool: it relies on
slot = block · block_size + offset, the layout serve/block_manager.slot_mapping and serve/kv_cache.KVPool define. A GPU library backend over paged KV (FlashAttention's block_table, FlashInfer) is not here:
FlashAttention 2's paged KV wants blocks of a multiple of 256 positions, and neither library installs without CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol, Sequence

import torch
import torch.nn.functional as F
from einops import rearrange

from layers.attention.eviction import visible
from layers.attention.flash import BLOCK_K, BLOCK_Q, DECODE_SPLIT, flash_attention, flash_decoding
from layers.attention.kv_quant import QuantizedLayer

RAGGED_BELOW = 4  # batched: decodes attend in one ragged pass when padding them to the longest would score > 4x
PROMPT_GROUPS = 3  # batched: most SDPA calls per layer for fresh prompt chunks, and as many for chunks after a prefix
CALL_COST = 64 * 64  # batched: a call's fixed cost, in padded score entries: no group is split off for less
PAST = 1 << 40  # batched under KV eviction: a padding key's position, past every query's


# ---- the pool's reads and writes: one scatter or gather per layer, quantized where the layer is (kv_quant.py)


def store(pool, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """rows [planes, n, h_kv, d] into the pool's `slots` (one scatter)."""
    if isinstance(pool, QuantizedLayer):
        pool.store(slots, rows)
    else:
        pool.index_copy_(1, slots, rows)


def load(pool, slots: torch.Tensor) -> torch.Tensor:
    """[planes, n, h_kv, d] at the pool's `slots` (one gather), in the model's dtype."""
    return pool.load(slots) if isinstance(pool, QuantizedLayer) else pool.index_select(1, slots)


def load_blocks(pool, block_size: int, blocks: torch.Tensor) -> torch.Tensor:
    """[planes, len(blocks) · block_size, h_kv, d]: whole blocks of the pool, in order."""
    if isinstance(pool, QuantizedLayer):
        return pool.blocks(block_size, blocks)
    planes, _, h_kv, d = pool.shape
    return pool.view(planes, -1, block_size, h_kv, d).index_select(1, blocks).flatten(1, 2)


class ChunkLike(Protocol):
    q_start: int
    decode: bool
    blocks: Sequence[int]
    window: tuple[int, int] | None

    @property
    def q_rows(self) -> int: ...

    @property
    def kv_length(self) -> int: ...


Put = Callable[[list[int]], None]  # appends one integer list to the iteration's host-to-device copy
Slots = Callable[[ChunkLike, int, int], list[int]]  # the pool slots of positions [start, end) of a chunk's request


@dataclass(frozen=True)
class PagedBatch:
    """What attention needs for one serving iteration, built once (serve/model_runner.py prepare_step), shared by every layer.

    positions [T]      each row's position in its request (RoPE, GPT-2's position embedding)
    slot_mapping [T]   where each new row's K,V go in a layer's flat pool view
    backend, meta      the attention backend and what its build() made for this iteration
    """

    backend: "AttentionBackend"
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    meta: object = None
    tables: dict = field(default_factory=dict)  # per-iteration memo (RoPE's cos/sin), filled by the first layer
    fresh: tuple[tuple[int, int], ...] = ()  # rows [s, e) of each prompt chunk that starts at position 0
    # kv_eviction h2o: each logical block's attention this iteration, summed over queries, heads and layers, plan
    # order (len(c.blocks) per chunk), one last slot where padding keys add; None: not asked (score_slots)
    scores: torch.Tensor | None = None


def prefix_causal_mask(q_start: int, q_rows: int, kv_length: int, device=None) -> torch.Tensor:
    """[q_rows, kv_length] booleans: query i (position q_start + i) sees key j iff j <= q_start + i."""
    keys = torch.arange(kv_length, device=device)
    return keys[None, :] <= (q_start + torch.arange(q_rows, device=device))[:, None]


def keys_of(c: ChunkLike, block_size: int) -> list[int] | None:
    """Under KV eviction (c.window: serve/eviction.py), the positions of the keys some query of chunk c reads, in
    order: j < kv_length with j < sink or j > q_start - window (the chunk's first query's window reaches furthest
    back), in a block still held (an evicted entry is negative). None without eviction: every position
    [0, kv_length)."""
    if c.window is None:
        return None
    sink, window = c.window
    oldest = max(sink, c.q_start - window + 1)  # positions in [sink, oldest) no query of the chunk reads
    keys = []
    for b in range(-(-c.kv_length // block_size)):  # block by block: a freed one is skipped whole
        if c.blocks[b] >= 0:
            start, end = b * block_size, min((b + 1) * block_size, c.kv_length)
            keys += range(start, min(end, sink)) if end <= oldest else range(start, end) if start >= oldest else \
                [j for j in range(start, end) if j < sink or j >= oldest]
    return keys


def score_slots(chunks: Sequence[ChunkLike]) -> list[int] | None:
    """kv_eviction h2o: where each chunk's logical blocks start in PagedBatch.scores (plan order, len(c.blocks)
    each), the last entry the padding slot; None when no chunk is scored."""
    if not any(getattr(c, "scored", False) for c in chunks):
        return None
    starts = [0]
    for c in chunks:
        starts.append(starts[-1] + len(c.blocks))
    return starts


def add_scores(scores: torch.Tensor, index: torch.Tensor, q: torch.Tensor, keys: torch.Tensor,
               mask: torch.Tensor | None, causal: bool, scale: float | None, valid: torch.Tensor | None = None) -> None:
    """H2O's statistic: each key's attention probability, summed over heads and queries, added into `scores` at
    `index` (the key's logical block). q [B, h, n_q, d], keys [B, h_kv, n_k, d]; mask [B or 1, 1, n_q, n_k] or None;
    causal: the top-left causal square (a fresh prompt chunk); valid [B, n_q]: real query rows. Softmax in float32 at
    least, as attention computes it; index [B, n_k]."""
    acc = torch.promote_types(q.dtype, torch.float32)
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1) if group > 1 else keys
    logits = (q.to(acc) @ k.to(acc).transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if causal:
        n_q, n_k = logits.shape[-2:]
        mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    p = logits.softmax(-1)
    if valid is not None:
        p = p * valid[:, None, :, None]
    scores.index_add_(0, index.flatten(), p.sum(dim=(1, 2)).flatten().to(scores.dtype))


def key_blocks(positions: list[int], start: int, block_size: int) -> list[int]:
    """Each key's slot in PagedBatch.scores: its request's start there and its logical block."""
    return [start + j // block_size for j in positions]


class AttentionBackend:
    name = ""

    def build(self, chunks: Sequence[ChunkLike], spans: Sequence[tuple[int, int]], block_size: int, slots: Slots,
              put: Put) -> Callable[[Iterator[torch.Tensor]], object]:
        raise NotImplementedError

    def forward(self, q: torch.Tensor, kv: torch.Tensor, pool: torch.Tensor, batch: PagedBatch, *,
                scale: float | None = None, v_dim: int | None = None, skip_fresh: bool = False) -> torch.Tensor:
        """q [h, T, d_head]; kv [2, h_kv, T, d_head] (this layer's new K,V); pool [2, slots, h_kv, d_head]. Returns
        [T, h·d_head]; query head j reads K,V head j // (h/h_kv); scores scaled by `scale` (default d_head^-1/2).
        A one-plane pool [1, slots, h_kv, width] (MLA's latent, layers/models/mla.py) holds keys whose first v_dim
        values are also the values: kv [1, h_kv, T, width], and the output is [T, h·v_dim]. skip_fresh: prompt chunks
        from position 0 (batch.fresh) are written but not attended (their rows are zeros; the caller attends them its
        own way: MLA's decompressed prefill)."""
        raise NotImplementedError


def split_kv(t: torch.Tensor, v_dim: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) of a [planes, ...] K,V tensor: its two planes, or (one plane, its first v_dim values)."""
    return (t[0], t[1]) if t.shape[0] == 2 else (t[0], t[0][..., :v_dim])


def value_dim(pool: torch.Tensor, v_dim: int | None) -> int:
    return pool.shape[-1] if pool.shape[0] == 2 else v_dim


# ---- reference ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReferenceMeta:
    spans: tuple[tuple[int, int], ...]
    q_starts: tuple[int, ...]
    new: tuple[torch.Tensor, ...]  # per request: the slots of its new rows [q_start, kv_length)
    slots: tuple[torch.Tensor, ...]  # per request: the slots of the keys it reads (all of [0, kv_length), or keys_of)
    masks: tuple[tuple[torch.Tensor | None, bool], ...]  # per request: (SDPA's mask, is_causal)
    blocks: tuple[torch.Tensor, ...] | None = None  # kv_eviction h2o: each key's slot in PagedBatch.scores


def slots_at(c: ChunkLike, positions: list[int], block_size: int) -> list[int]:
    """The pool slots of some positions of a chunk's request (keys_of's), through its block table."""
    return [c.blocks[j // block_size] * block_size + j % block_size for j in positions]


class ReferenceBackend(AttentionBackend):
    name = "reference"

    def build(self, chunks, spans, block_size, slots, put):
        keys = [keys_of(c, block_size) for c in chunks]
        starts = score_slots(chunks)
        for i, (c, k) in enumerate(zip(chunks, keys)):
            put(slots(c, c.q_start, c.kv_length))
            if k is None:
                put(slots(c, 0, c.kv_length))
            else:  # eviction: the keys the chunk's queries read, and their positions for the window's mask
                put(slots_at(c, k, block_size))
                put(k)
            if starts is not None:
                put(key_blocks(k, starts[i], block_size))

        def finish(parts):
            new, read, masks, blocks = [], [], [], []
            for c, k in zip(chunks, keys):
                new.append(next(parts))
                read.append(next(parts))
                if k is not None:
                    queries = torch.arange(c.q_start, c.kv_length, device=read[-1].device)
                    masks.append((visible(queries, next(parts), *c.window), False))
                elif c.q_rows == 1:  # decode: the one new query sees every key
                    masks.append((None, False))
                elif c.q_start == 0:  # a whole prompt, or its first chunk: the plain causal square
                    masks.append((None, True))
                else:  # a chunk after a cached prefix: full on the prefix, causal on the chunk
                    masks.append((prefix_causal_mask(c.q_start, c.q_rows, c.kv_length, read[-1].device), False))
                if starts is not None:
                    blocks.append(next(parts))
            return ReferenceMeta(tuple(spans), tuple(c.q_start for c in chunks), tuple(new), tuple(read), tuple(masks),
                                 tuple(blocks) if starts is not None else None)

        return finish

    def forward(self, q, kv, pool, batch, *, scale=None, v_dim=None, skip_fresh=False):
        """Write, gather, attend, one request at a time."""
        meta: ReferenceMeta = batch.meta
        group = q.shape[0] // kv.shape[1]
        outs = []
        for i, ((s, e), q_start, new, slots, (mask, causal)) in enumerate(zip(meta.spans, meta.q_starts, meta.new,
                                                                               meta.slots, meta.masks)):
            store(pool, new, kv[:, :, s:e].transpose(1, 2))  # [2, q_rows, h_kv, dh] into its new slots
            if skip_fresh and q_start == 0:
                outs.append(q.new_zeros(1, q.shape[0], e - s, value_dim(pool, v_dim)))
                continue
            context = load(pool, slots).transpose(1, 2)  # [2, h_kv, keys, dh]: its block table, read in order
            if group > 1:
                context = context.repeat_interleave(group, dim=1)
            keys, values = split_kv(context[:, None], v_dim)  # each [1, h, keys, d_head]
            outs.append(F.scaled_dot_product_attention(q[None, :, s:e], keys, values, attn_mask=mask,
                                                       is_causal=causal, scale=scale))
            if meta.blocks is not None:  # kv_eviction h2o: what each key got, by its block
                add_scores(batch.scores, meta.blocks[i], q[None, :, s:e], keys, mask, causal, scale)
        return rearrange(torch.cat(outs, dim=2), "1 h n d -> n (h d)")


# ---- batched -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionGroup:
    """Requests that attend in one SDPA call (batched): B requests, queries padded to max_q, keys to max_kv.

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
    score_at: torch.Tensor | None = None  # kv_eviction h2o [B, max_kv]: each key's slot in PagedBatch.scores
    valid: torch.Tensor | None = None  # with it [B, max_q]: the real query rows


@dataclass(frozen=True)
class DecodeGroup:
    """Every decode row of an iteration, attending in one ragged pass (batched): no padding at all.

    rows [B]      the flat row of each decode's one query
    slots [N]     the pool slots of every decode's keys [0, kv_length), one request after another (N = Σ kv_length)
    owner [N]     which decode (0 .. B-1) each key belongs to
    """

    rows: torch.Tensor
    slots: torch.Tensor
    owner: torch.Tensor


@dataclass(frozen=True)
class BatchedMeta:
    decodes: DecodeGroup | None  # the decodes as one ragged group (when padding would dominate), else in `groups`
    groups: tuple[AttentionGroup, ...]  # at most 1 + 2·PROMPT_GROUPS: decodes; fresh chunks; chunks after a prefix


def split(members: list[int], chunks) -> list[list[int]]:
    """Prompt chunks of one kind in at most PROMPT_GROUPS groups, so that padding each group to its longest costs
    least: sorted by length, cut where the padded score entries B·max_q·max_kv (+ CALL_COST a call) are fewest
    (dynamic programming over the cut points; a handful of chunks per iteration)."""
    if len(members) <= 1:
        return [members]
    order = sorted(members, key=lambda i: (chunks[i].kv_length, chunks[i].q_rows))
    n, inf = len(order), float("inf")
    best = [[inf] * (n + 1) for _ in range(PROMPT_GROUPS + 1)]  # best[g][j]: the first j chunks in g groups
    cut = [[0] * (n + 1) for _ in range(PROMPT_GROUPS + 1)]
    best[0][0] = 0
    for g in range(1, PROMPT_GROUPS + 1):
        for j in range(1, n + 1):
            max_q = 0
            for i in range(j - 1, -1, -1):  # the last group: order[i:j]
                max_q = max(max_q, chunks[order[i]].q_rows)
                cost = best[g - 1][i] + (j - i) * max_q * chunks[order[j - 1]].kv_length + CALL_COST
                if cost < best[g][j]:
                    best[g][j], cut[g][j] = cost, i
    g = min(range(1, PROMPT_GROUPS + 1), key=lambda k: best[k][n])
    out, j = [], n
    while g:
        out.append(order[cut[g][j]:j])
        j, g = cut[g][j], g - 1
    return out[::-1]


def ragged_decodes(chunks) -> bool:
    """The batched rule: the decodes attend in one ragged pass when padding them would score > RAGGED_BELOW times
    their keys (one long context among short ones)."""
    keys = [c.kv_length for c in chunks if c.decode]
    return bool(keys) and sum(keys) * RAGGED_BELOW < len(keys) * max(keys)


class BatchedBackend(AttentionBackend):
    name = "batched"

    def build(self, chunks, spans, block_size, slots, put):
        fresh = [i for i, c in enumerate(chunks) if not c.decode and c.q_start == 0]
        later = [i for i, c in enumerate(chunks) if not c.decode and c.q_start > 0]
        decodes = [i for i, c in enumerate(chunks) if c.decode]
        window = next((c.window for c in chunks if c.window is not None), None)  # KV eviction: the engine's rule
        ragged = window is None and ragged_decodes(chunks)
        if ragged:  # padding would more than quadruple the keys: the rows, every key's slot end to end, its owner
            put([spans[i][0] for i in decodes])
            put([s for i in decodes for s in slots(chunks[i], 0, chunks[i].kv_length)])
            put([b for b, i in enumerate(decodes) for _ in range(chunks[i].kv_length)])
        shapes = []  # per group: (B, max_q, max_kv, causal)
        starts = score_slots(chunks)
        for members in ([] if ragged else [decodes]) + split(fresh, chunks) + split(later, chunks):
            if not members:
                continue
            chosen = [chunks[i] for i in members]
            # under eviction each request reads only the keys of its window (keys_of) and every group is masked
            read = [list(range(c.kv_length)) if window is None else keys_of(c, block_size) for c in chosen]
            max_q, max_kv = max(c.q_rows for c in chosen), max(len(k) for k in read)
            rows, keys, src, dst, positions = [], [], [], [], []
            for b, (i, k) in enumerate(zip(members, read)):
                c, (s, e) = chunks[i], spans[i]
                rows += list(range(s, e)) + [0] * (max_q - c.q_rows)
                keys += (slots(c, 0, c.kv_length) if window is None else slots_at(c, k, block_size)) + \
                    [0] * (max_kv - len(k))
                positions += k + [PAST] * (max_kv - len(k))  # a padding key lies past every query
                src += range(b * max_q, b * max_q + c.q_rows)
                dst += range(s, e)
            for values in (rows, keys, [c.q_start for c in chosen], [c.kv_length for c in chosen], src, dst):
                put(values)
            if window is not None:
                put(positions)
            if starts is not None:  # h2o: each key's block; a padding key adds to the last slot
                put([x for i, k in zip(members, read) for x in key_blocks(k, starts[i], block_size)
                     + [starts[-1]] * (max_kv - len(k))])
            # fresh prompt chunks (q_start = 0): each a causal square padded on the right, so SDPA's is_causal is
            # exact for every real query (a padding key lies past it) and no mask is built or read
            shapes.append((len(members), max_q, max_kv,
                           window is None and chosen[0].q_start == 0 and not chosen[0].decode))

        def finish(parts):
            decode_group = DecodeGroup(next(parts), next(parts), next(parts)) if ragged else None
            groups = []
            for B, max_q, max_kv, causal in shapes:
                rows, slots, q_start, kv_length, src, dst = (next(parts) for _ in range(6))
                mask = None  # causal: SDPA's is_causal
                query_pos = q_start[:, None] + torch.arange(max_q, device=rows.device)[None, :]  # [B, max_q]
                if window is not None:  # each key's position through keys_of; a padding key's is PAST
                    mask = visible(query_pos, next(parts).view(B, max_kv), *window)[:, None]
                elif not causal:
                    keys = torch.arange(max_kv, device=rows.device)
                    # key j visible to query i iff j <= q_start + i (causal) and j < kv_length (the request's own
                    # keys; this also keeps a padding query's row from being all masked)
                    mask = ((keys[None, None, :] <= query_pos[:, :, None])
                            & (keys[None, None, :] < kv_length[:, None, None]))[:, None]
                score_at = valid = None
                if starts is not None:
                    score_at = next(parts).view(B, max_kv)
                    valid = torch.arange(max_q, device=rows.device)[None, :] < (kv_length - q_start)[:, None]
                groups.append(AttentionGroup(rows.view(B, max_q), slots.view(B, max_kv), mask, src, dst, score_at,
                                             valid))
            return BatchedMeta(decode_group, tuple(groups))

        return finish

    def forward(self, q, kv, pool, batch, *, scale=None, v_dim=None, skip_fresh=False):
        meta: BatchedMeta = batch.meta
        store(pool, batch.slot_mapping, kv.transpose(1, 2))  # one scatter: every new row's K,V into its slot
        h, T, dh = q.shape
        group = h // kv.shape[1]
        out = (q.new_zeros if skip_fresh else q.new_empty)(T, h, value_dim(pool, v_dim))
        if meta.decodes is not None:
            out.index_copy_(0, meta.decodes.rows, _ragged_decode(q, pool, meta.decodes, scale, v_dim))
        for g in meta.groups:  # at most 7 calls: decodes, fresh prompt chunks, chunks after a prefix
            if skip_fresh and g.mask is None:  # fresh prompt chunks (the causal groups): the caller's
                continue
            B, max_q = g.rows.shape
            queries = q.index_select(1, g.rows.flatten()).view(h, B, max_q, dh).transpose(0, 1)  # [B, h, max_q, dh]
            context = load(pool, g.slots.flatten())  # [2, B·max_kv, h_kv, dh]: the keys through the tables
            keys, values = split_kv(context.view(pool.shape[0], B, -1, *pool.shape[2:]).permute(0, 1, 3, 2, 4),
                                    v_dim)  # [B, h_kv, max_kv, dh]
            if group > 1 and max_q == 1:  # decodes: a K,V head's query heads as its query rows (no copy of K,V)
                o = F.scaled_dot_product_attention(queries.reshape(B, -1, group, dh), keys, values, attn_mask=g.mask,
                                                   scale=scale).reshape(B, h, 1, -1)
            else:
                if group > 1:  # query head j reads K,V head j // group
                    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
                o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=g.mask, is_causal=g.mask is None,
                                                   scale=scale)
            if g.score_at is not None:  # kv_eviction h2o: what each key got, by its block (real queries only)
                add_scores(batch.scores, g.score_at, queries, keys, g.mask, g.mask is None, scale, g.valid)
            out.index_copy_(0, g.dst, o.transpose(1, 2).reshape(B * max_q, h, -1).index_select(0, g.src))  # real rows
        return out.flatten(1)


def _ragged_decode(q: torch.Tensor, pool: torch.Tensor, g: DecodeGroup, scale: float | None = None,
                   v_dim: int | None = None) -> torch.Tensor:
    """Every decode's one query against its own keys, all decodes at once and without padding: the keys of all
    requests in one flat [N] run, a softmax per request (segment max and sum by `owner`), the values summed back per
    request. One long context does not widen the others (a padded SDPA would score every decode to the longest).
    Scores and sums in float32 at least. Returns [B, h, dh]."""
    h, _, dh = q.shape
    h_kv = pool.shape[2]
    B, N, acc = g.rows.numel(), g.owner.numel(), torch.promote_types(q.dtype, torch.float32)
    queries = q.index_select(1, g.rows).transpose(0, 1).to(acc).index_select(0, g.owner)  # [N, h, dh]: each key's query
    keys, values = split_kv(load(pool, g.slots), v_dim)  # each [N, h_kv, dh]: through the block tables
    queries = queries.view(N, h_kv, h // h_kv, dh)  # query head j reads K,V head j // (h/h_kv)
    scores = (queries * keys[:, :, None].to(acc)).sum(-1).view(N, h) * (dh ** -0.5 if scale is None else scale)
    owner = g.owner[:, None].expand(N, h)
    top = scores.new_full((B, h), float("-inf")).scatter_reduce_(0, owner, scores, "amax")  # per request, per head
    weights = (scores - top.index_select(0, g.owner)).exp()  # [N, h]
    total = scores.new_zeros(B, h).index_add_(0, g.owner, weights)
    dv = values.shape[-1]
    mixed = (weights.view(N, h_kv, -1, 1) * values[:, :, None].to(acc)).view(N, h, dv)
    out = scores.new_zeros(B, h, dv).index_add_(0, g.owner, mixed)
    return (out / total[..., None]).to(q.dtype)


# ---- cpu ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CPUSeq:
    """One request's attention call (cpu): its rows [start, end), its first position, and, unless it is a fresh
    prompt chunk (which attends to its own new rows only), its block table (or, under KV eviction, the slots of the
    keys it reads) and, for a chunk after a prefix, its mask [q_rows, keys] (a fresh chunk longer than an eviction
    window gets its window's mask too)."""

    start: int
    end: int
    kv_length: int
    blocks: torch.Tensor | None
    mask: torch.Tensor | None
    slots: torch.Tensor | None = None
    score_at: torch.Tensor | None = None  # kv_eviction h2o: each key's slot in PagedBatch.scores


@dataclass(frozen=True)
class CPUMeta:
    block_size: int
    seqs: tuple[CPUSeq, ...]


class CPUBackend(AttentionBackend):
    name = "cpu"

    def build(self, chunks, spans, block_size, slots, put):
        reads = [c.q_start > 0 for c in chunks]  # a fresh chunk (q_start = 0) reads nothing from the pool
        keys = [keys_of(c, block_size) if read else None for c, read in zip(chunks, reads)]
        starts = score_slots(chunks)
        for i, (c, read, k) in enumerate(zip(chunks, reads, keys)):
            if k is not None:  # eviction: the slots of exactly the keys its queries read, and their positions
                put(slots_at(c, k, block_size))
                put(k)
            elif read:
                put(list(c.blocks[:-(-c.kv_length // block_size)]))  # the whole blocks its keys lie in
            elif c.window is not None and c.q_rows > c.window[1]:  # a fresh chunk past its window: its positions
                put(list(range(c.q_rows)))
            if starts is not None:  # h2o: each key's block (a fresh chunk's keys are its own rows)
                put(key_blocks(k if k is not None else list(range(c.q_rows)), starts[i], block_size))

        def finish(parts):
            seqs = []
            for c, (s, e), read, k in zip(chunks, spans, reads, keys):
                if k is not None:
                    at, positions = next(parts), next(parts)
                    queries = torch.arange(c.q_start, c.kv_length, device=at.device)
                    mask = visible(queries, positions, *c.window) if c.q_rows > 1 else None  # a decode: all
                    seqs.append(CPUSeq(s, e, c.kv_length, None, mask, at,
                                       next(parts) if starts is not None else None))
                    continue
                blocks = next(parts) if read else None
                mask = (prefix_causal_mask(c.q_start, c.q_rows, c.kv_length, blocks.device)
                        if read and c.q_rows > 1 else None)
                if not read and c.window is not None and c.q_rows > c.window[1]:  # a fresh chunk past its window
                    rows = next(parts)
                    mask = visible(rows, rows, *c.window)
                seqs.append(CPUSeq(s, e, c.kv_length, blocks, mask, None, next(parts) if starts is not None else None))
            return CPUMeta(block_size, tuple(seqs))

        return finish

    def forward(self, q, kv, pool, batch, *, scale=None, v_dim=None, skip_fresh=False):
        meta: CPUMeta = batch.meta
        store(pool, batch.slot_mapping, kv.transpose(1, 2))  # one scatter: every new row's K,V into its slot
        h_kv, dh = pool.shape[2:]
        gqa = q.shape[0] != h_kv
        outs = []
        for seq in meta.seqs:
            queries = q[None, :, seq.start:seq.end]  # [1, h, q_rows, dh]
            fresh = seq.blocks is None and seq.slots is None
            if fresh and skip_fresh:
                o = q.new_zeros(1, q.shape[0], seq.end - seq.start, value_dim(pool, v_dim))
            elif fresh:  # a fresh prompt chunk: its keys are its own rows, the plain causal square (or its window)
                keys, values = split_kv(kv[:, None, :, seq.start:seq.end], v_dim)  # each [1, h_kv, q_rows, dh]
                o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=seq.mask,
                                                   is_causal=seq.mask is None, enable_gqa=gqa, scale=scale)
                if seq.score_at is not None:  # kv_eviction h2o: what each key got, by its block
                    add_scores(batch.scores, seq.score_at, queries, keys, seq.mask, seq.mask is None, scale)
            else:  # a decode (sees every key) or a chunk after a prefix (its mask): keys through the block table
                context = load(pool, seq.slots) if seq.slots is not None else \
                    load_blocks(pool, meta.block_size, seq.blocks)[:, :seq.kv_length]
                keys, values = split_kv(context.transpose(1, 2)[:, None], v_dim)  # each [1, h_kv, keys, dh]
                if gqa and seq.mask is None:  # a decode: a K,V head's query heads as its query rows, one matmul each
                    o = F.scaled_dot_product_attention(queries.reshape(1, h_kv, -1, dh), keys, values,
                                                       scale=scale).reshape(1, q.shape[0], 1, -1)
                else:
                    o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=seq.mask, enable_gqa=gqa,
                                                       scale=scale)
                if seq.score_at is not None:  # kv_eviction h2o: what each key got, by its block
                    add_scores(batch.scores, seq.score_at, queries, keys, seq.mask, False, scale)
            outs.append(o[0])
        return rearrange(torch.cat(outs, dim=1), "h n d -> n (h d)")


# ---- flash --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FlashMeta:
    reference: ReferenceMeta
    windows: tuple  # per request: its kv_eviction window, or None


class FlashBackend(ReferenceBackend):
    """The reference's writes and reads (one request at a time, its keys through its block table), attended the way
    FlashAttention-2 and FlashDecoding do it (layers/attention/flash.py): a prompt chunk by tiles of queries and keys
    with the online softmax, a decode's one row by key chunks of a fixed size merged by their log-sum-exps."""

    name = "flash"

    def __init__(self, block_q: int = BLOCK_Q, block_k: int = BLOCK_K, split: int = DECODE_SPLIT,
                 invariant: bool = False):
        """invariant (batch_invariant): every tile padded to block_q × block_k, and a decode row through the same
        tiles as a prompt's (no key chunks): a row's result is the same bits whatever its chunk and batch."""
        self.block_q, self.block_k, self.split = block_q, block_k, split  # the tiles, FlashDecoding's key chunks
        self.invariant = invariant

    def build(self, chunks, spans, block_size, slots, put):
        finish = super().build(chunks, spans, block_size, slots, put)
        return lambda parts: FlashMeta(finish(parts), tuple(c.window for c in chunks))

    def forward(self, q, kv, pool, batch, *, scale=None, v_dim=None, skip_fresh=False):
        meta: FlashMeta = batch.meta
        ref = meta.reference
        outs = []
        for i, ((s, e), q_start, new, slots, (mask, causal), window) in enumerate(zip(
                ref.spans, ref.q_starts, ref.new, ref.slots, ref.masks, meta.windows)):
            store(pool, new, kv[:, :, s:e].transpose(1, 2))
            if skip_fresh and q_start == 0:
                outs.append(q.new_zeros(q.shape[0], e - s, value_dim(pool, v_dim)))
                continue
            keys, values = split_kv(load(pool, slots).transpose(1, 2), v_dim)  # each [h_kv, keys, d]
            qi = q[:, s:e]
            if window is not None:  # kv_eviction: the keys read are a subset; the mask says who sees which
                o, _ = flash_attention(qi, keys, values, mask=mask, block_q=self.block_q, block_k=self.block_k,
                                       scale=scale)
            elif e - s == 1 and not self.invariant:  # a decode: FlashDecoding over its whole cache
                o, _ = flash_decoding(qi, keys, values, split=self.split, scale=scale)
            else:  # a prompt chunk after q_start cached positions (or a decode, invariant): causal by position
                positions = torch.arange(keys.shape[1], device=q.device)
                o, _ = flash_attention(qi, keys, values, positions[q_start:q_start + e - s], positions,
                                       block_q=self.block_q, block_k=self.block_k, scale=scale, pad=self.invariant)
            outs.append(o)
            if ref.blocks is not None:  # kv_eviction h2o: what each key got, by its block
                add_scores(batch.scores, ref.blocks[i], qi[None], keys[None], mask, causal, scale)
        return rearrange(torch.cat(outs, dim=1), "h n d -> n (h d)")


BACKENDS: dict[str, AttentionBackend] = {b.name: b for b in (ReferenceBackend(), BatchedBackend(), CPUBackend(),
                                                              FlashBackend())}


def choose(name: str, device) -> str:
    """The backend a setting names on a device: `auto` is cpu on a CPU device, batched on CUDA (and any other)."""
    if name == "auto":
        return "cpu" if torch.device(device).type == "cpu" else "batched"
    if name not in BACKENDS:
        raise ValueError(f"attention={name!r}: choose auto, {', '.join(BACKENDS)}")
    return name


def backend(name: str, device) -> AttentionBackend:
    return BACKENDS[choose(name, device)]
