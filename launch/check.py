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
from layers.hf_gpt2 import load_stack
from layers.shard import heads_of_rank
from layers.tp_block import TPStack, shard_stack
from layers.varlen import Requests, check_same_on_every_rank
from tp.dist import TPContext, max_over_ranks, same_on_every_rank, synchronize
from tp.ledger import CommRecord, Traffic, TrafficLedger
from tp.trace import backend_witness, collectives_by_layer, layer_scopes
from tp.traffic_model import PHASES, predict

LINEARS = ("qkv", "attn_out", "mlp_up", "mlp_down")


def collective_kind(op) -> str:
    name = str(op)
    if "allreduce" in name or "all_reduce" in name:
        return "all_reduce"
    if "allgather" in name or "all_gather" in name:
        return "all_gather"
    return name.rsplit(".", 1)[-1].strip("_")


# ---- equivalence, with CommDebugMode's count per layer -------------------------------------------


def _errors(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return torch.stack([(out - ref).abs().max(), ref.abs().max()]).to(torch.float64)


def compare_layers(stack: TPStack, x: torch.Tensor, reference: tuple[torch.Tensor, ...], requests: Requests | None,
                   ctx: TPContext, tol: float) -> tuple[list[dict], list[dict]]:
    """Per layer: CommDebugMode's counts and the error against the reference (worst over ranks).
    Per request: the worst error over layers of its own rows, relative to its own reference."""
    layers, per_request = [], []
    spans = requests.spans if requests else [(0, x.shape[0])]
    with torch.no_grad():
        for i, block in enumerate(stack.blocks):
            with CommDebugMode() as comm:
                x = block(x, requests)
            counts = Counter()
            for op, count in comm.get_comm_counts().items():
                counts[collective_kind(op)] += count
            layers.append({"layer": i, "collective_counts": dict(counts), "err": _errors(x, reference[i])})
            per_request.append(torch.stack([_errors(x[s:e], reference[i][s:e]) for s, e in spans]))
    # Worst error over ranks, so that every rank reaches the same verdict.
    errs = torch.stack([layer.pop("err") for layer in layers]).to(ctx.device)
    req = torch.stack(per_request).to(ctx.device)  # [L, R, 2]
    dist.all_reduce(errs, op=dist.ReduceOp.MAX, group=ctx.group)
    dist.all_reduce(req, op=dist.ReduceOp.MAX, group=ctx.group)
    for layer, (abs_err, scale) in zip(layers, errs.tolist()):
        layer["max_abs_err"] = abs_err
        layer["max_rel_err"] = abs_err / scale if scale else abs_err
        layer["equivalent"] = layer["max_rel_err"] <= tol
    rel = req[..., 0] / req[..., 1].clamp_min(torch.finfo(torch.float64).tiny)  # [L, R]
    requests_out = []
    for r, (s, e) in enumerate(spans):
        worst = rel[:, r].max().item()
        requests_out.append({"request": r, "tokens": e - s, "max_abs_err": req[:, r, 0].max().item(),
                             "max_rel_err": worst, "equivalent": worst <= tol})
    return layers, requests_out


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


def measure_traffic(stack: TPStack, x: torch.Tensor, cu_seqlens, cfg: ModelConfig, variant: str, ctx: TPContext,
                    repeats: int) -> dict:
    """Ledger on: one forward+backward checked against the model, then timed forwards
    (ledger off, ledger on, and with several requests the padded-attention baseline)."""
    ledger = TrafficLedger(ctx.world_size, ctx.device)
    x_grad = x.detach().clone().requires_grad_()
    with ledger.attach(stack):
        stack(x_grad, cu_seqlens)[-1].sum().backward()
    stack.zero_grad(set_to_none=True)
    n, dtype = x.shape[0], x.dtype
    lengths = None if cu_seqlens is None else [e - s for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    predicted = {ph: predict(cfg, ctx.world_size, n, dtype, variant, ph, lengths) for ph in PHASES}
    observed = {ph: [r.traffic() for r in ledger.records if r.phase == ph] for ph in PHASES}
    matches = {ph: Counter(observed[ph]) == Counter(predicted[ph]) for ph in PHASES}

    # Timed forwards, alternating; the first round warms up.
    def off():
        stack(x, cu_seqlens)

    def on():
        ledger.clear()
        with ledger.attach(stack):
            stack(x, cu_seqlens)

    def padded():
        stack(x, cu_seqlens, padded=True)

    runs = {"off": off, "on": on}
    if lengths and len(lengths) > 1 and variant != "intra_head":
        runs["padded"] = padded
    times: dict[str, list[float]] = {name: [] for name in runs}
    site_times: dict[tuple, list[float]] = {}
    with torch.no_grad():
        for rep in range(repeats + 1):
            for name, fn in runs.items():
                dist.barrier(group=ctx.group)
                synchronize(ctx.device)
                start = time.perf_counter()
                fn()
                synchronize(ctx.device)
                if rep:
                    times[name].append(time.perf_counter() - start)
            if rep:
                for r in ledger.records:
                    site_times.setdefault((r.layer, r.site), []).append(r.time_s)
    last: list[CommRecord] = list(ledger.records)
    keys = list(site_times)
    medians = dict(zip(keys, max_over_ranks([statistics.median(site_times[k]) for k in keys], ctx.group)))
    fwd = dict(zip(runs, max_over_ranks([statistics.median(times[k]) if times[k] else 0.0 for k in runs], ctx.group)))

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
        "forward_time_s": fwd["off"],
        "forward_time_with_ledger_s": fwd["on"],
        **({"forward_time_padded_s": fwd["padded"]} if "padded" in fwd else {}),
        "backward": {"collectives": dict(Counter(r.kind for r in backward)),
                     "bytes_per_rank": sum(r.bytes_per_rank for r in backward),
                     "logical_bytes": sum(r.logical_bytes for r in backward)},
    }


# ---- profiler -------------------------------------------------------------------------------------


def profile_variant(stack: TPStack, x: torch.Tensor, cu_seqlens, variant: str, ctx: TPContext,
                    out_dir: Path) -> dict:
    """One forward under torch.profiler; the trace, parsed back, must list what the ledger saw."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if ctx.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    ledger = TrafficLedger(ctx.world_size, ctx.device)
    with torch.no_grad(), layer_scopes(stack), ledger.attach(stack), \
            torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        stack(x, cu_seqlens)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{variant}-rank{ctx.rank}.json"
    prof.export_chrome_trace(str(path))
    parsed = collectives_by_layer(path)
    seen: dict[int, list] = {}
    for r in ledger.records:
        seen.setdefault(r.layer, []).append((r.kind, r.shape))
    witness, per_op = backend_witness(path, len(ledger.records))
    agree = torch.tensor([float(parsed == seen and witness)], device=ctx.device)
    dist.all_reduce(agree, op=dist.ReduceOp.MIN, group=ctx.group)
    return {"trace": str(path), "trace_matches_ledger": bool(agree.item()),
            "collectives_in_trace": sum(len(v) for v in parsed.values()), "backend_events_per_collective": per_op}


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


def run_check(cfg: ModelConfig, *, lengths: list[int], dtype: torch.dtype, seed: int, variants: list[str],
              tolerance: float, repeats: int, profile_dir: Path | None, ctx: TPContext,
              weights: dict[str, torch.Tensor] | None = None) -> dict:
    """lengths: the requests flattened into one forward; one entry means one plain sequence.
    weights: a GPT-2 state dict to load instead of the seeded random weights."""
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

