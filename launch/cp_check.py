"""run_block with cp > 1: one long request over cp × tp ranks (layers/attention/context_parallel.py), checked against
the single-device stack: its prompt by ring attention (zigzag chunks, pass-KV), then `cp_decode` new tokens over the
split cache (one log-sum-exp merge per layer); every rank's collectives and ring messages against the traffic model
(tp/traffic_model.predict_cp); the causal work per rank under zigzag beside the naive split.

    torchrun --nproc_per_node=4 launch/run_block.py cp=2 n_tokens=512          # 2 cp ranks × tp 2
    torchrun --nproc_per_node=4 launch/run_block.py cp=4 n_tokens=1000 model=llama_tiny

Ranks: global rank = c·tp + t (cp index c, TP index t): each TP group is tp consecutive ranks, the cp ranks of one TP
slot hold the same heads (the same weights) and different positions.
"""

from __future__ import annotations

import time
from collections import Counter

import torch
import torch.distributed as dist

from launch.check import dense_and_input
from launch.report import counts_text, format_table, kib
from layers.attention.context_parallel import (RingPrefill, SplitKVDecode, causal_pairs, contiguous_positions,
                                               new_cp_groups, zigzag_positions)
from layers.models.tp_block import tp_stack
from layers.parallel.shard import DenseSource, load_plan
from tp.dist import TPContext
from tp.ledger import TrafficLedger
from tp.traffic_model import pass_kv_bytes_per_rank_per_layer, predict_cp


def run_cp_check(cfg, *, n: int, new_tokens: int, dtype: torch.dtype, seed: int, tolerance: float, cp: int,
                 ctx: TPContext, weights=None) -> dict:
    tp = ctx.world_size // cp
    tp_groups, cp_groups = new_cp_groups(ctx.world_size, cp)
    c, t = ctx.rank // tp, ctx.rank % tp
    dense, x = dense_and_input(cfg, n + new_tokens, dtype, seed, ctx, weights)
    with torch.no_grad():
        want = dense(x)  # every layer's output for every position: prompt and new tokens, no cache
    stack = tp_stack(cfg, "v2", tp_groups[c], dtype, ctx.device)
    load_plan(stack, stack.plan(), DenseSource(dense))
    positions = [zigzag_positions(n, cp, r) for r in range(cp)]
    mine = positions[c]
    errs = [[0.0, 0.0] for _ in range(cfg.n_layers)]

    def note(i: int, got: torch.Tensor, rows: list[int]) -> None:
        ref = want[i][rows]
        errs[i][0] = max(errs[i][0], (got - ref).abs().max().item())
        errs[i][1] = max(errs[i][1], ref.abs().max().item())

    ledger = TrafficLedger(tp, ctx.device)
    with torch.no_grad(), ledger.attach(stack):
        ring = RingPrefill(cp_groups[t], positions, ctx.device)
        start = time.perf_counter()
        h = x[mine]
        for i, block in enumerate(stack.blocks):
            h = block(h, ring)
            note(i, h, mine)
        prefill_s = time.perf_counter() - start
        decode = SplitKVDecode(cp_groups[t], list(ring.kept), list(mine), [])
        start = time.perf_counter()
        for j in range(new_tokens):
            decode.new_positions = [n + j]
            h = x[n + j:n + j + 1]
            for i, block in enumerate(stack.blocks):
                h = block(h, decode)
                note(i, h, [n + j])
        decode_s = time.perf_counter() - start
    collectives, messages = predict_cp(cfg, cp, tp, ctx.rank, [len(p) for p in positions], new_tokens, dtype)
    kept = decode.caches[0].shape[2]
    mine_report = {
        "rank": ctx.rank, "cp_rank": c, "tp_rank": t, "rows": len(mine), "cached_positions": kept,
        "errors": [(a, a / s if s else a) for a, s in errs],
        "collectives": dict(Counter(r.kind for r in ledger.records)),
        "collective_bytes": sum(r.bytes_per_rank for r in ledger.records),
        "sent": sum(m.bytes for m in ledger.transfers if m.kind == "send"),
        "ledger_matches_model": [r.traffic() for r in ledger.records] == collectives
        and [m.transfer() for m in ledger.transfers] == messages,
        "prefill_s": prefill_s, "decode_s": decode_s,
        "pairs_zigzag": causal_pairs(mine), "pairs_contiguous": causal_pairs(contiguous_positions(n, cp, c))}
    everyone: list = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine_report, group=ctx.group)
    layers = [{"layer": i, "max_abs_err": max(r["errors"][i][0] for r in everyone),
               "max_rel_err": max(r["errors"][i][1] for r in everyone)} for i in range(cfg.n_layers)]
    for layer in layers:
        layer["equivalent"] = layer["max_rel_err"] <= tolerance
    e = dtype.itemsize
    return {"cp": cp, "tp": tp, "n_tokens": n, "new_tokens": new_tokens, "ranks": everyone, "layers": layers,
            "pass_kv_formula_bytes_per_rank_per_layer": pass_kv_bytes_per_rank_per_layer(cfg, cp, tp, n, e),
            "equivalent": all(layer["equivalent"] for layer in layers),
            "ledger_matches_model": all(r["ledger_matches_model"] for r in everyone)}


def render_cp(report: dict) -> str:
    c, m, res = report["config"], report["config"]["model"], report["cp_check"]
    cp, tp, n, L = res["cp"], res["tp"], res["n_tokens"], m["n_layers"]
    out = [f"tpref: context-parallel block check  (cp = {cp} x tp = {tp}, world {report['world_size']}, backend "
           f"{report['backend']}, device {report['device']})",
           f"model {c['model_name']}: d={m['d_model']} h={m['n_heads']} L={L}; dtype={c['dtype']} seed={c['seed']}; "
           f"one request: a prompt of {n} tokens by ring attention (zigzag, pass-KV), then {res['new_tokens']} "
           f"decodes over the split cache", ""]
    rows = []
    for r in res["ranks"]:
        if r["tp_rank"] != 0:
            continue
        rows.append([r["cp_rank"], r["rows"], r["cached_positions"], r["pairs_zigzag"], r["pairs_contiguous"],
                     counts_text(r["collectives"]), kib(r["sent"] / L), f"{r['prefill_s'] * 1e3:.1f}",
                     "yes" if r["ledger_matches_model"] else "NO"])
    out.append(format_table(["cp rank", "prompt rows", "cached at end", "causal pairs (zigzag)", "(contiguous)",
                             "collectives", "pass-KV sent/layer KiB", "prefill ms", "ledger = model"], rows))
    out.append(f"pass-KV per rank per layer: (cp - 1)·2·(S/cp)·h_kv·d·e = "
               f"{kib(res['pass_kv_formula_bytes_per_rank_per_layer'])} KiB (S = {n}; each rank sends exactly the rows "
               f"it holds, cp - 1 times)")
    worst = max(layer["max_rel_err"] for layer in res["layers"])
    out.append(f"layers: max rel err {worst:.3e} against the single-device stack (tolerance {c['tolerance']:.0e})")
    ok = report["equivalent"] and report["traffic_ok"]
    out.append(f"{'PASS' if ok else 'FAIL'}: v2 at cp={cp} x tp={tp} "
               f"{'matches' if report['equivalent'] else 'does NOT match'} the single-device block (prefill and "
               f"{res['new_tokens']} decodes; ledger = model on every rank: {'yes' if report['traffic_ok'] else 'NO'})")
    return "\n".join(out)
