"""The compute and memory side of the analytic model (SPEC §7; seeds/05 §3, seeds/06 §2-§6).

tp/traffic_model.py predicts the bytes a tensor-parallel block sends; this module
adds what an iteration computes and loads, so one set of formulas answers
"compute- or bandwidth-bound?", "how long?" and "how long to move the KV cache?".

    I = 2Π·T / (w·Π + K_tok·L·B)      FLOPs per byte loaded in one iteration
        Π parameters, w bytes per weight, T tokens in the iteration, B requests,
        L context per request, K_tok KV-cache bytes per context token (all layers)
    R = peak FLOP/s / HBM bytes/s     the ridge: I < R is bandwidth-bound

The seeds write the weight bytes as "2Π" (fp16, w = 2).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    """What the cost formulas need of a model."""

    name: str
    n_params: float  # Π
    n_layers: int
    n_kv_heads: int
    d_head: int
    bytes_per_elem: int = 2  # fp16 weights and KV

    @property
    def weight_bytes(self) -> float:
        return self.bytes_per_elem * self.n_params

    @property
    def kv_bytes_per_token(self) -> int:
        """K_tok: K and V of one context token, summed over all layers."""
        return 2 * self.n_layers * self.n_kv_heads * self.d_head * self.bytes_per_elem


@dataclass(frozen=True)
class Hardware:
    name: str
    flops: float  # sustained FLOP/s
    hbm: float  # bytes/s
    source: str

    @property
    def ridge(self) -> float:
        return self.flops / self.hbm


# Llama-2-7B as seeds/06 §3 uses it: Π ≈ 7·10⁹, 32 layers, 32 heads of 128, fp16.
LLAMA2_7B = Shape("llama2_7b", 7e9, 32, 32, 128)
# H100 SXM as the seeds use it (dense fp16 GEMM they call sustained; HBM3 bandwidth from NVIDIA's spec sheet).
H100 = Hardware("H100", 500e12, 3.35e12, "seeds/06 §2: ~500 TFLOP/s fp16 sustained, 3.35 TB/s HBM3")
# Fabric bandwidths as seeds/06 §6 gives them, bytes/s.
FABRICS = {"NVLink (in node)": 900e9, "NVSwitch fabric": 400e9, "InfiniBand HDR": 50e9, "PCIe Gen5": 64e9}


def intensity(s: Shape, tokens: float, context: float, requests: float) -> float:
    """FLOPs per byte of one iteration: T tokens through the weights, B requests reading L cached tokens each."""
    return 2 * s.n_params * tokens / (s.weight_bytes + s.kv_bytes_per_token * context * requests)


def decode_intensity(s: Shape, batch: int, context: float) -> float:
    """B requests decode one token each (T = B) against contexts of L tokens."""
    return intensity(s, batch, context, batch)


def prefill_intensity(s: Shape, chunk: int, prefix: float) -> float:
    """One request prefills a chunk of C tokens after a cached prefix of S tokens (T = C, B = 1, L = S)."""
    return intensity(s, chunk, prefix, 1)


def crossover_context_x_batch(s: Shape) -> float:
    """L·B at which KV reads weigh as much as the weights: w·Π / K_tok."""
    return s.weight_bytes / s.kv_bytes_per_token


def roofline_time(flops: float, bytes_loaded: float, hw: Hardware) -> float:
    return max(flops / hw.flops, bytes_loaded / hw.hbm)


def kv_transfer_time(s: Shape, tokens: int, bandwidth: float) -> float:
    """Seconds to move `tokens` tokens' KV cache over a link of `bandwidth` bytes/s."""
    return tokens * s.kv_bytes_per_token / bandwidth
