"""KV eviction's attention rule (serve/eviction.py decides which blocks go; docs/eviction.md): which cached keys a
query may still read.

    streaming (sink, window)   query at position i reads key j iff j <= i and (j < sink or j > i - window)

Positions are the original ones (serve/eviction.py says why). `visible` is the rule as a mask, applied by every
attention backend over the keys it gathered (layers/attention/backends.py); `streaming_reference` applies it to
attention without a cache: the dense model recomputed with StreamingLLM's mask, the oracle of the paged engine with
blocks freed (tests/test_eviction.py, launch/serve.py's check, LLM(check=True)).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, sink: int, window: int) -> torch.Tensor:
    """[..., q, k] booleans: query at q_pos[..., q] reads the key at k_pos[..., k] (a padding key's position past every
    query is never read)."""
    q, k = q_pos[..., :, None], k_pos[..., None, :]
    return (k <= q) & ((k < sink) | (k > q - window))


_REFERENCE: list[tuple[int, int]] = []  # the active streaming_reference contexts (innermost last)


@contextmanager
def streaming_reference(window: tuple[int, int] | None):
    """Within it, attention without a cache (layers/attention/attention.attention over one sequence) reads the keys
    `visible` leaves a query under window = (sink, window tokens); None: the plain causal square."""
    if window is not None:
        _REFERENCE.append(window)
    try:
        yield
    finally:
        if window is not None:
            _REFERENCE.pop()


def reference_mask(n: int, device=None) -> torch.Tensor | None:
    """[n, n]: the mask of one sequence of n positions inside streaming_reference, else None (causal)."""
    if not _REFERENCE:
        return None
    pos = torch.arange(n, device=device)
    return visible(pos, pos, *_REFERENCE[-1])
