"""Shared pieces of the tests: small configurations and dense models built identically on every rank."""

import torch

from layers.config import DEFAULT_TOLERANCE, ModelConfig
from layers.dense import DenseStack, init_weights

ARTICLE03 = ModelConfig()  # d=512, h=8, d_head=64, ffn=2048, L=8
SMALL = ModelConfig(d_model=64, n_heads=8, d_head=8, d_ffn=256, n_layers=3)

# max |tp - dense| / max |dense| allowed, per dtype (measured: ~3e-7 and ~1e-15 at article03, p <= 8)
REL_TOL = DEFAULT_TOLERANCE


def dense_and_input(cfg: ModelConfig, dtype: torch.dtype, n: int, seed: int = 0):
    dense = init_weights(DenseStack(cfg, dtype), seed)
    x = torch.randn(n, cfg.d_model, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    return dense, x.to(dtype)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def collective_counts(counts: dict) -> dict[str, int]:
    """CommDebugMode's {op: count} as {"all_reduce": n, "all_gather": m}."""
    out: dict[str, int] = {}
    for op, n in counts.items():
        name = str(op)
        kind = "all_reduce" if "allreduce" in name or "all_reduce" in name else (
            "all_gather" if "allgather" in name or "all_gather" in name else name)
        if n:
            out[kind] = out.get(kind, 0) + n
    return out
