"""What rank 0 prints: configuration, shards, per-layer checks and traffic, the v1/v2 comparison."""

from __future__ import annotations

from fractions import Fraction
from itertools import accumulate

from launch.check import kind_counts, linears
from layers.models import families

DESCRIPTION = {
    "v1": "all column-parallel",
    "v2": "Megatron column->row",
    "intra_head": "v2 with the QKV cut inside heads",
    "v2sp": "v2 with sequence parallelism: n/p rows per rank between sub-layers",
}


def format_table(header: list[str], rows: list[list]) -> str:
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
                     for row in cells)


def kib(b: float) -> str:
    return f"{b / 1024:.1f}"


def _span(first: int, last: int) -> str:
    return str(first) if first == last else f"{first}-{last}"


def _heads(row: dict) -> str:
    if "head_dims" in row:
        return f"all, dims {_span(*row['head_dims'])}"
    return _span(*row["heads"])


def counts_text(collectives: dict) -> str:
    return ", ".join(f"{n} {k}" for k, n in sorted(collectives.items())) or "none"


def _ratio(a: float, b: float) -> str:
    if not b:
        return "n/a"
    frac = Fraction(a / b).limit_denominator(16)
    exact = f" = {frac}" if abs(float(frac) - a / b) < 1e-9 and frac.denominator > 1 else ""
    return f"{a / b:.3f}{exact}"


def _requests_table(requests: list[dict], limit: int = 12) -> list[str]:
    shown = requests if len(requests) <= limit else sorted(requests, key=lambda r: -r["max_rel_err"])[:limit]
    rows = [[r["request"], r["tokens"], f"{r['max_abs_err']:.3e}", f"{r['max_rel_err']:.3e}",
             "PASS" if r["equivalent"] else "FAIL"] for r in sorted(shown, key=lambda r: r["request"])]
    out = [format_table(["request", "tokens", "max_abs_err", "max_rel_err", "check"], rows)]
    if len(requests) > limit:
        failed = sum(not r["equivalent"] for r in requests)
        out.append(f"(the {limit} worst of {len(requests)} requests shown; {failed} failed)")
    return out


