"""Each rank's KV cache: K and V of its own heads only, one contiguous region per request.

    request r on rank s:  [L, 2, h/p, capacity_r, d_head]    (layer, K|V, head, position, dim)
                          GQA (layers/llama.py): max(h_kv/p, 1) K,V heads instead of h/p

allocated when the request is admitted (capacity = prompt + max_new_tokens − 1 positions),
written by attention at [q_start, q_end) (layers/attention.py), freed when it is evicted.
Per layer per token a rank holds 2·(h/p)·d_head·e bytes: exactly 1/p of the dense cache,
because head-aligned TP gives each rank h/p whole heads (SPEC §6). seeds/05's engine keeps one
contiguous region per request per layer; paging is a later refinement.
"""

from __future__ import annotations

import torch

from layers.attention import CachedRequests


def kv_bytes_per_token(n_layers: int, heads: int, d_head: int, dtype: torch.dtype) -> int:
    """K and V of `heads` heads in every layer, for one token."""
    return n_layers * 2 * heads * d_head * dtype.itemsize


class KVCache:
    def __init__(self, n_layers: int, heads: int, d_head: int, dtype: torch.dtype, device=None):
        self.n_layers, self.heads, self.d_head = n_layers, heads, d_head
        self.dtype, self.device = dtype, device
        self.regions: dict[int, torch.Tensor] = {}
        self.peak_bytes = 0
        self.peak_tokens = 0  # token positions (capacity) held at the peak

    def allocate(self, request: int, capacity: int) -> None:
        if request in self.regions:
            raise ValueError(f"request {request} already has a cache region")
        # empty, not zeros: attention reads positions [0, kv_length) only, every one written before it is read
        self.regions[request] = torch.empty(self.n_layers, 2, self.heads, capacity, self.d_head,
                                            dtype=self.dtype, device=self.device)
        if self.bytes() > self.peak_bytes:
            self.peak_bytes, self.peak_tokens = self.bytes(), sum(t.shape[3] for t in self.regions.values())

    def free(self, request: int) -> None:
        del self.regions[request]

    def bytes(self) -> int:
        """Bytes held now, on this rank."""
        return sum(t.numel() * t.element_size() for t in self.regions.values())

    def measured_bytes_per_token(self) -> float:
        """What the allocations held per token position at the peak: peak bytes / peak capacity (0 if none)."""
        return self.peak_bytes / self.peak_tokens if self.peak_tokens else 0.0

    def layers(self, spans, q_starts, requests) -> list[CachedRequests]:
        """What attention needs in each layer for one iteration (spans: rows of each request in the flat tensor)."""
        regions = [self.regions[r] for r in requests]
        return [CachedRequests(tuple(spans), tuple(q_starts), tuple(region[layer] for region in regions))
                for layer in range(self.n_layers)]
