"""What every rank does in launch/run_block.py: build the dense stack, then for each variant shard it and run the
five jobs:

    1. every layer against the single-device stack, with CommDebugMode's counts (compare_layers)
    2. the traffic ledger against the analytic model; timed forwards, per-collective times (measure_traffic)
    3. one forward under torch.profiler, its trace parsed back against the ledger, with profile=true (profile_variant)
    4. what each rank holds, read off the modules themselves (shard_rows)
    5. the activations saved for backward per layer (launch/memory.py), beside tp/memory_model.py (activation_memory)
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

from launch.memory import saved_bytes_per_layer
from launch.timing import sample, slowest
from layers.attention.varlen import Requests, check_same_on_every_rank
from layers.models import families
from layers.models.config import ModelConfig
from layers.models.dense import DenseStack, init_weights, weights_checksum
from layers.models.hf import load_stack
from layers.models.llama import LlamaConfig, kv_heads_of_rank
from layers.models.tp_block import TPStack, shard_stack
from layers.parallel.shard import heads_of_rank
from tp.dist import TPContext, same_on_every_rank
from tp.ledger import CommRecord, Traffic, TrafficLedger, collective_kind
from tp.memory_model import activation_bytes_per_layer
from tp.trace import backend_witness, collectives_by_layer, layer_scopes
from tp.traffic_model import PHASES, predict, predict_sp_stack


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
        results[v]["totals"] = {  # inside the blocks; v2sp's output gather: "outside_blocks"
            "collectives": kind_counts(c for layer in layers for c in layer["collectives"]),
            **{key: sum(layer[key] for layer in layers) for key in ("logical_bytes", "bytes_per_rank", "time_s")}}
        # Two independent counters: the ledger's records and CommDebugMode's.
        results[v]["counts_agree"] = all(layer["collective_counts"] == kind_counts(layer["collectives"])
                                         for layer in layers)
    return results


def kind_counts(collectives) -> dict[str, int]:
    """Collectives per kind, from rows of call sites (each with its kind and count)."""
    counts: Counter = Counter()
    for c in collectives:
        counts[c["kind"]] += c["count"]
    return dict(counts)


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


# ---- 1. every layer against the single-device stack ---------------------------------------------------------------


def _errors(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """[max |out - ref|, max |ref|] (zeros for no rows)."""
    if ref.numel() == 0:
        return torch.zeros(2, dtype=torch.float64, device=ref.device)
    return torch.stack([(out - ref).abs().max(), ref.abs().max()]).to(torch.float64)


def compare_layers(stack: TPStack, x: torch.Tensor, reference: tuple[torch.Tensor, ...], requests: Requests | None,
                   ctx: TPContext, tol: float) -> tuple[list[dict], list[dict]]:
    """Per layer: CommDebugMode's counts and the error against the reference (worst over ranks).
    Per request: the worst error over layers of its own rows, relative to its own reference."""
    layers, per_request = [], []
    n = x.shape[0]
    spans = requests.spans if requests else [(0, n)]
    lo, hi = stack.rows_held(n)  # v2sp: each layer's output is this rank's rows [lo, hi); else all of them
    with torch.no_grad():
        x = stack.enter(x)
        for i, block in enumerate(stack.blocks):
            with CommDebugMode() as comm:
                x = stack.layer(block, x, requests, n)
            counts = Counter()
            for op, count in comm.get_comm_counts().items():
                counts[collective_kind(op)] += count
            mine, ref = x[:hi - lo], reference[i][lo:hi]
            layers.append({"layer": i, "collective_counts": dict(counts), "err": _errors(mine, ref)})
            # each request's rows that this rank holds (none: zeros, the other ranks' maxima win)
            per_request.append(torch.stack([_errors(mine[max(s, lo) - lo:max(min(e, hi), lo) - lo],
                                                    ref[max(s, lo) - lo:max(min(e, hi), lo) - lo])
                                            for s, e in spans]))
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


# ---- 2. the traffic ledger against the analytic model, and per-collective times -----------------------------------


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
    """Ledger on: one forward+backward checked against tp/traffic_model.py, then timed forwards through
    launch/timing.py (ledger off, ledger on, and with several requests the padded-attention baseline), every timed
    round's per-site collective times collected."""
    ledger = TrafficLedger(ctx.world_size, ctx.device, timing=True)  # per-collective times: run_block reports them
    x_grad = x.detach().clone().requires_grad_()
    n, dtype = x.shape[0], x.dtype
    with ledger.attach(stack):
        stack.output(stack(x_grad, cu_seqlens), n).sum().backward()
    stack.zero_grad(set_to_none=True)
    lengths = None if cu_seqlens is None else [e - s for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    predicted = {ph: predict(cfg, ctx.world_size, n, dtype, variant, ph, lengths)
                 + (predict_sp_stack(cfg, ctx.world_size, n, dtype, ph) if variant == "v2sp" else []) for ph in PHASES}
    observed = {ph: [r.traffic() for r in ledger.records if r.phase == ph] for ph in PHASES}
    matches = {ph: Counter(observed[ph]) == Counter(predicted[ph]) for ph in PHASES}

    # Timed forwards in ABBA order; the first round warms up.
    def off():  # the replicated output, as every variant delivers it (v2sp: its last all-gather included)
        stack.output(stack(x, cu_seqlens), n)

    def on():
        ledger.clear()
        with ledger.attach(stack):
            stack.output(stack(x, cu_seqlens), n)

    def padded():
        stack(x, cu_seqlens, padded=True)

    runs = {"off": off, "on": on}
    if lengths and len(lengths) > 1 and variant not in ("intra_head", "v2sp"):
        runs["padded"] = padded
    site_times: dict[tuple, list[float]] = {}

    def collect():  # the "on" run of this round: its ledger records, per (layer, site)
        for r in ledger.records:
            site_times.setdefault((r.layer, r.site), []).append(r.time_s)

    times = sample(runs, repeats, ctx, after_round=collect)
    last: list[CommRecord] = list(ledger.records)
    keys = list(site_times)
    medians = dict(zip(keys, slowest([statistics.median(site_times[k]) for k in keys], ctx)))
    fwd = dict(zip(runs, slowest([statistics.median(times[k]) if times[k] else 0.0 for k in runs], ctx)))

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
    outside = [r for r in last if r.layer is None]  # v2sp: the output's all-gather
    return {
        "layers": layers,
        "outside_blocks": {"collectives": _group(outside, medians), "bytes_per_rank": sum(r.bytes_per_rank
                                                                                        for r in outside)},
        "ledger_matches_model": all(matches.values()),
        "ledger_matches_model_by_phase": matches,
        "forward_time_s": fwd["off"],
        "forward_time_with_ledger_s": fwd["on"],
        **({"forward_time_padded_s": fwd["padded"]} if "padded" in fwd else {}),
        "backward": {"collectives": dict(Counter(r.kind for r in backward)),
                     "bytes_per_rank": sum(r.bytes_per_rank for r in backward),
                     "logical_bytes": sum(r.logical_bytes for r in backward)},
    }


# ---- 3. one forward under torch.profiler, its trace against the ledger --------------------------------------------


def profile_variant(stack: TPStack, x: torch.Tensor, cu_seqlens, variant: str, ctx: TPContext,
                    out_dir: Path) -> dict:
    """One forward under torch.profiler; the trace, parsed back, must list what the ledger saw."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if ctx.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    ledger = TrafficLedger(ctx.world_size, ctx.device)
    with torch.no_grad(), layer_scopes(stack), ledger.attach(stack), \
            torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        stack.output(stack(x, cu_seqlens), x.shape[0])
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{variant}-rank{ctx.rank}.json"
    prof.export_chrome_trace(str(path))
    # A trace records a gather's input and output dims, not which dim it concatenated (v1 gathers columns, v2sp
    # rows): layer by layer, in order, each collective's kind and element count. Outside any block: layer -1.
    parsed = {layer: [(kind, math.prod(shape)) for kind, shape in hits]
              for layer, hits in collectives_by_layer(path).items()}
    seen: dict[int, list] = {}
    for r in ledger.records:
        seen.setdefault(-1 if r.layer is None else r.layer, []).append((r.kind, math.prod(r.shape)))
    witness, per_op = backend_witness(path, len(ledger.records))
    agree = torch.tensor([float(parsed == seen and witness)], device=ctx.device)
    dist.all_reduce(agree, op=dist.ReduceOp.MIN, group=ctx.group)
    return {"trace": str(path), "trace_matches_ledger": bool(agree.item()),
            "collectives_in_trace": sum(len(v) for v in parsed.values()), "backend_events_per_collective": per_op}


# ---- 4. what each rank holds ---------------------------------------------------------------------------------------


def linears(family: str) -> tuple[str, ...]:
    """A block's four linears, in forward order: Llama-family names, or GPT-2's."""
    return ("qkv", "o", "gate_up", "down") if families.family(family).llama_lm else \
        ("qkv", "attn_out", "mlp_up", "mlp_down")


def shard_rows(stack: TPStack, variant: str, ctx: TPContext) -> list[dict]:
    """What each rank holds in one block, read off the modules themselves (all-gathered)."""
    block, cfg, r, p = stack.blocks[0], stack.cfg, ctx.rank, ctx.world_size
    if variant == "intra_head":  # every head, a 1/p slice of each head's dims
        dhp = cfg.d_head // p
        mine = {"rank": r, "heads": [0, cfg.n_heads - 1], "head_dims": [r * dhp, (r + 1) * dhp - 1]}
    else:
        heads = heads_of_rank(cfg.n_heads, r, p)
        mine = {"rank": r, "heads": [heads.start, heads.stop - 1]}
    if families.of(cfg).llama_lm:  # its K,V heads: shared with p/h_kv − 1 other ranks once p > h_kv
        kv = kv_heads_of_rank(cfg, r, p)
        mine["kv_heads"] = [kv.start, kv.stop - 1]
    for name in linears(cfg.family):
        linear = getattr(block, name)
        out_f, in_f = linear.weight.shape
        mine[name] = {"kind": type(linear).__name__, "weight_in_out": [in_f, out_f]}
    rows: list = [None] * ctx.world_size
    dist.all_gather_object(rows, mine, group=ctx.group)
    return rows


# ---- 5. the activations saved for backward -------------------------------------------------------------------------


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
