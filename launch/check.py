"""What every rank does in launch/run_block.py: build the dense stack, then for each variant shard it and
run the five jobs, one file each:

    launch/equivalence.py   every layer against the single-device stack (and CommDebugMode's counts)
    launch/traffic.py       the traffic ledger against the analytic model; per-collective times
    launch/profiling.py     a profiler trace parsed back against the ledger (profile=true)
    launch/shards.py        what each rank holds
    launch/memory.py        the activations saved for backward per layer, beside tp/memory_model.py
"""

from __future__ import annotations

from pathlib import Path

import torch

import torch.distributed as dist

from launch.equivalence import compare_layers
from launch.memory import saved_bytes_per_layer
from launch.profiling import profile_variant
from launch.shards import shard_rows
from launch.traffic import measure_traffic
from layers.attention.varlen import Requests, check_same_on_every_rank
from layers.models.config import ModelConfig
from layers.models.dense import DenseStack, init_weights, weights_checksum
from layers.models.hf import load_stack
from layers.models.llama import LlamaConfig
from layers.models.tp_block import shard_stack
from tp.dist import TPContext, same_on_every_rank
from tp.memory_model import activation_bytes_per_layer


def run_check(cfg: ModelConfig | LlamaConfig, *, lengths: list[int], dtype: torch.dtype, seed: int, variants: list[str],
              tolerance: float, repeats: int, profile_dir: Path | None, ctx: TPContext,
              weights: dict[str, torch.Tensor] | None = None) -> dict:
    """lengths: the requests flattened into one forward; one entry means one plain sequence.
    weights: a checkpoint's state dict (GPT-2 or Llama, as cfg) to load instead of the seeded random weights."""
    requests = Requests.from_lengths(lengths) if len(lengths) > 1 else None
    cu_seqlens = requests.cu_seqlens if requests else None
    dense, x = dense_and_input(cfg, sum(lengths), dtype, seed, ctx, weights)
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
        results[v]["activation_memory"] = activation_memory(stack, x, cfg, v, ctx)
        if profile_dir is not None:
            results[v]["profile"] = profile_variant(stack, x, cu_seqlens, v, ctx, profile_dir)
    return results


def dense_and_input(cfg, n_tokens: int, dtype: torch.dtype, seed: int, ctx: TPContext,
                    weights: dict[str, torch.Tensor] | None = None) -> tuple[DenseStack, torch.Tensor]:
    """The single-device stack (seeded, or the checkpoint's weights) and the input [n_tokens, d], the same on every
    rank (checked: a fingerprint of both compared across the group)."""
    dense = init_weights(DenseStack(cfg, dtype, ctx.device), seed)
    if weights is not None:
        load_stack(dense, weights)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(n_tokens, cfg.d_model, generator=gen, dtype=torch.float64).to(ctx.device, dtype)
    fingerprint = torch.cat([weights_checksum(dense), x.detach().to("cpu", torch.float64).sum().reshape(1)])
    if not same_on_every_rank(fingerprint.to(ctx.device), ctx.group):
        raise RuntimeError("ranks hold different dense weights or inputs (seed or library mismatch); "
                           "every rank must build the same model")
    return dense, x


def activation_memory(stack, x: torch.Tensor, cfg, variant: str, ctx: TPContext) -> dict:
    """Bytes saved for backward per layer on every rank (launch/memory.py), for one sequence of all the run's
    tokens, beside tp/memory_model.py's formula where it has one (v2 and v2sp, on the CPU)."""
    mine = saved_bytes_per_layer(stack, x)
    per_rank: list = [None] * ctx.world_size
    dist.all_gather_object(per_rank, mine, group=ctx.group)
    out = {"tokens": x.shape[0], "bytes_per_layer_by_rank": per_rank}
    if x.device.type != "cpu":  # CUDA's attention and LayerNorm kernels save other tensors: measured only
        return out
    try:
        formula = activation_bytes_per_layer(cfg, ctx.world_size, x.shape[0], x.dtype, variant)
    except ValueError:
        return out
    return {**out, "formula_bytes_per_layer": formula,
            "matches_formula": all(b == formula for rank in per_rank for b in rank)}
