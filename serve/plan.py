"""One iteration's plan: which rows of which requests go through the model.

Every request in an iteration is a triple (q_start, q_end, kv_length = q_end):

    fresh prompt of N        (0, N, N)
    chunk k of size C        (kC, kC + C, kC + C)      after a cached prefix of kC rows
    decode                   (t, t + 1, t + 1)         one new row: chunked prefill with C = 1
    verify k proposals       (t, t + 1 + k, t + 1 + k) the last token and k proposed ones (speculative decoding),
                                                       every row sampled

The rows are laid end to end in one flat [T, d] tensor, decodes first. A row is sampled
only where a request's prompt is complete: a decode, or the chunk that ends a prompt (or, after a
preemption, the chunk that ends its recompute). Each chunk carries its request's block table after this
iteration's growth (serve/block_manager.py): the plan alone says where every row's K,V go and come from.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ScheduledRequest:
    request: int  # request id
    q_start: int
    q_end: int
    decode: bool  # the prompt was complete before this iteration (one row, one new token)
    sample: bool  # this chunk's last row yields the request's next token
    blocks: tuple[int, ...] = ()  # the request's block table: position t lives in block blocks[t // block_size]
    spec: tuple[int, ...] = ()  # a decode's proposed tokens, verified in rows 1.. of the chunk (each row sampled)
    # KV eviction (serve/eviction.py): (sink, window), the keys each query reads (layers/attention/eviction.visible);
    # freed blocks are EVICTED (-1) in `blocks`. None: every key up to the query
    window: tuple[int, int] | None = None
    scored: bool = False  # kv_eviction h2o: the step adds up each key's attention (layers/attention/backends.py)
    q_rows: int = field(init=False, compare=False)  # q_end - q_start
    kv_length: int = field(init=False, compare=False)  # q_end: the positions attended to

    def __post_init__(self):
        object.__setattr__(self, "q_rows", self.q_end - self.q_start)
        object.__setattr__(self, "kv_length", self.q_end)

    @property
    def triple(self) -> tuple[int, int, int]:
        return (self.q_start, self.q_end, self.kv_length)


@dataclass(frozen=True)
class SchedulerOutput:
    index: int
    scheduled: tuple[ScheduledRequest, ...]  # decodes first, then prompt chunks, in row order
    admitted: tuple[int, ...] = ()  # requests that joined the running set at this iteration
    preempted: tuple[int, ...] = ()  # requests that gave their blocks back at this iteration, to recompute later
    prefix_hits: int = 0  # prompt tokens whose K,V the requests admitted now found in the prefix cache (or a tier)
    # what a KV connector's worker side does this step (serve/kv_connector/ build_connector_meta)
    kv_connector_metadata: object = field(default=None, compare=False)
    # derived once, when the plan is made:
    spans: list[tuple[int, int]] = field(init=False, compare=False)  # each chunk's rows in the flat tensor
    rows: int = field(init=False, compare=False)  # rows through the model
    sample_rows: list[int] = field(init=False, compare=False)  # rows whose logits give a token: a chunk's last row,
    #                                                            or every row of a verified chunk

    def __post_init__(self):
        spans, start = [], 0
        for c in self.scheduled:
            spans.append((start, start + c.q_rows))
            start += c.q_rows
        object.__setattr__(self, "spans", spans)
        object.__setattr__(self, "rows", start)
        object.__setattr__(self, "sample_rows", [r for c, (s, e) in zip(self.scheduled, spans) if c.sample
                                                 for r in (range(s, e) if c.spec else (e - 1,))])

    @property
    def decodes(self) -> int:
        return sum(c.decode for c in self.scheduled)

    @property
    def prefill_chunks(self) -> int:
        return sum(not c.decode for c in self.scheduled)

    def score_entries(self) -> int:
        """Visible Q·Kᵀ entries, one head, one layer: per request q_rows·q_start (the cached prefix) plus the
        chunk's own causal triangle q_rows(q_rows+1)/2 (SDPA with a mask computes the whole rectangle,
        q_rows·kv_length, and discards the rest)."""
        return sum(c.q_rows * c.q_start + c.q_rows * (c.q_rows + 1) // 2 for c in self.scheduled)

    def cache_rows_read(self) -> int:
        """Cached rows re-read (the prefix written by earlier iterations): q_start per request."""
        return sum(c.q_start for c in self.scheduled)

    def fingerprint(self) -> list[float]:
        """Four numbers that differ, with overwhelming likelihood, when two ranks planned differently (rows or
        block tables)."""
        n = len(self.scheduled)
        tables = sum((i + 1) * sum((j + 1) * b for j, b in enumerate(c.blocks)) for i, c in enumerate(self.scheduled))
        return [float(self.index * 1_000_003 + n), float(sum((i + 1) * c.request for i, c in enumerate(self.scheduled))),
                float(sum((i + 1) * c.q_start + c.sample for i, c in enumerate(self.scheduled)) + 7 * tables),
                float(sum((i + 7) * c.q_end + 3 * c.decode + 11 * sum(c.spec) for i, c in enumerate(self.scheduled)))]


FINGERPRINT_SIZE = 4
