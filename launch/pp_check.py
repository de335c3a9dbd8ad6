"""run_block with pp > 1: the stack as pp pipeline stages of tp ranks each (layers/models/pipeline.py), checked against
the single-device stack layer by layer, every rank's collectives and stage-boundary messages against the traffic model,
and the forward-only GPipe schedule's bubble per stage beside (pp − 1)/(m + pp − 1).

    torchrun --nproc_per_node=8 launch/run_block.py pp=2                      # 2 stages × tp 4
    torchrun --nproc_per_node=8 launch/run_block.py pp=4 microbatches=2 pp_boundary=scatter

The requests of the input are split into `microbatches` groups, in order, as evenly as their count allows; each group
is one micro-batch (its requests flattened, each attending within itself).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import torch
import torch.distributed as dist

from launch.check import dense_and_input
from launch.report import counts_text, format_table, kib
from layers.attention.varlen import Requests
from layers.models.pipeline import PPLayout, new_pp_groups, shard_stage
from tp.dist import TPContext
from tp.ledger import TrafficLedger
from tp.traffic_model import predict_pp_stage


def split_requests(lengths: list[int], m: int) -> list[list[int]]:
    """m groups of consecutive requests, as even in count as can be (the first len % m groups one longer)."""
    per, extra = divmod(len(lengths), m)
    out, i = [], 0
    for g in range(m):
        n = per + (g < extra)
        out.append(lengths[i:i + n])
        i += n
    return out


def run_pp_check(cfg, *, lengths: list[int], dtype: torch.dtype, seed: int, variants: list[str], tolerance: float,
                 pp: int, microbatches: int, boundary: str, ctx: TPContext, weights=None) -> dict:
    layout = PPLayout(pp, ctx.world_size // pp)
    stages = new_pp_groups(layout)  # every rank, the same order
    rank = ctx.rank
    dense, x = dense_and_input(cfg, sum(lengths), dtype, seed, ctx, weights)
    groups = split_requests(lengths, microbatches)
    rows = [sum(g) for g in groups]
    inputs = list(x.split(rows))
    requests = [Requests.from_lengths(g) if len(g) > 1 else None for g in groups]
    with torch.no_grad():  # the reference: each request alone through the single-device stack
        reference = []
        for xm, g in zip(inputs, groups):
            alone = [dense(part) for part in xm.split(g)]
            reference.append(tuple(torch.cat(outs) for outs in zip(*alone)))
    results = {}
    for v in variants:
        stage = shard_stage(dense, v, layout, rank, stages[layout.stage_of(rank)], boundary)
        with torch.no_grad():
            stage.run(inputs if stage.first else None, rows, requests)  # warm-up: the timeline below is the second
            ledger = TrafficLedger(layout.tp)
            dist.barrier(group=ctx.group)  # every stage's timeline starts together
            with ledger.recording():
                outs, timeline = stage.run(inputs if stage.first else None, rows, requests)
        errs = {}
        for got, want in zip(outs, reference):
            for o, i in zip(got, stage.layers):
                a, s = (o - want[i]).abs().max().item(), want[i].abs().max().item()
                e = errs.setdefault(i, [0.0, 0.0])
                e[0], e[1] = max(e[0], a), max(e[1], s)
        collectives, messages = [], []
        for m, n in enumerate(rows):
            c, t = predict_pp_stage(cfg, pp, layout.tp, rank, n, dtype, v, boundary)
            collectives += c
            messages += [replace(msg, request=m) for msg in t]
        mine = {"rank": rank, "stage": stage.index, "layers": list(stage.layers),
                "errors": {i: (a, a / s if s else a) for i, (a, s) in errs.items()},
                "collectives": dict(Counter(r.kind for r in ledger.records)),
                "tp_bytes_per_rank": sum(r.bytes_per_rank for r in ledger.records),
                "sent": sum(t.bytes for t in ledger.transfers if t.kind == "send"),
                "received": sum(t.bytes for t in ledger.transfers if t.kind == "recv"),
                "ledger_matches_model": [r.traffic() for r in ledger.records] == collectives
                and [t.transfer() for t in ledger.transfers] == messages,
                "timeline": timeline}
        everyone: list = [None] * ctx.world_size
        dist.all_gather_object(everyone, mine, group=ctx.group)
        results[v] = summarize(everyone, layout, tolerance)
    return {"pp": pp, "tp": layout.tp, "microbatches": microbatches, "microbatch_requests": groups,
            "boundary": boundary, "variants": results}


def summarize(ranks: list[dict], layout: PPLayout, tolerance: float) -> dict:
    stages = []
    for s in range(layout.pp):
        members = [r for r in ranks if r["stage"] == s]
        lead = members[0]
        line = lead["timeline"]
        busy = sum(t["end_s"] - t["begin_s"] for t in line["microbatches"])
        layers = []
        for i in lead["layers"]:
            a = max(r["errors"][i][0] for r in members)
            rel = max(r["errors"][i][1] for r in members)
            layers.append({"layer": i, "max_abs_err": a, "max_rel_err": rel, "equivalent": rel <= tolerance})
        stages.append({"stage": s, "ranks": [r["rank"] for r in members], "layers": layers,
                       "collectives": lead["collectives"], "tp_bytes_per_rank": lead["tp_bytes_per_rank"],
                       "sent_per_rank": lead["sent"], "received_per_rank": lead["received"],
                       "busy_s": busy, "wait_s": sum(t["wait_s"] for t in line["microbatches"])})
    span = max(t["end_s"] for r in ranks for t in r["timeline"]["microbatches"])
    for st in stages:
        st["bubble"] = 1 - st["busy_s"] / span if span else 0.0
    return {"stages": stages, "span_s": span,
            "equivalent": all(layer["equivalent"] for st in stages for layer in st["layers"]),
            "ledger_matches_model": all(r["ledger_matches_model"] for r in ranks),
            "max_rel_err": max(layer["max_rel_err"] for st in stages for layer in st["layers"])}


def render_pp(report: dict) -> str:
    c, m, pp = report["config"], report["config"]["model"], report["pp"]
    lengths = c["requests"]
    out = [f"tpref: pipeline-parallel block check  (pp = {pp} stages x tp = {report['tp']}, "
           f"world {report['world_size']}, backend {report['backend']}, device {report['device']})",
           f"model {c['model_name']}: d={m['d_model']} L={m['n_layers']}; dtype={c['dtype']} seed={c['seed']}; "
           f"input: {len(lengths)} requests {lengths} in {report['microbatches']} micro-batch(es) "
           f"{report['microbatch_requests']}; stage boundary: {report['boundary']}"]
    for v, res in report["variants"].items():
        out += ["", f"== {v}: every rank's collectives and boundary messages against the model: "
                    f"{'yes' if res['ledger_matches_model'] else 'NO'}; bubble = 1 - busy / span, span "
                    f"{res['span_s'] * 1e3:.1f} ms"]
        rows = []
        for st in res["stages"]:
            worst = max(layer["max_rel_err"] for layer in st["layers"])
            ok = all(layer["equivalent"] for layer in st["layers"])
            rows.append([st["stage"], f"{st['ranks'][0]}-{st['ranks'][-1]}",
                         f"{st['layers'][0]['layer']}-{st['layers'][-1]['layer']}", counts_text(st["collectives"]),
                         kib(st["tp_bytes_per_rank"]), kib(st["sent_per_rank"]), kib(st["received_per_rank"]),
                         f"{st['bubble']:.3f}", f"{worst:.3e}", "PASS" if ok else "FAIL"])
        out.append(format_table(["stage", "ranks", "layers", "collectives (TP group)", "sent/rank KiB",
                                 "boundary sent/rank KiB", "received KiB", "bubble", "max_rel_err", "check"], rows))
    mb = report["microbatches"]
    out.append(f"GPipe forward bubble (pp - 1)/(m + pp - 1) = {(pp - 1) / (mb + pp - 1):.3f} at m = {mb} (equal "
               "stages, free messages; ranks sharing CPU cores run slower when stages overlap)")
    ok = report["equivalent"] and report["traffic_ok"]
    names = ", ".join(report["variants"])
    out.append(f"{'PASS' if ok else 'FAIL'}: {names} at pp={pp} x tp={report['tp']} "
               f"{'match' if report['equivalent'] else 'do NOT match'} the single-device block "
               f"({report['boundary']} boundary, {mb} micro-batch(es); ledger = model on every rank: "
               f"{'yes' if report['traffic_ok'] else 'NO'})")
    return "\n".join(out)