def render_variant(v: str, res: dict, tolerance: float, family: str = "gpt2") -> list[str]:
    out = ["", f"== {v} ({DESCRIPTION[v]})", "what each rank holds, W as [in x out] with y = x @ W, every layer alike:"]
    names, kv = linears(family), "kv_heads" in res["shards"][0]
    out.append(format_table(
        ["rank", "heads"] + ["K,V heads"] * kv
        + [f"{n} ({res['shards'][0][n]['kind'].replace('ParallelLinear', '').lower()})" for n in names],
        [[r["rank"], _heads(r)] + ([_span(*r["kv_heads"])] if kv else [])
         + ["[{}x{}]".format(*r[n]["weight_in_out"]) for n in names] for r in res["shards"]]))
    out.append(f"forward per layer: collectives (ledger; CommDebugMode agrees: "
               f"{'yes' if res['counts_agree'] else 'NO'}), KiB, time = median of repeats, slowest rank; "
               f"error vs single-device block, tolerance {tolerance:g} on max|tp-dense|/max|dense|")
    rows = []
    for layer in res["layers"]:
        kinds = kind_counts(layer["collectives"])
        bw = layer["bytes_per_rank"] / layer["time_s"] / 1e6 if layer["time_s"] else 0.0
        rows.append([layer["layer"], counts_text(kinds), kib(layer["logical_bytes"]), kib(layer["bytes_per_rank"]),
                     f"{layer['time_s'] * 1e3:.3f}", f"{bw:.1f}", f"{layer['max_abs_err']:.3e}",
                     f"{layer['max_rel_err']:.3e}", "PASS" if layer["equivalent"] else "FAIL"])
    t = res["totals"]
    rows.append(["all", counts_text(t["collectives"]), kib(t["logical_bytes"]), kib(t["bytes_per_rank"]),
                 f"{t['time_s'] * 1e3:.3f}", f"{t['bytes_per_rank'] / t['time_s'] / 1e6 if t['time_s'] else 0:.1f}",
                 f"{res['max_abs_err']:.3e}", f"{res['max_rel_err']:.3e}", "PASS" if res["equivalent"] else "FAIL"])
    out.append(format_table(["layer", "collectives", "logical KiB", "sent/rank KiB", "time ms", "MB/s",
                             "max_abs_err", "max_rel_err", "check"], rows))
    layer0 = res["layers"][0]
    if layer0["collectives"]:
        out.append("layer 0 by call site, ledger vs analytic model (sent/rank KiB):")
        model = {(c["site"], c["kind"]): c for c in layer0["predicted"]}
        out.append(format_table(
            ["site", "kind", "shape", "ledger", "model"],
            [[f"{c['sublayer']}/{c['site']}", c["kind"], "x".join(map(str, c["shape"])), kib(c["bytes_per_rank"]),
              kib(model[(c["site"], c["kind"])]["bytes_per_rank"]) if (c["site"], c["kind"]) in model else "-"]
             for c in layer0["collectives"]]))
    if len(res["requests"]) > 1:
        out.append("each request's rows vs that request run alone through the single-device block (worst layer):")
        out += _requests_table(res["requests"])
    mem = res.get("activation_memory")
    if mem:
        held = sorted({b for rank in mem["bytes_per_layer_by_rank"] for b in rank})
        line = (f"activation memory saved for backward per layer and rank (one sequence of {mem['tokens']} tokens): "
                f"{' / '.join(kib(b) for b in held)} KiB measured")
        if "formula_bytes_per_layer" in mem:
            line += (f", {kib(mem['formula_bytes_per_layer'])} KiB by tp/memory_model.py: "
                     + ("equal on every rank" if mem["matches_formula"] else "DIFFERENT"))
        out.append(line)
    outside = res.get("outside_blocks", {}).get("collectives")
    if outside:
        out.append("outside the blocks (the stack's input is split by rows, no communication): "
                   + ", ".join(f"{c['sublayer']}/{c['site']} {c['kind']} {'x'.join(map(str, c['shape']))} "
                               f"{kib(c['bytes_per_rank'])} KiB sent/rank" for c in outside))
    b = res["backward"]
    out.append(f"backward: {counts_text(b['collectives'])}, {kib(b['bytes_per_rank'])} KiB sent/rank; "
               f"ledger matches model (forward and backward): {'true' if res['ledger_matches_model'] else 'FALSE'}")
    if "profile" in res:
        pr = res["profile"]
        out.append(f"profiler trace: {pr['trace']} (one per rank); {pr['collectives_in_trace']} collectives parsed "
                   f"back, per layer in order, kind and size equal to the ledger: "
                   f"{'yes' if pr['trace_matches_ledger'] else 'NO'}")
    return out


