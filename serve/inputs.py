"""One iteration's plan -> the tensors the model reads, built once per iteration (not per layer), in one place.

    ids [T]            the token of every row, decodes first (the plan's order)
    positions [T]      each row's position in its request: q_start, q_start + 1, ...
    slot_mapping [T]   where each row's K,V go: blocks[t // block_size] · block_size + t % block_size
    sample_rows [S]    the rows whose logits give a token
    meta               what the attention backend reads (layers/attention_backends.py): block tables, groups, masks

Everything integer is laid out on the host in one list and moved with one host-to-device copy (pinned and
non-blocking on a GPU); masks are then built on the device. The attention backend adds its own lists to the same copy
(its build), and turns its part of the copy into its metadata (its finish).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from layers.attention_backends import PagedBatch, backend
from serve.block_manager import slot_mapping
from serve.plan import ScheduledRequest, SchedulerOutput


@dataclass(frozen=True)
class StepInputs:
    ids: torch.Tensor
    batch: PagedBatch
    sample_rows: torch.Tensor

    @property
    def positions(self) -> torch.Tensor:
        return self.batch.positions


def slots_of(c: ScheduledRequest, start: int, end: int, block_size: int) -> list[int]:
    """The slot mapping of positions [start, end) of c's request, read off the block table the plan carries."""
    return slot_mapping(c.blocks, block_size, start, end)


def prepare_step(plan: SchedulerOutput, tokens: dict[int, list[int]], block_size: int, device,
                 attention) -> StepInputs:
    """tokens: request id -> its tokens (prompt + generated). attention: a backend's name, or auto (by device), or a
    backend itself (context parallelism's SplitCacheBackend, which holds its group).
    Returns the iteration's tensors on `device`."""
    chosen = attention if hasattr(attention, "build") else backend(attention, device)  # a name, or a backend
    flat: list[int] = []
    sizes: list[int] = []

    def put(values: list[int]) -> None:
        flat.extend(values)
        sizes.append(len(values))

    spans = plan.spans
    put([t for c in plan.scheduled for t in tokens[c.request][c.q_start:c.q_end]])
    put([t for c in plan.scheduled for t in range(c.q_start, c.q_end)])
    put([s for c in plan.scheduled for s in slots_of(c, c.q_start, c.q_end, block_size)])
    put(plan.sample_rows)
    finish = chosen.build(plan.scheduled, spans, block_size, lambda c, s, e: slots_of(c, s, e, block_size), put)
    host = torch.tensor(flat, dtype=torch.int64)
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    parts = iter(host.to(device, non_blocking=True).split(sizes))  # ★ the iteration's one host-to-device copy
    ids, positions, slots, sample_rows = (next(parts) for _ in range(4))
    fresh = tuple(span for c, span in zip(plan.scheduled, spans) if c.q_start == 0)  # prompt chunks from position 0
    return StepInputs(ids, PagedBatch(chosen, positions, slots, finish(parts), fresh=fresh), sample_rows)
