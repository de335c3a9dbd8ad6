"""What every rank does in launch/run_block.py: build, shard, compare, count, measure, profile."""

from __future__ import annotations

import statistics
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

from layers.config import ModelConfig
from layers.dense import DenseStack, init_weights, weights_checksum
from layers.shard import heads_of_rank
from layers.tp_block import TPStack, shard_stack
from tp.dist import TPContext, same_on_every_rank
from tp.ledger import CommRecord, Traffic, TrafficLedger
from tp.trace import backend_events, collectives_by_layer, layer_scopes
from tp.traffic_model import PHASES, predict

LINEARS = ("qkv", "attn_out", "mlp_up", "mlp_down")


def _max_over_ranks(values: list[float], ctx: TPContext) -> list[float]:
    if not values:
        return []
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.group)
    return t.tolist()


def _sync(ctx: TPContext) -> None:
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)


def collective_kind(op) -> str:
    name = str(op)
    if "allreduce" in name or "all_reduce" in name:
        return "all_reduce"
    if "allgather" in name or "all_gather" in name:
        return "all_gather"
    return name.rsplit(".", 1)[-1].strip("_")


# ---- equivalence, with CommDebugMode's count per layer -------------------------------------------


def compare_layers(stack: TPStack, x: torch.Tensor, reference: tuple[torch.Tensor, ...], ctx: TPContext,
                   tol: float) -> list[dict]:
    layers = []
    with torch.no_grad():
        for i, block in enumerate(stack.blocks):
            with CommDebugMode() as comm:
                x = block(x)
            counts = Counter()
            for op, count in comm.get_comm_counts().items():
                counts[collective_kind(op)] += count
            err = torch.stack([(x - reference[i]).abs().max(), reference[i].abs().max()]).to(torch.float64)
            layers.append({"layer": i, "collective_counts": dict(counts), "err": err})
    # Worst error over ranks, so that every rank reaches the same verdict.
    errs = torch.stack([layer.pop("err") for layer in layers]).to(ctx.device)
    dist.all_reduce(errs, op=dist.ReduceOp.MAX, group=ctx.group)
    for layer, (abs_err, scale) in zip(layers, errs.tolist()):
        layer["max_abs_err"] = abs_err
        layer["max_rel_err"] = abs_err / scale if scale else abs_err
        layer["equivalent"] = layer["max_rel_err"] <= tol
    return layers


# ---- traffic: the ledger against the model, and timing -------------------------------------------


def _group(records: list[Traffic], times: dict | None = None) -> list[dict]:
    """One row per call site of a layer: kind, count, shape, bytes (and median time when measured)."""
    rows: dict[tuple, dict] = {}
    for r in records:
        row = rows.setdefault((r.sublayer, r.site, r.kind, r.shape), {
            "sublayer": r.sublayer, "site": r.site, "kind": r.kind, "count": 0, "shape": list(r.shape),
            "logical_bytes": 0, "bytes_per_rank": 0.0})
        row["count"] += 1
        row["logical_bytes"] += r.logical_bytes
        row["bytes_per_rank"] += r.bytes_per_rank
        if times is not None:
            row["time_s"] = times[(r.layer, r.site)]
    return list(rows.values())


def measure_traffic(stack: TPStack, x: torch.Tensor, cfg: ModelConfig, variant: str, ctx: TPContext,
                    repeats: int) -> dict:
    """Ledger on: one forward+backward checked against the model, then timed forwards."""
    ledger = TrafficLedger(ctx.world_size, ctx.device)
    x_grad = x.detach().clone().requires_grad_()
    with ledger.attach(stack):
        stack(x_grad)[-1].sum().backward()
    stack.zero_grad(set_to_none=True)
    n, dtype = x.shape[0], x.dtype
    predicted = {ph: predict(cfg, ctx.world_size, n, dtype, variant, ph) for ph in PHASES}
    observed = {ph: [r.traffic() for r in ledger.records if r.phase == ph] for ph in PHASES}
    matches = {ph: Counter(observed[ph]) == Counter(predicted[ph]) for ph in PHASES}

    # Timed forwards, ledger off and on alternately; the first round warms up.
    site_times: dict[tuple, list[float]] = {}
    fwd_off, fwd_on = [], []
    with torch.no_grad():
        for rep in range(repeats + 1):
            for on in (False, True):
                ledger.clear()
                dist.barrier(group=ctx.group)
                _sync(ctx)
                start = time.perf_counter()
                if on:
                    with ledger.attach(stack):
                        stack(x)
                else:
                    stack(x)
                _sync(ctx)
                if rep:
                    (fwd_on if on else fwd_off).append(time.perf_counter() - start)
            if rep:
                for r in ledger.records:
                    site_times.setdefault((r.layer, r.site), []).append(r.time_s)
    last: list[CommRecord] = list(ledger.records)
    keys = list(site_times)
    medians = dict(zip(keys, _max_over_ranks([statistics.median(site_times[k]) for k in keys], ctx)))
    fwd = _max_over_ranks([statistics.median(fwd_off), statistics.median(fwd_on)], ctx) if repeats else [0.0, 0.0]

    layers = []
    for i in range(cfg.n_layers):
        mine = [r for r in last if r.layer == i]
        layers.append({
            "collectives": _group(mine, medians),
            "predicted": _group([t for t in predicted["forward"] if t.layer == i]),
            "logical_bytes": sum(r.logical_bytes for r in mine),
            "bytes_per_rank": sum(r.bytes_per_rank for r in mine),
            "time_s": sum(medians[(r.layer, r.site)] for r in mine),
        })
    backward = observed["backward"]
    return {
        "layers": layers,
        "ledger_matches_model": all(matches.values()),
        "ledger_matches_model_by_phase": matches,
        "forward_time_s": fwd[0],
        "forward_time_with_ledger_s": fwd[1],
        "backward": {"collectives": dict(Counter(r.kind for r in backward)),
                     "bytes_per_rank": sum(r.bytes_per_rank for r in backward),
                     "logical_bytes": sum(r.logical_bytes for r in backward)},
    }


