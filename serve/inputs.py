"""One iteration's plan -> the tensors the model reads, built once per iteration (not per layer), in one place.

    ids [T]            the token of every row, decodes first (the plan's order)
    positions [T]      each row's position in its request: q_start, q_start + 1, ...
    slot_mapping [T]   where each row's K,V go: blocks[t // block_size] · block_size + t % block_size
    sample_rows [S]    the rows whose logits give a token
    groups             batched attention: the decodes in one group, the prompt chunks in another, each with its
                       queries' rows, its keys' slots (from the block tables) and its mask (layers/attention.py)

Everything integer is laid out on the host in one list and moved with one host-to-device copy (pinned and
non-blocking on a GPU); the masks are then built on the device. The number of tensor operations does not depend
on the number of requests (batched mode). The reference mode adds one slot tensor per request, for the
per-request loop it is checked against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from layers.attention import AttentionGroup, PagedBatch
from serve.block_manager import slot_mapping
from serve.plan import Chunk, IterationPlan

ATTENTION_MODES = ("batched", "reference")


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
    shapes = []  # per group: (B, max_q, max_kv)
    if mode == "batched":
        for members in ([i for i, c in enumerate(plan.chunks) if c.decode],
                        [i for i, c in enumerate(plan.chunks) if not c.decode]):
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
            shapes.append((len(members), max_q, max_kv))
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
    groups = []
    for g, (B, max_q, max_kv) in enumerate(shapes):
        rows, slots, q_start, kv_length, src, dst = parts[4 + 6 * g: 10 + 6 * g]
        keys = torch.arange(max_kv, device=device)
        query_pos = q_start[:, None] + torch.arange(max_q, device=device)[None, :]  # [B, max_q]
        # key j visible to query i iff j <= q_start + i (causal) and j < kv_length (the request's own keys; this
        # also keeps a padding query's row from being all masked)
        mask = (keys[None, None, :] <= query_pos[:, :, None]) & (keys[None, None, :] < kv_length[:, None, None])
        groups.append(AttentionGroup(rows.view(B, max_q), slots.view(B, max_kv), mask[:, None], src, dst))
    return StepInputs(ids, PagedBatch("batched", positions, slot_mapping, groups=tuple(groups)), sample_rows)
