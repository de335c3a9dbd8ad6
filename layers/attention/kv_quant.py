"""A quantized KV cache: K,V stored as fp8 (e4m3, e5m2) or int8 codes with one float32 scale per layer, plane (K or
V) and K,V head; quantized on write, dequantized on read, in every attention backend.

    kv_cache_dtype   stored as                   largest code   bytes per value
    auto             the model's dtype           -              e (4 in float32, 2 in bfloat16)
    fp8_e4m3         float8_e4m3fn (its bits)    448            1
    fp8_e5m2         float8_e5m2 (its bits)      57344          1
    int8             int8, symmetric, rounded    127            1

    code = quantize(x / scale)        x ≈ code · scale        scale = HEADROOM · amax / largest code

The scales live beside the codes, [L, planes, h_kv] on each rank for its own heads (head-aligned TP: a rank never
needs another's). They are set from the first prefill each layer sees (the amax of its K and of its V per head,
with HEADROOM for later prompts of a wider range; beyond it a value is clipped to the largest code) or given
(`QuantizedPool.set_scales`; `calculate_kv_scales=False`: 1.0, vLLM's default without calibrated scales), and fixed
from then on: every request, prefix hit, preemption and recompute reads the same codes the same way.

Every key and value a query attends to is the cache's round trip dequantize(quantize(·)), the new rows of the
iteration included (layers/attention/attention.paged_attention applies it before the backend runs), so a prompt attends
the same whether its prefix came from the cache or was computed in this step: the pseudo-quantized reference is plain
attention on round-tripped K,V (tests/test_kv_quant.py). Statistics and the dequantized values are float32 at
least (float64 for a float64 model); the attention then runs in the model's dtype.

fp8 codes are kept as their bits (uint8: the CPU has no scatter or gather for float8 tensors) and viewed as float8
to decode; a GPU kernel would read them as they are.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

CODES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}
LARGEST = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0, "int8": 127.0}
HEADROOM = 2.0  # the first prefill's amax maps to half the largest code: later prompts may range twice as wide
TINY = 1e-12  # an all-zero head still gets a positive scale


def storage_dtype(name: str) -> torch.dtype:
    """What the pool tensor holds for a quantized cache: int8, or float8's bits as uint8."""
    return torch.int8 if name == "int8" else torch.uint8


def scales_from(kv: torch.Tensor, name: str) -> torch.Tensor:
    """[planes, h_kv] float32 scales for kv [planes, h_kv, T, d]: HEADROOM · amax per plane and head / largest code."""
    amax = kv.detach().abs().to(torch.float32).amax(dim=(-2, -1))
    return (amax * HEADROOM / LARGEST[name]).clamp_min(TINY)


def quantize(x: torch.Tensor, scale: torch.Tensor, name: str) -> torch.Tensor:
    """Codes of x [planes, n, h_kv, d] (the pool's layout) with scale [planes, h_kv], in the pool's storage dtype."""
    acc = torch.promote_types(x.dtype, torch.float32)
    y = x.to(acc) / scale[:, None, :, None].to(acc)
    if name == "int8":
        return y.round().clamp_(-127, 127).to(torch.int8)
    top = LARGEST[name]
    return y.clamp_(-top, top).to(CODES[name]).view(torch.uint8)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, name: str, dtype: torch.dtype) -> torch.Tensor:
    """x ≈ code · scale, [planes, n, h_kv, d] in dtype (computed in float32 at least)."""
    values = codes if name == "int8" else codes.view(CODES[name])
    acc = torch.promote_types(dtype, torch.float32)
    return (values.to(acc) * scale[:, None, :, None].to(acc)).to(dtype)


def round_trip(kv: torch.Tensor, scale: torch.Tensor, name: str) -> torch.Tensor:
    """dequantize(quantize(kv)) for kv [planes, h_kv, T, d] (attention's layout): what the cache will give back."""
    rows = kv.transpose(1, 2)  # [planes, T, h_kv, d]
    return dequantize(quantize(rows, scale, name), scale, name, kv.dtype).transpose(1, 2)


