"""KV cache eviction (docs/eviction.md): which cached positions a request's later queries no longer read, and the
blocks that frees.

    LLM(model, kv_eviction={"policy": "streaming", "sink_tokens": 4, "window_tokens": 256})

streaming (StreamingLLM, Xiao et al. 2023): a query at position i reads the keys of positions j <= i with j < sink
or j > i - window: the first `sink_tokens` positions (the attention sinks) and the last `window_tokens`, itself
included. Positions are the original ones (a token keeps the position it was computed at): GPT-2's learned
positions are added to the input, so a kept token's K,V cannot be moved to another position without recomputing
it, and for RoPE the two choices differ only in the distance from a query to the sinks (docs/eviction.md). A
request's sequence is therefore bounded by the model's context, as without eviction.

The rule is per query, so the tokens do not depend on how a prompt is chunked; a block is freed once every position
in it is out of every later query's window (no later query can read it) and holds no sink. The decision depends on
positions only: every rank, every TP size, makes it alike with no communication.

Host only, no torch: the scheduler asks `evictable` after each iteration and the block manager frees.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tp.partition import ceil_div

POLICIES = ("streaming",)


@dataclass(frozen=True)
class KVEvictionConfig:
    policy: str
    sink_tokens: int = 4  # StreamingLLM's four
    window_tokens: int | None = None  # required: the recent positions each query reads, itself included

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"kv_eviction policy={self.policy!r}: choose {' or '.join(POLICIES)}")
        if self.window_tokens is None:
            raise ValueError("kv_eviction policy='streaming' needs window_tokens: the recent positions each query "
                             "reads, e.g. 256")
        for name in ("sink_tokens", "window_tokens"):
            v = getattr(self, name)
            low = 0 if name == "sink_tokens" else 1
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"kv_eviction {name}={v!r} must be an integer of at least {low}")

    @classmethod
    def of(cls, value) -> "KVEvictionConfig | None":
        """None, a KVEvictionConfig, or its dict ({"policy": "streaming", "sink_tokens": 4, "window_tokens": 256})."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"kv_eviction must be a dict like {{'policy': 'streaming', 'sink_tokens': 4, "
                             f"'window_tokens': 256}}, not {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"kv_eviction: unknown key {unknown[0]!r}; known: {', '.join(sorted(known))}")
        if "policy" not in value:
            raise ValueError("kv_eviction needs a policy: 'streaming'")
        return cls(**value)

    def check(self, block_size: int) -> None:
        """The rule against the block size: a window of less than a block would free nothing the window leaves."""
        if self.window_tokens < block_size:
            raise ValueError(f"kv_eviction window_tokens={self.window_tokens} is smaller than a block "
                             f"(block_size={block_size}): a block is freed only when the window has left all of it; "
                             f"use window_tokens >= {block_size}")

    @property
    def window(self) -> tuple[int, int]:
        """(sink, window): the attention rule every backend applies (layers/attention/backends.py visible)."""
        return self.sink_tokens, self.window_tokens

    def evictable(self, computed: int, block_size: int) -> range:
        """The logical blocks no later query reads once `computed` positions are in the cache: every later query is at
        a position i >= computed and reads keys j > i - window and j < sink, so a block whose last position is
        <= computed - window and whose first is >= sink is read by none."""
        first = ceil_div(self.sink_tokens, block_size)  # blocks holding a sink stay
        return range(first, max(first, (computed - self.window_tokens + 1) // block_size))

    def peak_blocks(self, block_size: int, chunk: int) -> int:
        """The most blocks a request holds at once: its sink blocks, and the blocks of one iteration's rows (at most
        `chunk`) with the window before the first of them."""
        return ceil_div(self.sink_tokens, block_size) + ceil_div(self.window_tokens - 1 + chunk, block_size) + 1
