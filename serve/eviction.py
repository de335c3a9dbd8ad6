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

from dataclasses import dataclass

from serve.nested_config import nested_config
from tp.partition import ceil_div

POLICIES = ("streaming", "h2o")
UNBOUNDED = 1 << 40  # h2o's window: no position rule, only the blocks held


@dataclass(frozen=True)
class KVEvictionConfig:
    policy: str
    sink_tokens: int | None = None  # streaming: the first positions every query reads (StreamingLLM's 4 by default)
    window_tokens: int | None = None  # streaming, required: the recent positions each query reads, itself included
    budget_tokens: int | None = None  # h2o, required: the positions a request holds at most (whole blocks)
    recent_tokens: int | None = None  # h2o: the recent positions always kept (default: half the budget)

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"kv_eviction policy={self.policy!r}: choose {' or '.join(POLICIES)}")
        given = {name for name in ("sink_tokens", "window_tokens", "budget_tokens", "recent_tokens")
                 if getattr(self, name) is not None}
        own = {"streaming": ("sink_tokens", "window_tokens"), "h2o": ("budget_tokens", "recent_tokens")}[self.policy]
        other = sorted(given - set(own))
        if other:
            raise ValueError(f"kv_eviction {other[0]} is not a setting of policy={self.policy!r} (it takes "
                             f"{' and '.join(own)})")
        required = "window_tokens" if self.policy == "streaming" else "budget_tokens"
        if getattr(self, required) is None:
            example = "the recent positions each query reads, e.g. 256" if self.policy == "streaming" else \
                "the positions a request keeps, e.g. 256"
            raise ValueError(f"kv_eviction policy={self.policy!r} needs {required}: {example}")
        for name in own:
            v = getattr(self, name)
            low = 0 if name == "sink_tokens" else 1
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < low):
                raise ValueError(f"kv_eviction {name}={v!r} must be an integer of at least {low}")
        if self.policy == "streaming" and self.sink_tokens is None:
            object.__setattr__(self, "sink_tokens", 4)
        if self.policy == "h2o" and self.recent_tokens is None:
            object.__setattr__(self, "recent_tokens", self.budget_tokens // 2)

    @classmethod
    def of(cls, value) -> "KVEvictionConfig | None":
        """None, a KVEvictionConfig, or its dict ({"policy": "streaming", "sink_tokens": 4, "window_tokens": 256})."""
        return nested_config(cls, value, "kv_eviction",
                             "{'policy': 'streaming', 'sink_tokens': 4, 'window_tokens': 256}", "policy", POLICIES)

    def check(self, block_size: int) -> None:
        """The rules against the block size: whole blocks are what is freed."""
        if self.policy == "streaming" and self.window_tokens < block_size:
            raise ValueError(f"kv_eviction window_tokens={self.window_tokens} is smaller than a block "
                             f"(block_size={block_size}): a block is freed only when the window has left all of it; "
                             f"use window_tokens >= {block_size}")
        if self.policy == "h2o":
            if self.recent_tokens < block_size:
                raise ValueError(f"kv_eviction recent_tokens={self.recent_tokens} is smaller than a block "
                                 f"(block_size={block_size}): the block being written is always recent; use "
                                 f"recent_tokens >= {block_size}")
            if self.budget_tokens < self.recent_tokens + block_size:
                raise ValueError(f"kv_eviction budget_tokens={self.budget_tokens} leaves no block for heavy hitters "
                                 f"beside recent_tokens={self.recent_tokens}: use budget_tokens >= "
                                 f"{self.recent_tokens + block_size} (block_size={block_size})")

    @property
    def window(self) -> tuple[int, int]:
        """(sink, window): the attention rule every backend applies (layers/attention/eviction.visible); h2o has
        none beyond the blocks still held."""
        return (self.sink_tokens, self.window_tokens) if self.policy == "streaming" else (0, UNBOUNDED)

    @property
    def scored(self) -> bool:
        """Whether the policy needs each block's attention (h2o: the attention backends add it up every step)."""
        return self.policy == "h2o"

    def evictable(self, computed: int, block_size: int) -> range:
        """streaming: the logical blocks no later query reads once `computed` positions are in the cache: every later
        query is at a position i >= computed and reads keys j > i - window and j < sink, so a block whose last
        position is <= computed - window and whose first is >= sink is read by none."""
        first = ceil_div(self.sink_tokens, block_size)  # blocks holding a sink stay
        return range(first, max(first, (computed - self.window_tokens + 1) // block_size))

    def to_evict(self, table: list[int], computed: int, block_size: int, scores: list[float] | None,
                 evicted: int = -1) -> list[int]:
        """The logical blocks a request gives back after an iteration, `computed` positions in its cache.
        streaming: evictable(). h2o (Zhang et al. 2023, at block granularity): while the request holds more than
        budget_tokens // block_size blocks, the held block with the least accumulated attention (scores: summed over
        every query so far, every head of every rank, every layer; ties to the oldest) that holds no recent position
        (one > computed - recent_tokens - 1)."""
        if self.policy == "streaming":
            return list(self.evictable(computed, block_size))
        held = [b for b in range(ceil_div(computed, block_size)) if table[b] != evicted]
        over = len(held) - self.budget_tokens // block_size
        if over <= 0:
            return []
        old = [b for b in held if (b + 1) * block_size <= computed - self.recent_tokens]
        scores = scores or []
        old.sort(key=lambda b: (scores[b] if b < len(scores) else 0.0, b))
        return sorted(old[:over])

    def peak_blocks(self, block_size: int, chunk: int) -> int:
        """The most blocks a request holds at once: streaming, its sink blocks and the blocks of one iteration's rows
        (at most `chunk`) with the window before the first of them; h2o, its budget and one iteration's rows."""
        if self.policy == "h2o":  # its budget (or its recent blocks, one more at most), then the chunk's rows
            return self.budget_tokens // block_size + 1 + ceil_div(chunk, block_size) + 1
        return ceil_div(self.sink_tokens, block_size) + ceil_div(self.window_tokens - 1 + chunk, block_size) + 1
