"""run_block for MoE models (model=mixtral_tiny): each placement of the routed FFN (moe_parallel=tp, ep or ep_a2a,
docs/moe.md) against the dense MoE stack.

For each: every layer's output against the dense stack's (on the rows each rank holds), the traffic ledger against
tp/traffic_model.predict_moe_layer computed from the dense stack's routing (every rank), the expert load per layer
(pairs per expert and per rank, max/mean), the all-to-all bytes beside the seed's uniform-routing estimate
4·N·k·d/EP·(EP−1)/EP (tp/cost_model.ep_alltoall_elems_per_gpu), and the forward time (median of the slowest rank).
Forward only: the placements here serve and check, they do not train.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from launch.check import dense_and_input
from launch.report import format_table, kib
from launch.timing import sample, slowest
from layers.attention.varlen import Requests
from layers.models.dense import Stack
from layers.models.moe import dense_routing, moe_block
from layers.parallel.shard import DenseSource, load_plan
from tp.cost_model import ep_alltoall_elems_per_gpu
from tp.dist import TPContext
from tp.ledger import TrafficLedger
from tp.traffic_model import predict_moe_layer

A2A_ROWS = ("dispatch", "combine")  # the hidden rows; "dispatch counts" and "dispatch experts" are the side channel


def my_requests(n_requests: int, rank: int, p: int) -> list[int]:
    """ep_a2a's data parallelism: rank r holds requests r, r + p, r + 2p, ..."""
    return list(range(rank, n_requests, p))


def run_moe_check(cfg, *, lengths: list[int], dtype: torch.dtype, seed: int, placements: list[str], tolerance: float,
                  repeats: int, ctx: TPContext, weights=None) -> dict:
    p, rank = ctx.world_size, ctx.rank
    requests = Requests.from_lengths(lengths)
    dense, x = dense_and_input(cfg, sum(lengths), dtype, seed, ctx, weights)  # weights: a Mixtral checkpoint's
    with torch.no_grad():
        want = dense(x, requests.cu_seqlens)
    ids, gap = dense_routing(dense, x, requests)
    held = [torch.cat([torch.arange(*requests.spans[i]) for i in my_requests(len(lengths), s, p)]
                      or [torch.zeros(0, dtype=torch.long)]).to(ctx.device) for s in range(p)]
    results = {}
    for placement in placements:
        blocks = [moe_block(cfg, placement, ctx.group, dtype, ctx.device) for _ in dense.blocks]
        stack = Stack(cfg, [load_plan(b, b.plan(), DenseSource(d)) for b, d in zip(blocks, dense.blocks)])
        if placement == "ep_a2a":
            rows = held[rank]
            mine = [lengths[i] for i in my_requests(len(lengths), rank, p)]
            cu = Requests.from_lengths(mine).cu_seqlens if mine else None
        else:
            rows, cu = torch.arange(x.shape[0], device=x.device), requests.cu_seqlens
        xs = x[rows]
        forward = (lambda: stack(xs, cu)) if len(rows) else (lambda: stack(xs))  # noqa: E731
        ledger = TrafficLedger(p, ctx.device)
        with torch.no_grad(), ledger.attach(stack):
            got = forward()
        scale = [float(w.abs().max()) for w in want]
        errs = [float((g - w[rows]).abs().max()) / s if len(rows) else 0.0 for g, w, s in zip(got, want, scale)]
        routed = [[layer[h] for h in held] for layer in ids]  # tp, ep: the bytes do not depend on it
        same_routing = True
        if placement == "ep_a2a":  # the routing every rank took (a near-tie in low precision may differ from dense)
            every_ids: list = [None] * p
            dist.all_gather_object(every_ids, [b.routed.cpu() for b in stack.blocks], group=ctx.group)
            routed = [[every_ids[s_][i].to(x.device) for s_ in range(p)] for i in range(len(ids))]
            same_routing = all(torch.equal(r.cpu(), layer[h].cpu()) for taken, layer in zip(routed, ids)
                               for r, h in zip(taken, held))
        predicted = [t for i, taken in enumerate(routed)
                     for t in predict_moe_layer(cfg, placement, p, rank, i, dtype, taken, n=x.shape[0])]
        seen = [r.traffic() for r in ledger.records]
        times = sample({placement: forward}, repeats, ctx)[placement]
        mine = {"errs": errs, "ledger_matches_model": seen == predicted, "records": [r.__dict__ for r in seen],
                "tokens": len(rows), "routing_matches_dense": same_routing}
        every: list = [None] * p
        dist.all_gather_object(every, mine, group=ctx.group)
        taken = [torch.cat(layer) for layer in routed] if placement == "ep_a2a" else ids  # token order: by rank
        results[placement] = summarize(cfg, placement, every, taken, held if placement != "ep_a2a" else
                                       _by_rank(held), lengths, dtype, tolerance, p,
                                       slowest([statistics.median(times)], ctx)[0])
    return {"placements": results, "min_top_k_gap": gap}


