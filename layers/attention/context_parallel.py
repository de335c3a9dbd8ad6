"""Context parallelism: one request's sequence split over cp ranks, attention exact through one log-sum-exp merge.

Attention over a part K_a of the keys gives o_a (softmax-weighted values over K_a) and lse_a = log Σ_{k∈K_a} e^{q·k·s}.
Parts combine exactly (`merge`): lse = log Σ_a e^{lse_a}, o = Σ_a e^{lse_a − lse}·o_a; an empty part has lse = −∞
and weight 0. Two uses, both through `merge`:

    prefill, ring attention (pass-KV)   the prompt in 2·cp chunks, rank i holding chunks i and 2·cp − 1 − i (zigzag:
                                        every rank the same causal work); each rank's K,V go around the ring in
                                        cp − 1 steps (★ send to the next rank, receive from the previous, posted
                                        before this block's attention so the transfer overlaps it), each rank merging
                                        its queries' partial attention over every block as it arrives
    decode over a split cache           each rank keeps the K,V of the positions it owns (a prompt's from the
                                        prefill, a new token's on rank position % cp), every rank computes the new
                                        rows' queries (the layers outside attention run on every cp rank alike),
                                        attends over its own keys, ★ one all-gather of (o, lse) over the cp group per
                                        layer, merged

Inside a cp rank the block is the TP block it always was (head-aligned TP over the tp group, the same all-reduces):
the cp ranks of one TP slot hold the same heads, different tokens. Both uses are `requests` objects that
layers/attention/attention.attention dispatches to, as it does to the paged cache (PagedLayer).

Bytes per rank per layer (tp/traffic_model.predict_cp, predict_iteration): pass-KV (cp − 1)·2·(S/cp)·h_kv·d·e (each
rank's own rows, so exactly the rows it holds); the decode merge an all-gather of [T, h, d + 1] in float32 at least.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from layers.attention.backends import load, store
from layers.attention.merge import merge  # the one merge: tiled attention's too
from tp.comm import gather_rows_from_region
from tp.dist import grid_groups
from tp.ledger import TransferRecord, active


def new_cp_groups(world: int, cp: int) -> tuple[list[dist.ProcessGroup], list[dist.ProcessGroup]]:
    """(the tp groups by cp index, the cp groups by TP index) of a world of cp × tp ranks, global rank c·tp + t: each
    TP group tp consecutive ranks (tp/dist.py grid_groups)."""
    return grid_groups(world, cp)


def rank_groups(world: int, cp: int, rank: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's (tp group, cp group)."""
    tp_groups, cp_groups = new_cp_groups(world, cp)
    return tp_groups[rank // (world // cp)], cp_groups[rank % (world // cp)]


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                      scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [h, Tq, d] at positions q_pos [Tq]; k, v [h_kv, Tk, d] at k_pos [Tk]; query head j reads K,V head j // (h/h_kv);
    key visible iff k_pos <= q_pos. Returns (o [h, Tq, d] in q's dtype, lse [h, Tq] in float32 at least; −∞ where a
    query sees no key here). On a CPU, PyTorch's fused flash kernel (which returns the log-sum-exp); elsewhere the
    readable form below (scores materialized)."""
    visible = k_pos[None, :] <= q_pos[:, None]  # [Tq, Tk]
    if q.device.type == "cpu":
        return attend_part(q, k, v, None if bool(visible.all()) else visible, scale)
    return materialized_attention(q, k, v, visible, scale)


def attend_part(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible, scale: float | None = None):
    """(o, lse) of q [h, Tq, d] over k, v [h_kv, Tk, d] through the CPU's fused flash kernel: visible a [Tq, Tk]
    boolean mask, "causal" (a square block on the diagonal) or None (every key)."""
    h, h_kv = q.shape[0], k.shape[0]
    if not (q.shape[1] and k.shape[1]):  # nothing to attend (the kernel divides by the lengths): an empty part
        acc = torch.promote_types(q.dtype, torch.float32)
        return q.new_zeros(h, q.shape[1], v.shape[2]), torch.full((h, q.shape[1]), -math.inf, dtype=acc,
                                                                  device=q.device)
    if h != h_kv:  # the kernel takes as many K,V heads as query heads
        k, v = k.repeat_interleave(h // h_kv, dim=0), v.repeat_interleave(h // h_kv, dim=0)
    causal = isinstance(visible, str)
    mask = None if causal or visible is None else \
        torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill(~visible, -math.inf)
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q[None], k[None], v[None], 0.0, causal,
                                                                         attn_mask=mask, scale=scale)
    lse = lse[0].to(torch.promote_types(q.dtype, torch.float32))
    if mask is not None:  # a query that sees no key here: the kernel gives 0 and lse 0; the merge needs −∞
        lse = lse.masked_fill(~visible.any(-1)[None, :], -math.inf)
    return o[0], lse


def materialized_attention(q, k, v, visible: torch.Tensor, scale: float | None = None):
    """The readable form of partial_attention (and its off-CPU path): scores [h, Tq, Tk] in float32 at least,
    masked, log-sum-exp, probabilities, values."""
    h, Tq, d = q.shape
    h_kv = k.shape[0]
    acc = torch.promote_types(q.dtype, torch.float32)
    scale = d ** -0.5 if scale is None else scale
    qg = q.to(acc).view(h_kv, h // h_kv, Tq, d)
    scores = torch.einsum("kgqd,ktd->kgqt", qg, k.to(acc)).reshape(h, Tq, -1) * scale
    scores = scores.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)  # [h, Tq]
    probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    o = torch.einsum("kgqt,ktd->kgqd", probs.view(h_kv, h // h_kv, Tq, -1), v.to(acc)).reshape(h, Tq, -1)
    return o.to(q.dtype), lse


# ---- the zigzag layout ----------------------------------------------------------------------------------------


def chunk_bounds(n: int, cp: int) -> list[tuple[int, int]]:
    """The 2·cp chunks of a sequence of n positions: sizes differ by at most one, the longer ones first."""
    base, extra = divmod(n, 2 * cp)
    sizes = [base + (1 if c < extra else 0) for c in range(2 * cp)]
    starts = [sum(sizes[:c]) for c in range(2 * cp)]
    return [(a, a + size) for a, size in zip(starts, sizes)]


def zigzag_positions(n: int, cp: int, rank: int) -> list[int]:
    """The positions rank `rank` holds under zigzag: chunks rank and 2·cp − 1 − rank, in order."""
    bounds = chunk_bounds(n, cp)
    (a, b), (c, d) = bounds[rank], bounds[2 * cp - 1 - rank]
    return list(range(a, b)) + list(range(c, d))


def contiguous_positions(n: int, cp: int, rank: int) -> list[int]:
    """The naive split: rank r holds positions [r·n/cp, (r+1)·n/cp) (for comparison: its causal work grows with r)."""
    base, extra = divmod(n, cp)
    start = rank * base + min(rank, extra)
    return list(range(start, start + base + (1 if rank < extra else 0)))


def causal_pairs(positions: list[int]) -> int:
    """Unmasked (query, key) pairs of these query positions over a causal prefix: Σ (p + 1)."""
    return sum(p + 1 for p in positions)


# ---- prefill: ring attention, pass-KV -------------------------------------------------------------------------


@dataclass
class RingPrefill:
    """One request's prompt over the cp group, this rank holding the rows at `positions[rank]` (zigzag). attention()
    hands it q [h, T_r, d] and kv [2, h_kv, T_r, d] of this rank's rows; it returns [T_r, h·d]. `kept` collects each
    layer's K,V of this rank's rows (what its cache would hold)."""

    group: dist.ProcessGroup
    positions: list[list[int]]  # every cp rank's positions, by rank in the group
    device: torch.device | str = "cpu"
    kept: list[torch.Tensor] = field(default_factory=list)
    scale: float | None = None

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def local_positions(self) -> torch.Tensor:
        return torch.tensor(self.positions[self.rank], device=self.device)

    def attend(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        cp, rank = len(self.positions), self.rank
        ranks = dist.get_process_group_ranks(self.group)
        nxt, prev = ranks[(rank + 1) % cp], ranks[(rank - 1) % cp]
        self.kept.append(kv.detach())
        n = sum(len(p) for p in self.positions)
        zigzag = q.device.type == "cpu" and self.positions == [zigzag_positions(n, cp, r) for r in range(cp)]
        bounds = chunk_bounds(n, cp)
        q_pos = self.local_positions
        block, parts = kv.contiguous(), [[], []]  # per query chunk: its (o, lse) over every key block it sees
        for step in range(cp):
            owner = (rank - step) % cp  # whose rows `block` holds
            arrived = None
            if step < cp - 1:  # ★ pass-KV: this block on to the next rank while it is attended here
                incoming = kv.new_empty(2, kv.shape[1], len(self.positions[(owner - 1) % cp]), kv.shape[3])
                arrived = self._exchange(block, incoming, nxt, prev)
            if zigzag:  # by chunk pairs: a later chunk is skipped, the same chunk causal, an earlier one whole
                for qi, (qc, q_rows) in enumerate(self._chunks(rank, bounds)):
                    for kc, k_rows in self._chunks(owner, bounds):
                        if kc > qc:
                            continue
                        parts[qi].append(attend_part(q[:, q_rows], block[0][:, k_rows], block[1][:, k_rows],
                                                     "causal" if kc == qc else None, self.scale))
            else:
                k_pos = torch.tensor(self.positions[owner], device=self.device)
                parts[0].append(partial_attention(q, block[0], block[1], q_pos, k_pos, self.scale))
            if arrived is not None:
                block = arrived()
        merged = [merge([o for o, _ in pairs], [lse for _, lse in pairs])[0] for pairs in parts if pairs]
        o = torch.cat(merged, dim=1) if zigzag else merged[0]
        return o.transpose(0, 1).reshape(q.shape[1], -1)

    @staticmethod
    def _chunks(rank: int, bounds: list[tuple[int, int]]) -> list[tuple[int, slice]]:
        """A rank's two zigzag chunks: (chunk index, its rows in that rank's block)."""
        first, second = rank, len(bounds) - 1 - rank
        a = bounds[first][1] - bounds[first][0]
        return [(first, slice(0, a)), (second, slice(a, a + bounds[second][1] - bounds[second][0]))]

    @staticmethod
    def _exchange(block: torch.Tensor, incoming: torch.Tensor, nxt: int, prev: int):
        """Post `block`'s send to rank nxt and `incoming`'s receive from prev; the returned function finishes both."""
        ledger, start = active(), time.perf_counter()
        works = [dist.isend(block, nxt, group=None), dist.irecv(incoming, prev, group=None)]

        def arrived() -> torch.Tensor:
            for w in works:
                w.wait()
            if ledger is not None:
                took, dtype = time.perf_counter() - start, str(block.dtype).removeprefix("torch.")
                for kind, peer, t in (("send", nxt, block), ("recv", prev, incoming)):
                    ledger.transfer(TransferRecord(kind, "cp/pass-kv", 0, ledger.layer, dist.get_rank(), peer, (0, 0),
                                                   tuple(t.shape), dtype, t.numel() * t.element_size(), took))
            return incoming

        return arrived


# ---- decode over a split cache ---------------------------------------------------------------------------------


@dataclass
class SplitKVDecode:
    """New rows (decodes) of one request whose cached K,V are split over the cp group: this rank keeps the rows at
    `cache_positions` (per layer, appended to as new tokens arrive: a new position on rank position % cp). attention()
    hands it the new rows' q [h, T, d] and kv [2, h_kv, T, d] (every cp rank computed them alike); it keeps the rows
    it owns, attends over its own keys, and merges the ranks' partial results (★ one all-gather per layer)."""

    group: dist.ProcessGroup
    caches: list[torch.Tensor]  # per layer: this rank's K,V [2, h_kv, n_r, d]
    cache_positions: list[int]
    new_positions: list[int]  # the rows' positions (consecutive new tokens of the request)
    layer: int = 0
    scale: float | None = None

    def attend(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        cp, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        device = q.device
        mine = [i for i, p in enumerate(self.new_positions) if p % cp == rank]
        cache = self.caches[self.layer]
        if mine:  # the new tokens this rank owns join its cache (written where they are owned)
            cache = torch.cat([cache, kv[:, :, mine]], dim=2)
            self.caches[self.layer] = cache
        positions = self.cache_positions + [self.new_positions[i] for i in mine]
        if self.layer == len(self.caches) - 1:
            self.cache_positions[:] = positions  # every layer kept the same rows
        o, lse = partial_attention(q, cache[0], cache[1], torch.tensor(self.new_positions, device=device),
                                   torch.tensor(positions, device=device, dtype=torch.long), self.scale)
        self.layer = (self.layer + 1) % len(self.caches)
        acc = lse.dtype
        packed = torch.cat([o.to(acc), lse[..., None]], dim=-1).transpose(0, 1).contiguous()  # [T, h, d + 1]
        every = gather_rows_from_region(packed, self.group, "attn/cp merge").view(cp, *packed.shape)  # ★ [cp·T, h, d+1]
        merged, _ = merge([part[..., :-1] for part in every], [part[..., -1] for part in every])
        return merged.to(q.dtype).reshape(q.shape[1], -1)


# ---- serving: the paged cache split over the cp group ----------------------------------------------------------


@dataclass(frozen=True)
class SplitSeq:
    """One request's attention on this cp rank: its rows [start, end) at positions q_start.., the pool slots of the
    keys it holds (positions t < kv_length with t % cp == its cp rank) and those positions."""

    start: int
    end: int
    key_slots: torch.Tensor
    key_positions: torch.Tensor


@dataclass(frozen=True)
class SplitMeta:
    owned_rows: torch.Tensor  # the iteration's rows whose K,V this rank keeps
    owned_slots: torch.Tensor  # and where
    seqs: tuple[SplitSeq, ...]


class SplitCacheBackend:
    """Attention over a paged pool split over the cp group (serve/: `context_parallel_size`): block b of a request
    holds its positions [b·B, (b+1)·B) (B = block_size, the scheduler's), and cp rank c keeps those with t % cp == c,
    position t at local slot blocks[t // B]·(B/cp) + (t % B) // cp of its pool of B/cp slots per block: the scheduler,
    its block tables and prefix caching are the plain ones, and each rank's pool is 1/cp of the request's K,V. Every
    rank computes every row's queries and new K,V (the layers outside attention run alike on the cp ranks); it writes
    the rows it owns, attends each request's queries over the keys it holds (partial_attention, one call per request
    on its own lengths, as the cpu backend), and ★ one all-gather of (o, lse) [cp·T, h, d + 1] over the cp group
    merges the parts (`merge`)."""

    name = "split"

    def __init__(self, group: dist.ProcessGroup):
        self.group, self.cp, self.rank = group, dist.get_world_size(group), dist.get_rank(group)

    def local_slot(self, blocks, t: int, block_size: int) -> int:
        return blocks[t // block_size] * (block_size // self.cp) + (t % block_size) // self.cp

    def build(self, chunks, spans, block_size, slots, put):
        cp, me = self.cp, self.rank
        rows, owned = [], []
        for c, (s, e) in zip(chunks, spans):
            for i, t in enumerate(range(c.q_start, c.q_end)):
                if t % cp == me:
                    rows.append(s + i)
                    owned.append(self.local_slot(c.blocks, t, block_size))
        put(rows)
        put(owned)
        for c in chunks:
            held = list(range(me, c.kv_length, cp))
            put([self.local_slot(c.blocks, t, block_size) for t in held])
            put(held)

        def finish(parts):
            owned_rows, owned_slots = next(parts), next(parts)
            seqs = tuple(SplitSeq(s, e, next(parts), next(parts)) for s, e in spans)
            return SplitMeta(owned_rows, owned_slots, seqs)

        return finish

    def forward(self, q, kv, pool, batch, *, scale=None, v_dim=None, skip_fresh=False):
        """q [h, T, d], kv [2, h_kv, T, d] (every row's, computed alike on the cp ranks); pool [2, slots, h_kv, d], this
        rank's. Returns [T, h·d]."""
        meta: SplitMeta = batch.meta
        store(pool, meta.owned_slots, kv.index_select(2, meta.owned_rows).transpose(1, 2))  # its own rows
        parts = []
        for seq in meta.seqs:
            keys, values = load(pool, seq.key_slots).transpose(1, 2)  # [h_kv, held, d]
            parts.append(partial_attention(q[:, seq.start:seq.end], keys, values, batch.positions[seq.start:seq.end],
                                           seq.key_positions, scale))
        o, lse = (torch.cat(side, dim=1) for side in zip(*parts))  # [h, T, d], [h, T]
        packed = torch.cat([o.to(lse.dtype), lse[..., None]], dim=-1).transpose(0, 1).contiguous()  # [T, h, d + 1]
        every = gather_rows_from_region(packed, self.group, "attn/cp merge").view(self.cp, *packed.shape)  # ★
        merged, _ = merge([part[..., :-1] for part in every], [part[..., -1] for part in every])
        return merged.to(q.dtype).flatten(1)