# ---- profiler -------------------------------------------------------------------------------------


def profile_variant(stack: TPStack, x: torch.Tensor, variant: str, ctx: TPContext, out_dir: Path) -> dict:
    """One forward under torch.profiler; the trace, parsed back, must list what the ledger saw."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if ctx.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    ledger = TrafficLedger(ctx.world_size, ctx.device)
    with torch.no_grad(), layer_scopes(stack), ledger.attach(stack), \
            torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        stack(x)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{variant}-rank{ctx.rank}.json"
    prof.export_chrome_trace(str(path))
    parsed = collectives_by_layer(path)
    seen: dict[int, list] = {}
    for r in ledger.records:
        seen.setdefault(r.layer, []).append((r.kind, r.shape))
    agree = torch.tensor([float(parsed == seen and backend_events(path) == len(ledger.records))],
                         device=ctx.device)
    dist.all_reduce(agree, op=dist.ReduceOp.MIN, group=ctx.group)
    return {"trace": str(path), "trace_matches_ledger": bool(agree.item()),
            "collectives_in_trace": sum(len(v) for v in parsed.values())}


# ---- shards --------------------------------------------------------------------------------------


def shard_rows(stack: TPStack, variant: str, ctx: TPContext) -> list[dict]:
    """What each rank holds in one block, read off the modules themselves (all-gathered)."""
    block, cfg, r, p = stack.blocks[0], stack.cfg, ctx.rank, ctx.world_size
    if variant == "intra_head":  # every head, a 1/p slice of each head's dims
        dhp = cfg.d_head // p
        mine = {"rank": r, "heads": [0, cfg.n_heads - 1], "head_dims": [r * dhp, (r + 1) * dhp - 1]}
    else:
        heads = heads_of_rank(cfg.n_heads, r, p)
        mine = {"rank": r, "heads": [heads.start, heads.stop - 1]}
    for name in LINEARS:
        linear = getattr(block, name)
        out_f, in_f = linear.weight.shape
        mine[name] = {"kind": type(linear).__name__, "weight_in_out": [in_f, out_f]}
    rows: list = [None] * ctx.world_size
    dist.all_gather_object(rows, mine, group=ctx.group)
    return rows


# ---- the whole check -----------------------------------------------------------------------------


def run_check(cfg: ModelConfig, *, n_tokens: int, dtype: torch.dtype, seed: int, variants: list[str],
              tolerance: float, repeats: int, profile_dir: Path | None, ctx: TPContext) -> dict:
    dense = init_weights(DenseStack(cfg, dtype, ctx.device), seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(n_tokens, cfg.d_model, generator=gen, dtype=torch.float64).to(ctx.device, dtype)
    fingerprint = torch.cat([weights_checksum(dense), x.detach().to("cpu", torch.float64).sum().reshape(1)])
    if not same_on_every_rank(fingerprint.to(ctx.device), ctx.group):
        raise RuntimeError("ranks hold different dense weights or inputs (seed or library mismatch); "
                           "every rank must build the same model")
    with torch.no_grad():
        reference = dense(x)
    results = {}
    for v in variants:
        stack = shard_stack(dense, v, ctx.group)
        layers = compare_layers(stack, x, reference, ctx, tolerance)
        traffic = measure_traffic(stack, x, cfg, v, ctx, repeats)
        for layer, t in zip(layers, traffic.pop("layers")):
            layer.update(t)
        results[v] = {
            "layers": layers,
            "max_abs_err": max(layer["max_abs_err"] for layer in layers),
            "max_rel_err": max(layer["max_rel_err"] for layer in layers),
            "equivalent": all(layer["equivalent"] for layer in layers),
            **traffic,
            "shards": shard_rows(stack, v, ctx),
        }
        if profile_dir is not None:
            results[v]["profile"] = profile_variant(stack, x, v, ctx, profile_dir)
    return results