@dataclass
class QuantizedLayer:
    """One layer's quantized cache, as the attention backends see it: codes [planes, slots, h_kv, d] in the storage
    dtype, scale [planes, h_kv] float32 (a view of the pool's), the cache dtype's name, the dtype values are read
    in, and the pool that records whether this layer's scales are set."""

    codes: torch.Tensor
    scale: torch.Tensor
    name: str
    dtype: torch.dtype
    owner: "QuantizedPool"
    layer: int

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def prepare(self, kv: torch.Tensor) -> torch.Tensor:
        """Before this layer's backend runs: its scales from this first prefill if none are set yet, then the new
        rows' round trip (what every query of the iteration attends to)."""
        if not self.owner.scaled[self.layer]:
            self.scale.copy_(scales_from(kv, self.name))
            self.owner.scaled[self.layer] = True
        return round_trip(kv, self.scale, self.name)

    def store(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """rows [planes, n, h_kv, d] into `slots`, quantized."""
        self.codes.index_copy_(1, slots, quantize(rows, self.scale, self.name))

    def load(self, slots: torch.Tensor) -> torch.Tensor:
        """[planes, n, h_kv, d] at `slots`, dequantized."""
        return dequantize(self.codes.index_select(1, slots), self.scale, self.name, self.dtype)

    def blocks(self, block_size: int, blocks: torch.Tensor) -> torch.Tensor:
        """[planes, len(blocks) · block_size, h_kv, d]: whole blocks, in order, dequantized."""
        planes, _, h_kv, d = self.codes.shape
        by_block = self.codes.view(planes, -1, block_size, h_kv, d).index_select(1, blocks).flatten(1, 2)
        return dequantize(by_block, self.scale, self.name, self.dtype)


class QuantizedPool:
    """The scales of a pool's quantized layers: [L, planes, h_kv] float32, and which layers have them set."""

    def __init__(self, n_layers: int, planes: int, heads: int, name: str, device=None, calculate: bool = True):
        self.name = name
        self.scales = torch.ones(n_layers, planes, heads, dtype=torch.float32, device=device)
        self.scaled = [not calculate] * n_layers  # calculate_kv_scales=False: 1.0 from the start

    def set_scales(self, scales: torch.Tensor) -> None:
        """Given scales [L, planes, h_kv] (this rank's heads): used from the next write on, none computed."""
        if tuple(scales.shape) != tuple(self.scales.shape):
            raise ValueError(f"scales of shape {tuple(scales.shape)}, the pool has {tuple(self.scales.shape)}")
        self.scales.copy_(scales)
        self.scaled = [True] * len(self.scaled)

    def layer(self, codes: torch.Tensor, layer: int, dtype: torch.dtype) -> QuantizedLayer:
        return QuantizedLayer(codes, self.scales[layer], self.name, dtype, self, layer)


# The pseudo-quantized reference: a model without a cache (the dense oracle) attending to round-tripped K,V.

_REFERENCE: list[dict] = []  # the active pseudo_quantized contexts (innermost last)


@contextmanager
def pseudo_quantized(scales: torch.Tensor, name: str):
    """Within it, attention without a cache (layers/attention/attention.attention, MLA's decompressed path) attends to
    round_trip(K,V) with scales [L, planes, h_kv] (every head of the whole model): layer l of each forward takes
    scales[l], layers counted in the order they attend. What a quantized cache gives, computed without one: the
    oracle of launch/serve.py's check and of tests/test_kv_quant.py."""
    _REFERENCE.append({"scales": scales, "name": name, "calls": 0})
    try:
        yield
    finally:
        _REFERENCE.pop()


def reference_round_trip(kv: torch.Tensor) -> torch.Tensor:
    """kv [planes, h_kv, T, d] as a quantized cache would give it back, inside pseudo_quantized (else kv itself)."""
    if not _REFERENCE:
        return kv
    state = _REFERENCE[-1]
    layer = state["calls"] % state["scales"].shape[0]
    state["calls"] += 1
    return round_trip(kv, state["scales"][layer].to(kv.device), state["name"])


def gather_scales(scales: torch.Tensor, layers: range, heads: range, n_layers: int, n_heads: int, group) -> torch.Tensor:
    """Every rank's scales [len(layers), planes, len(heads)] (its pipeline stage's layers, its K,V heads) put
    together, on every rank of group: [n_layers, planes, n_heads], for pseudo_quantized (one gather of Python
    objects, after serving: not an iteration's collective)."""
    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, (layers, heads, scales.cpu()), group=group)
    full = torch.full((n_layers, scales.shape[1], n_heads), float("nan"))
    for rows, cols, part in parts:
        full[rows.start:rows.stop, :, cols.start:cols.stop] = part
    return full
