"""run_block's second job: the traffic ledger against the analytic model, and per-collective times.

One forward + backward with the ledger on is compared with tp/traffic_model.py; then
timed forwards (ledger off, ledger on, and with several requests the padded baseline)
through launch/timing.py, with every timed round's per-site collective times collected.
"""

from __future__ import annotations

import statistics
from collections import Counter

import torch

from launch.timing import sample, slowest
from layers.models.config import ModelConfig
from layers.models.tp_block import TPStack
from tp.dist import TPContext
from tp.ledger import CommRecord, Traffic, TrafficLedger
from tp.traffic_model import PHASES, predict, predict_sp_stack


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
