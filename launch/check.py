"""What every rank does in launch/run_block.py: build the dense stack, then for each variant shard it and
run the four jobs, one file each:

    launch/equivalence.py   every layer against the single-device stack (and CommDebugMode's counts)
    launch/traffic.py       the traffic ledger against the analytic model; per-collective times
    launch/profiling.py     a profiler trace parsed back against the ledger (profile=true)
    launch/shards.py        what each rank holds
"""

from __future__ import annotations

from pathlib import Path

import torch

from launch.equivalence import compare_layers
from launch.profiling import profile_variant
from launch.shards import shard_rows
from launch.traffic import measure_traffic
from layers.config import ModelConfig
from layers.llama import LlamaConfig
from layers.dense import DenseStack, init_weights, weights_checksum
from layers.hf import load_stack
from layers.tp_block import shard_stack
from layers.varlen import Requests, check_same_on_every_rank
from tp.dist import TPContext, same_on_every_rank


def run_check(cfg: ModelConfig | LlamaConfig, *, lengths: list[int], dtype: torch.dtype, seed: int, variants: list[str],
              tolerance: float, repeats: int, profile_dir: Path | None, ctx: TPContext,
              weights: dict[str, torch.Tensor] | None = None) -> dict:
    """lengths: the requests flattened into one forward; one entry means one plain sequence.
    weights: a checkpoint's state dict (GPT-2 or Llama, as cfg) to load instead of the seeded random weights."""
    requests = Requests.from_lengths(lengths) if len(lengths) > 1 else None
    cu_seqlens = requests.cu_seqlens if requests else None
    dense = init_weights(DenseStack(cfg, dtype, ctx.device), seed)
    if weights is not None:
        load_stack(dense, weights)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(sum(lengths), cfg.d_model, generator=gen, dtype=torch.float64).to(ctx.device, dtype)
    fingerprint = torch.cat([weights_checksum(dense), x.detach().to("cpu", torch.float64).sum().reshape(1)])
    if not same_on_every_rank(fingerprint.to(ctx.device), ctx.group):
        raise RuntimeError("ranks hold different dense weights or inputs (seed or library mismatch); "
                           "every rank must build the same model")
    if cu_seqlens:
        check_same_on_every_rank(cu_seqlens, ctx.group)
    with torch.no_grad():  # the reference: each request alone through the single-device stack
        alone = [dense(x[s:e]) for s, e in (requests.spans if requests else [(0, x.shape[0])])]
        reference = tuple(torch.cat(outs) for outs in zip(*alone))
    results = {}
    for v in variants:
        stack = shard_stack(dense, v, ctx.group)
        layers, per_request = compare_layers(stack, x, reference, requests, ctx, tolerance)
        traffic = measure_traffic(stack, x, cu_seqlens, cfg, v, ctx, repeats)
        for layer, t in zip(layers, traffic.pop("layers")):
            layer.update(t)
        results[v] = {
            "requests": per_request,
            "layers": layers,
            "max_abs_err": max(layer["max_abs_err"] for layer in layers),
            "max_rel_err": max(layer["max_rel_err"] for layer in layers),
            "equivalent": all(layer["equivalent"] for layer in layers),
            **traffic,
            "shards": shard_rows(stack, v, ctx),
        }
        if profile_dir is not None:
            results[v]["profile"] = profile_variant(stack, x, cu_seqlens, v, ctx, profile_dir)
    return results