def render_tp(report: dict) -> str:
    c, m = report["config"], report["config"]["model"]
    p = report["world_size"]
    family = c.get("family", "gpt2")
    llama, title = families.family(family).llama_lm, families.family(family).title
    out = [
        f"tpref: tensor-parallel block check  (tp = {p}, backend {report['backend']}, device {report['device']})",
        f"model {c['model_name']} ({title} blocks): d={m['d_model']} h={m['n_heads']} "
        + (f"h_kv={m['n_kv_heads']} " if llama else "")
        + f"d_head={m['d_head']} k={m['n_heads'] * m['d_head']} ffn={m['d_ffn']} L={m['n_layers']}; "
        f"dtype={c['dtype']}" + (f" ({c['dtype_from']})" if c.get("dtype_from") else "") + f" seed={c['seed']}",
    ]
    out.append(f"weights: {title} checkpoint {c['hf_checkpoint']}" if c.get("hf_checkpoint")
               else f"weights: random (seed {c['seed']}), " + ("RMSNorm weights included (no biases)" if llama
                                                             else "biases and LayerNorms included"))
    lengths = c["requests"]
    if len(lengths) == 1:
        out.append(f"input: one sequence of n_tokens={lengths[0]}")
    else:
        cu = list(accumulate(lengths, initial=0))
        shown = (lambda xs: str(xs) if len(xs) <= 12 else f"[{', '.join(map(str, xs[:10]))}, ...] ({len(xs)})")
        w = report["attention_work"]
        out.append(f"input: {len(lengths)} requests {shown(lengths)} flattened to [{cu[-1]} x {m['d_model']}], "
                   f"cu_seqlens {shown(cu)}")
        out.append(f"attention score entries per head per layer: varlen {w['varlen']:,}, one [T x T] square with "
                   f"cross-request blocks masked {w['flat_masked']:,}, padded to the longest {w['padded']:,} "
                   f"(varlen/padded {_ratio(w['varlen'], w['padded'])})")
    variants = report["variants"]
    for v, res in variants.items():
        out += render_variant(v, res, c["tolerance"], family)
    out.append("")
    if "v1" in variants and "v2" in variants:
        a, b = variants["v2"]["totals"], variants["v1"]["totals"]
        out.append(
            f"v2/v1 per forward: collectives {_ratio(sum(a['collectives'].values()), sum(b['collectives'].values()))}, "
            f"bytes sent/rank {_ratio(a['bytes_per_rank'], b['bytes_per_rank'])}, "
            f"collective time {_ratio(a['time_s'], b['time_s'])}, "
            f"forward time {_ratio(variants['v2']['forward_time_s'], variants['v1']['forward_time_s'])}")
    timed = {v: res["forward_time_s"] / res["forward_time_padded_s"] for v, res in variants.items()
             if res.get("forward_time_padded_s")}
    if timed:
        out.append("forward time varlen/padded: " + ", ".join(f"{v} {r:.3f}" for v, r in timed.items()))
    if "v2sp" in variants and "v2" in variants:
        a, b = variants["v2sp"]["totals"], variants["v2"]["totals"]
        out.append(f"v2sp/v2 per forward, inside the blocks: collectives "
                   f"{_ratio(sum(a['collectives'].values()), sum(b['collectives'].values()))}, bytes sent/rank "
                   f"{_ratio(a['bytes_per_rank'], b['bytes_per_rank'])} (n padded to a multiple of p: 1 when p | n), "
                   f"forward time {_ratio(variants['v2sp']['forward_time_s'], variants['v2']['forward_time_s'])}")
        a, b = (max(map(max, variants[v]["activation_memory"]["bytes_per_layer_by_rank"])) for v in ("v2sp", "v2"))
        out.append(f"v2sp/v2 activation memory per layer and rank: {_ratio(a, b)}")
    if "intra_head" in variants and "v2" in variants:
        a, b = variants["intra_head"]["totals"], variants["v2"]["totals"]
        out.append(f"intra_head/v2 per forward: bytes sent/rank {_ratio(a['bytes_per_rank'], b['bytes_per_rank'])} "
                   f"(its scores all-reduce [h, sum L^2] grows with the square of request length)")
    per_layer = "; ".join(f"{v}: {counts_text(res['layers'][0]['collective_counts'])} per layer"
                          for v, res in variants.items())
    failed = [v for v, res in variants.items() if not res["equivalent"]]
    out.append(("PASS" if report["equivalent"] else "FAIL") + f": {', '.join(variants)} at tp={p} "
               + ("match the single-device block" if not failed
                  else f"differ from the single-device block ({', '.join(failed)})")
               + f" ({per_layer})")
    if not report["traffic_ok"]:
        out.append("FAIL: the traffic ledger, CommDebugMode, the model or the profiler trace disagree (see above)")
    return "\n".join(out)
