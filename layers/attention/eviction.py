"""KV eviction's attention rule (serve/eviction.py decides which blocks go; docs/eviction.md): which cached keys a
query may still read.

    streaming (sink, window)   query at position i reads key j iff j <= i and (j < sink or j > i - window)

Positions are the original ones (serve/eviction.py says why). `visible` is the rule as a mask, applied by every
attention backend over the keys it gathered (layers/attention/backends.py); `streaming_reference` applies it to
attention without a cache: the dense model recomputed with StreamingLLM's mask, the oracle of the paged engine with
blocks freed (tests/test_eviction.py, launch/serve.py's check, LLM(check=True)). h2o's mask follows the engine's
scores: `logged_reference` replays one request's log of what went when.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, sink: int, window: int) -> torch.Tensor:
    """[..., q, k] booleans: query at q_pos[..., q] reads the key at k_pos[..., k] (a padding key's position past every
    query is never read)."""
    q, k = q_pos[..., :, None], k_pos[..., None, :]
    return (k <= q) & ((k < sink) | (k > q - window))


_REFERENCE: list = []  # the active reference masks, n -> [n, n] (innermost last)


@contextmanager
def _masking(mask):
    _REFERENCE.append(mask)
    try:
        yield
    finally:
        _REFERENCE.pop()


@contextmanager
def streaming_reference(window: tuple[int, int] | None):
    """Within it, attention without a cache (layers/attention/attention.attention over one sequence) reads the keys
    `visible` leaves a query under window = (sink, window tokens); None: the plain causal square."""
    if window is None:
        yield
        return

    def mask(n: int, device=None) -> torch.Tensor:
        pos = torch.arange(n, device=device)
        return visible(pos, pos, *window)

    with _masking(mask):
        yield


def logged_reference(log: list, prompt_len: int, block_size: int):
    """kv_eviction h2o, one request: within it, attention without a cache over n positions (the sequence from which
    output token k = n - prompt_len is picked) hides key j from query i when j's block went at a step that had
    computed <= i positions, in the admission that computed token k. log: Request.evictions, per admission (outputs
    it had, the first position it computed, [(block, computed when it went)])."""
    def mask(n: int, device=None) -> torch.Tensor:
        k = n - prompt_len
        gone = next((g for start, _, g in reversed(log) if start <= k), [])
        at = torch.full((n,), n, device=device)  # when each key went (n: it did not)
        for b, t in gone:
            at[b * block_size:(b + 1) * block_size] = torch.clamp(at[b * block_size:(b + 1) * block_size], max=t)
        i, j = torch.arange(n, device=device)[:, None], torch.arange(n, device=device)[None, :]
        return (j <= i) & (at[None, :] > i)

    return _masking(mask)


def reference_mask(n: int, device=None) -> torch.Tensor | None:
    """[n, n]: the mask of one sequence of n positions inside a reference context, else None (causal)."""
    return _REFERENCE[-1](n, device) if _REFERENCE else None