def _by_rank(held: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each rank's rows of the ranks' routings concatenated in rank order."""
    sizes = [len(h) for h in held]
    return list(torch.arange(sum(sizes), device=held[0].device).split(sizes))


def expert_load(cfg, placement: str, ids: list[torch.Tensor], p: int) -> list[dict]:
    """Per layer: pairs per expert, per rank (the experts each rank computes; tp: every rank computes every pair on
    its f/p slice), and the ranks' max/mean."""
    out = []
    for layer in ids:
        per_expert = torch.bincount(layer.flatten().cpu(), minlength=cfg.n_experts).tolist()
        if placement == "tp":
            per_rank = [sum(per_expert)] * p
        else:
            per = cfg.n_experts // p
            per_rank = [sum(per_expert[r * per:(r + 1) * per]) for r in range(p)]
        mean = sum(per_rank) / p
        out.append({"pairs_per_expert": per_expert, "pairs_per_rank": per_rank,
                    "max_over_mean": max(per_rank) / mean if mean else 1.0})
    return out


def summarize(cfg, placement: str, every: list[dict], ids, held, lengths, dtype, tolerance, p, time_s) -> dict:
    """Every rank's results, the load, the bytes (and the seed's estimate) for one placement."""
    layers = len(ids)
    errs = [max(e["errs"][i] for e in every) for i in range(layers)]
    sent = [sum(r["bytes_per_rank"] for r in e["records"]) / layers for e in every]  # per layer, each rank
    a2a = [sum(r["bytes_per_rank"] for r in e["records"] if r["kind"] == "all_to_all" and r["site"] in A2A_ROWS)
           / layers for e in every]
    out = {"equivalent": all(err <= tolerance for err in errs), "max_rel_err": max(errs), "rel_err_per_layer": errs,
           "ledger_matches_model": all(e["ledger_matches_model"] for e in every),
           "collectives_per_layer": sorted({(r["kind"], r["sublayer"] + "/" + r["site"]) for e in every
                                            for r in e["records"]}),
           "collectives_per_layer_count": len(every[0]["records"]) // layers if every[0]["records"] else 0,
           "bytes_sent_per_rank_per_layer": sent, "load": expert_load(cfg, placement, ids, p),
           "tokens_per_rank": [e["tokens"] for e in every], "time_s": time_s,
           "routing_matches_dense": all(e["routing_matches_dense"] for e in every)}
    if placement == "ep_a2a":
        n, e_bytes = sum(lengths), dtype.itemsize
        # sent + received rows of both all-to-alls on each rank (what the seed's 4·N·k·d/EP·(EP−1)/EP counts)
        received = []
        for rank in range(p):
            sent_rows = 0
            for layer in ids:
                per = cfg.n_experts // p
                to = [torch.bincount(layer[h].flatten().cpu() // per, minlength=p).tolist() for h in held]
                # dispatch: received from others to[s][rank]; combine: received back its own pairs sent away
                sent_rows += sum(to[s][rank] for s in range(p) if s != rank) + sum(to[rank]) - to[rank][rank]
            received.append(sent_rows * cfg.d_model * e_bytes / layers)
        out["a2a_rows_sent_per_rank_per_layer"] = a2a
        out["a2a_rows_received_per_rank_per_layer"] = received
        out["a2a_sent_plus_received_per_rank_per_layer"] = [s + r for s, r in zip(a2a, received)]
        out["seed_estimate_per_rank_per_layer"] = ep_alltoall_elems_per_gpu(n, cfg.d_model, cfg.top_k, p) * e_bytes
    return out


def render_moe(r: dict) -> str:
    c, m = r["config"], r["config"]["model"]
    lines = [f"tpref: MoE block check  (tp = {r['world_size']}, backend {r['backend']}, device {r['device']})",
             f"model {c['model_name']}: d={m['d_model']} h={m['n_heads']} h_kv={m['n_kv_heads']} d_head={m['d_head']} "
             f"E={m['n_experts']} experts of ffn={m['d_ffn']}, top_k={m['top_k']}, L={m['n_layers']}; "
             f"dtype={c['dtype']}" + (f" ({c['dtype_from']})" if c.get("dtype_from") else "")
             + f"; requests {c['requests']} (ep_a2a: rank r holds requests r, r+p, ...)",
             f"smallest gap between a token's k-th and (k+1)-th router probability: {r['min_top_k_gap']:.3g} "
             f"(a near-tie would make a routing depend on rounding)", ""]
    rows = []
    base = r["placements"].get("tp", {}).get("time_s")
    for name, v in r["placements"].items():
        load = max(layer["max_over_mean"] for layer in v["load"])
        rows.append([name, v["collectives_per_layer_count"], kib(statistics.mean(v["bytes_sent_per_rank_per_layer"])),
                     kib(max(v["bytes_sent_per_rank_per_layer"])), f"{load:.2f}", f"{v['max_rel_err']:.1e}",
                     str(v["ledger_matches_model"]).lower(),
                     f"{v['time_s'] / base:.2f}" if base else f"{v['time_s'] * 1e3:.1f} ms"])
    lines.append(format_table(["moe_parallel", "collectives/layer", "sent/rank/layer KiB (mean)", "max",
                               "expert load max/mean", "max rel err", "ledger = model",
                               "time / tp" if base else "time"], rows))
    a2a = r["placements"].get("ep_a2a")
    if a2a:
        measured = a2a["a2a_sent_plus_received_per_rank_per_layer"]
        lines += ["", f"ep_a2a all-to-all rows (dispatch + combine, sent + received) per rank per layer: measured "
                      f"{', '.join(kib(b) for b in measured)} KiB (mean {kib(statistics.mean(measured))}); the seed's "
                      f"uniform-routing estimate 4·N·k·d/EP·(EP−1)/EP·e = "
                      f"{kib(a2a['seed_estimate_per_rank_per_layer'])} KiB",
                  "pairs per rank, per layer: " + "; ".join(
                      f"layer {i}: {layer['pairs_per_rank']} (max/mean {layer['max_over_mean']:.2f})"
                      for i, layer in enumerate(a2a["load"])),
                  "tokens held per rank (data-parallel attention): " + str(a2a["tokens_per_rank"])
                  + f"; the routing they took equals the dense stack's: {str(a2a['routing_matches_dense']).lower()} "
                    f"(the model predicts the all-to-alls from the routing taken)"]
    verdict = r["equivalent"] and r["traffic_ok"]
    lines += ["", ("PASS" if verdict else "FAIL") + f": moe_parallel {', '.join(r['placements'])} at "
              f"tp={r['world_size']} match the dense MoE block and the traffic model"]
    return "\n".join(lines)
