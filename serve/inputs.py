"""One iteration's plan -> the tensors the model reads, built once per iteration (not per layer), in one place.

    ids [T]            the token of every row, decodes first (the plan's order)
    positions [T]      each row's position in its request: q_start, q_start + 1, ...
    slot_mapping [T]   where each row's K,V go: blocks[t // block_size] · block_size + t % block_size
    sample_rows [S]    the rows whose logits give a token
    groups             batched attention, each one SDPA call: all decodes in one; fresh prompt chunks (q_start = 0) in
                       at most three of similar lengths, chunks after a cached prefix in at most three more; each with
                       its queries' rows, its keys' slots (from the block tables) and its mask (none for fresh chunks:
                       SDPA's is_causal) (layers/attention.py)
    decodes            instead of the decodes' group when padding every decode to the longest context would score
                       more than RAGGED_BELOW times their keys (one long context among short ones): every decode's
                       row, its keys' slots end to end and their owners, for one ragged pass without padding

Everything integer is laid out on the host in one list and moved with one host-to-device copy (pinned and
non-blocking on a GPU); the masks are then built on the device. The number of tensor operations does not depend
on the number of requests (batched mode): one decode call (padded, or ragged when padding would dominate) and at
most 6 prompt calls, whatever the mix. The reference mode adds one slot tensor per request, for the
per-request loop it is checked against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from layers.attention import AttentionGroup, DecodeGroup, PagedBatch
from serve.block_manager import slot_mapping
from serve.config import ATTENTION_MODES
from serve.plan import Chunk, IterationPlan



@dataclass(frozen=True)
class StepInputs:
    ids: torch.Tensor
    batch: PagedBatch
    sample_rows: torch.Tensor

    @property
    def positions(self) -> torch.Tensor:
        return self.batch.positions


def slots_of(c: Chunk, start: int, end: int, block_size: int) -> list[int]:
    """The slot mapping of positions [start, end) of c's request, read off the block table the plan carries."""
    return slot_mapping(c.blocks, block_size, start, end)


RAGGED_BELOW = 4  # decodes attend in one ragged pass when padding them to the longest would score > 4x their keys
PROMPT_GROUPS = 3  # most SDPA calls per layer for fresh prompt chunks, and as many for chunks after a prefix
CALL_COST = 64 * 64  # a call's fixed cost, in padded score entries: no group is split off for less


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


def prepare_step(plan: IterationPlan, tokens: dict[int, list[int]], block_size: int, device,
                 mode: str = "batched") -> StepInputs:
    """tokens: request id -> its tokens (prompt + generated). Returns the iteration's tensors on `device`."""
    if mode not in ATTENTION_MODES:
        raise ValueError(f"attention={mode!r}: choose {' or '.join(ATTENTION_MODES)}")
    flat: list[int] = []
    sizes: list[int] = []

    def put(values: list[int]) -> None:
        flat.extend(values)
        sizes.append(len(values))

    spans = plan.spans
    put([t for c in plan.chunks for t in tokens[c.request][c.q_start:c.q_end]])
    put([t for c in plan.chunks for t in range(c.q_start, c.q_end)])
    put([s for c in plan.chunks for s in slots_of(c, c.q_start, c.q_end, block_size)])
    put(plan.sample_rows)
    shapes, ragged = [], False  # shapes per group: (B, max_q, max_kv, causal)
    if mode == "batched":
        chunks = plan.chunks
        fresh = [i for i, c in enumerate(chunks) if not c.decode and c.q_start == 0]
        later = [i for i, c in enumerate(chunks) if not c.decode and c.q_start > 0]
        decodes = [i for i, c in enumerate(chunks) if c.decode]
        keys = [chunks[i].kv_length for i in decodes]
        ragged = bool(decodes) and sum(keys) * RAGGED_BELOW < len(keys) * max(keys)
        if ragged:  # padding would more than quadruple the keys: the rows, every key's slot end to end, its owner
            put([spans[i][0] for i in decodes])
            put([s for i in decodes for s in slots_of(chunks[i], 0, chunks[i].kv_length, block_size)])
            put([b for b, i in enumerate(decodes) for _ in range(chunks[i].kv_length)])
        for members in ([] if ragged else [decodes]) + split(fresh, chunks) + split(later, chunks):
            if not members:
                continue
            chosen = [plan.chunks[i] for i in members]
            max_q, max_kv = max(c.q_rows for c in chosen), max(c.kv_length for c in chosen)
            rows, slots, src, dst = [], [], [], []
            for b, i in enumerate(members):
                c, (s, e) = plan.chunks[i], spans[i]
                rows += list(range(s, e)) + [0] * (max_q - c.q_rows)
                slots += slots_of(c, 0, c.kv_length, block_size) + [0] * (max_kv - c.kv_length)
                src += range(b * max_q, b * max_q + c.q_rows)
                dst += range(s, e)
            for values in (rows, slots, [c.q_start for c in chosen], [c.kv_length for c in chosen], src, dst):
                put(values)
            # fresh prompt chunks (q_start = 0): each a causal square padded on the right, so SDPA's is_causal is
            # exact for every real query (a padding key lies past it) and no mask is built or read
            shapes.append((len(members), max_q, max_kv, chosen[0].q_start == 0 and not chosen[0].decode))
    else:
        for c in plan.chunks:
            put(slots_of(c, 0, c.kv_length, block_size))
    host = torch.tensor(flat, dtype=torch.int64)
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    parts = list(host.to(device, non_blocking=True).split(sizes))  # ★ the iteration's one host-to-device copy
    ids, positions, slot_mapping, sample_rows = parts[:4]
    if mode == "reference":
        batch = PagedBatch("reference", positions, slot_mapping, spans=tuple(spans),
                           q_starts=tuple(c.q_start for c in plan.chunks), slots=tuple(parts[4:]))
        return StepInputs(ids, batch, sample_rows)
    decode_group, first = None, 4
    if ragged:
        decode_group, first = DecodeGroup(*parts[4:7]), 7
    groups = []
    for g, (B, max_q, max_kv, causal) in enumerate(shapes):
        rows, slots, q_start, kv_length, src, dst = parts[first + 6 * g: first + 6 + 6 * g]
        if causal:
            groups.append(AttentionGroup(rows.view(B, max_q), slots.view(B, max_kv), None, src, dst))
            continue
        keys = torch.arange(max_kv, device=device)
        query_pos = q_start[:, None] + torch.arange(max_q, device=device)[None, :]  # [B, max_q]
        # key j visible to query i iff j <= q_start + i (causal) and j < kv_length (the request's own keys; this
        # also keeps a padding query's row from being all masked)
        mask = (keys[None, None, :] <= query_pos[:, :, None]) & (keys[None, None, :] < kv_length[:, None, None])
        groups.append(AttentionGroup(rows.view(B, max_q), slots.view(B, max_kv), mask[:, None], src, dst))
    return StepInputs(ids, PagedBatch("batched", positions, slot_mapping, decode_group, tuple(groups)), sample_rows)
