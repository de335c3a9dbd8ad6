"""Each rank's KV cache: one pool of blocks, allocated once, holding K and V of the rank's own heads only.

    pool on rank s:  [L, 2, num_gpu_blocks_override · block_size, heads, d_head]     (layer, K|V, slot, head, dim)
                     heads = h/p (GPT-2), max(h_kv/p, 1) (Llama's grouped-query attention)
                     MLA (layers/models/mla.py): [L, 1, slots, 1, c + r], one latent plane, whole on every rank

A slot is one token position of one block: block b's positions are slots [b·block_size, (b+1)·block_size). Which
blocks a request holds is decided on the host (serve/block_manager.py; docs/serving.md, "Paged KV cache"); the pool
only stores, exactly 1/p of the dense cache, because head-aligned TP gives each rank h/p whole heads.

kv_cache_dtype fp8_e4m3 / fp8_e5m2 / int8 (docs/kv_quant.md): the same layout holding one-byte codes, and beside it
float32 scales [L, planes, heads] (layers/attention/kv_quant.py).

The pool starts zeroed, not empty: batched attention gathers padding keys from slot 0 and masks them, and a
masked score is still computed first (NaN from uninitialized memory would survive the mask).
"""

from __future__ import annotations

import torch

from layers.attention.attention import PagedBatch, PagedLayer
from layers.attention.kv_quant import QuantizedPool, storage_dtype
from layers.models.families import of
from tp import partition


def kv_bytes_per_token(n_layers: int, heads: int, d_head: int, dtype: torch.dtype) -> int:
    """K and V of `heads` heads in every layer, for one token (tp/partition.py's formula, in a dtype)."""
    return partition.kv_bytes_per_token(n_layers, heads, d_head, dtype.itemsize)


class KVPool:
    def __init__(self, n_layers: int, num_blocks: int, block_size: int, heads: int, d_head: int,
                 dtype: torch.dtype, device=None, planes: int = 2, cache_dtype: str = "auto",
                 calculate_scales: bool = True):
        """dtype: the model's (what attention reads); cache_dtype: what the pool stores (auto: dtype)."""
        self.n_layers, self.num_blocks, self.block_size, self.heads, self.d_head = \
            n_layers, num_blocks, block_size, heads, d_head
        self.dtype, self.device, self.planes = dtype, device, planes  # planes: K and V (2), or MLA's one latent
        self.cache_dtype = cache_dtype
        stored = dtype if cache_dtype == "auto" else storage_dtype(cache_dtype)
        self.kv = torch.zeros(n_layers, planes, num_blocks * block_size, heads, d_head, dtype=stored, device=device)
        self.quant = None if cache_dtype == "auto" else \
            QuantizedPool(n_layers, planes, heads, cache_dtype, device, calculate_scales)
        # what each layer's attention reads and writes: a view of the pool, or the view and its scales (quantized)
        self.pools = [self.kv[layer] if self.quant is None else self.quant.layer(self.kv[layer], layer, dtype)
                      for layer in range(n_layers)]

    @classmethod
    def for_model(cls, lm, num_blocks: int, block_size: int, dtype: torch.dtype, device=None,
                  cache_dtype: str = "auto", calculate_scales: bool = True) -> "KVPool":
        """The pool a TP model's layers cache into: lm.cache_layout (planes, heads, width) per layer."""
        planes, heads, width = lm.cache_layout
        return cls(lm.cfg.n_layers, num_blocks, block_size, heads, width, dtype, device, planes, cache_dtype,
                   calculate_scales)

    @staticmethod
    def block_bytes(lm, block_size: int, dtype: torch.dtype, cache_dtype: str = "auto") -> int:
        """The bytes one block of block_size positions takes in this rank's pool for lm (kv_cache_memory_bytes
        divides by it)."""
        return layout_block_bytes(lm.cfg.n_layers, lm.cache_layout, block_size, dtype, cache_dtype)

    @property
    def bytes(self) -> int:
        """Bytes this rank's pool holds for K,V (reserved once, used or not); a quantized pool's scales are
        scale_bytes beside them."""
        return self.kv.numel() * self.kv.element_size()

    @property
    def scale_bytes(self) -> int:
        return 0 if self.quant is None else self.quant.scales.numel() * self.quant.scales.element_size()

    @property
    def bytes_per_block(self) -> int:
        return self.bytes // self.num_blocks

    def measured_bytes_per_token(self) -> float:
        """What the pool tensor holds per token position: its bytes / its slots."""
        return self.bytes / self.kv.shape[2]

    def layers(self, batch: PagedBatch) -> list[PagedLayer]:
        """What attention reads in each layer of one iteration: the shared batch and that layer's pool."""
        return [PagedLayer(batch, pool) for pool in self.pools]

    def read(self, slots: torch.Tensor, heads: slice, layer: int | None = None) -> torch.Tensor:
        """K,V at `slots` (a request's positions, in order) of `heads`: [L, 2, heads, n, dh], or [2, heads, n, dh]
        for one layer (the P/D hand-over's message layout)."""
        kv = self.kv if layer is None else self.kv[layer]
        return kv[..., slots, heads, :].transpose(-3, -2).contiguous()

    def write(self, slots: torch.Tensor, heads: slice, values: torch.Tensor, layer: int | None = None) -> None:
        """The inverse of `read`: values [L, 2, heads, n, dh] (or [2, heads, n, dh]) into `slots`."""
        kv = self.kv if layer is None else self.kv[layer]
        kv[..., slots, heads, :] = values.transpose(-3, -2)


def cache_layout_of(cfg, p: int) -> tuple[int, int, int]:
    """(planes, heads, width) of a TP rank's cache for a model config at tensor-parallel size p, what the rank's
    lm.cache_layout says once built (the driver sizes with it before any rank starts): K and V of max(h_kv/p, 1)
    heads, or MLA's one latent of c + r, whole on every rank."""
    return of(cfg).cache_layout(cfg, p)


def layout_block_bytes(n_layers: int, layout: tuple[int, int, int], block_size: int, dtype: torch.dtype,
                       cache_dtype: str = "auto") -> int:
    """One block's bytes: n_layers · planes · block_size · heads · width · e (e = 1 for a quantized cache)."""
    planes, heads, width = layout
    return n_layers * planes * block_size * heads * width * (dtype.itemsize if cache_dtype == "auto" else 1)
