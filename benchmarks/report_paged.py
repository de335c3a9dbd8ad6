"""The paged KV cache section of docs/benchmarks.md (benchmarks/bench_paged.py, and bench_serve.py's `hf` part)."""

from __future__ import annotations

from benchmarks.common import table
from benchmarks.report_serve import met


def section(paged: dict | None, serve_p1: dict | None) -> list[str]:
    if not paged:
        return []
    p = paged["world_size"]
    lines = ["## Paged KV cache: a shared prefix, memory, launch shape", "",
             f"`.venv/bin/torchrun --nproc_per_node={p} benchmarks/bench_paged.py` (article03, float32, v2, p = {p}; "
             "medians "
             "of 3 runs where timed). Ratios from one run each.", ""]
    targets = []
    if "prefix" in paged:
        x = paged["prefix"]
        on, off = x["on"], x["off"]
        lines += [f"**Shared prefix.** {x['requests']} requests share a {x['prefix']}-token prefix, then 8–23 tokens "
                  f"of their own, {x['max_new_tokens']} new tokens each, one arriving per iteration "
                  f"(long_prefill_token_threshold {x['chunk_size']}, "
                  f"max_num_batched_tokens {x['max_batched_tokens']}). "
                  "Same tokens with and without "
                  f"the cache: {'yes' if x['same_ids'] else '**no**'}.", ""]
        lines += table(["enable_prefix_caching", "rows computed", "prompt tokens from the cache", "iterations",
                        "time to finish", "mean TTFT"],
                       [[name, f"{r['rows_computed']:,}", f"{r['prefix_hit_tokens']:,}", r["iterations"],
                         f"{r['time_s'] / off['time_s']:.3f}", f"{r['mean_ttft_s'] / off['mean_ttft_s']:.3f}"]
                        for name, r in (("false", off), ("true", on))])
        lines += ["", "(times relative to enable_prefix_caching=false)", ""]
        targets.append(f"- Shared prefix: {x['finish_speedup']:.2f}× faster to finish with the prefix cache "
                       f"(target ≥ 3×: {met(x['finish_speedup'] >= 3)}); mean TTFT {x['ttft_speedup']:.1f}× lower.")
    if "memory" in paged:
        m = paged["memory"]
        lines += [f"**Memory.** One budget of {m['positions']} token positions per rank; {m['requests']} requests "
                  f"(lognormal prompts, {min(m['prompt_lengths'])}–{max(m['prompt_lengths'])} tokens) with "
                  f"{m['max_new_tokens']} new tokens each, all arriving at once; prefix caching off. Paged: blocks of "
                  f"16 taken as the context grows, preemption when none is free. Reserved: the rule before paging, "
                  f"prompt + max_new_tokens − 1 positions taken at admission (block_size 1, reserve_capacity). "
                  f"Same tokens: {'yes' if m['same_ids'] else '**no**'}.", ""]
        rows = []
        for name in ("reserved", "paged"):
            r = m[name]
            rows.append([name, f"{r['peak_reserved_positions']:,}",
                         f"{r['held_positions_at_peak']:,} ({r['used_over_reserved_at_peak']:.0%})",
                         f"{r['max_waste_positions_per_request']:.1f} positions",
                         f"{r['max_running']} / {r['mean_running']:.1f}", r["preemptions"],
                         f"{r['time_s'] / m['reserved']['time_s']:.3f}"])
        lines += table(["layout", "peak reserved (positions)", "holding K,V then", "largest waste per running request",
                        "running at once (max / mean)", "preemptions", "time to finish"], rows)
        lines.append("")
        waste = m["paged"]["max_waste_blocks_per_request"]
        targets.append(f"- Memory: paging wastes at most {waste:.2f} blocks per running request (target ≤ 1: "
                       f"{met(waste <= 1)}) and runs {m['running_ratio']:.2f}× the requests at once "
                       f"(target ≥ 1.5×: {met(m['running_ratio'] >= 1.5)}).")
    if "shape" in paged:
        s = paged["shape"]
        lines += [f"**Launch shape.** aten operations (TorchDispatchMode) in one decode-only iteration "
                  f"({s['layers']} layers: inputs built, forward, greedy head), and one engine decode iteration "
                  "over the same rows through the bare TP forward (no cache, each row its own one-token request: "
                  "bench_serve's overhead measure).", ""]
        over = {r["batch"]: f"{r['iteration_over_bare']:.3f}" for r in s["overhead"]}
        lines += table(["requests", "ops, batched", "ops, reference", "engine iteration ÷ bare forward (batched)"],
                       [[r["batch"], r["batched"], r["reference"], over.get(r["batch"], "-")] for r in s["ops"]])
        lines.append("")
        flat = len({r["batched"] for r in s["ops"]}) == 1
        big = [r for r in s["overhead"] if r["batch"] >= 8]
        worst = max(r["iteration_over_bare"] for r in big) if big else float("nan")
        targets.append(f"- Launch shape: the batched iteration runs {s['ops'][0]['batched']} aten operations for "
                       f"every number of requests ({'constant' if flat else '**not constant**'}), the reference "
                       f"{s['ops'][-1]['reference']} at {s['ops'][-1]['batch']}; engine iteration ÷ bare forward at "
                       f"8 requests or more at most {worst:.3f}× (target ≤ 1.05×: {met(worst <= 1.05)}; was 1.11× "
                       "at 32).")
    if "backends" in paged:
        lines += backends_table(paged["backends"])
        targets += backends_targets(paged["backends"])
    if serve_p1 and "hf" in serve_p1:
        targets += against_transformers(serve_p1["hf"])
    return lines + ["Targets:", ""] + targets + [""]


def backends_table(b: dict) -> list[str]:
    rows = b["rows"]
    names = list(dict.fromkeys(r["attention"] for r in rows))
    lines = [f"**Attention backends.** One decode-only iteration ({b['layers']} layers, block_size {b['block_size']}: "
             "inputs built, forward, greedy head) per backend, against the number of requests and their contexts "
             "(all 128 positions, all 512, or lognormal: median 100 with a long tail, capped at 1000); the time per "
             "iteration relative to the cpu backend's in the same cell, and in parentheses the share of the "
             "iteration inside attention (torch.profiler, the layers' paged_attention calls). cpu's own time is "
             "given in ms to show the scale.", ""]
    cells = {(r["context"], r["batch"], r["attention"]): r for r in rows}
    out = []
    for context in dict.fromkeys(r["context"] for r in rows):
        for batch in dict.fromkeys(r["batch"] for r in rows):
            base = cells.get((context, batch, "cpu"))
            if base is None:
                continue
            out.append([context, batch, base["longest"]])
            for name in names:
                r = cells[context, batch, name]
                lead = f"{r['iteration_s'] * 1e3:.1f} ms" if name == "cpu" else \
                    f"{r['iteration_s'] / base['iteration_s']:.2f}×"
                out[-1].append(f"{lead} ({r['attention_share']:.0%})")
    return lines + table(["contexts", "requests", "longest", *names], out) + [""]


def backends_targets(b: dict) -> list[str]:
    rows = b["rows"]
    cells = {(r["context"], r["batch"], r["attention"]): r["iteration_s"] for r in rows}
    pairs = [(k[:2], cells[k[0], k[1], "batched"] / cells[k]) for k in cells if k[2] == "cpu"
             and (k[0], k[1], "batched") in cells]
    worst = min(pairs, key=lambda x: x[1])
    best = max(pairs, key=lambda x: x[1])
    return [f"- Attention backends on this CPU: batched ÷ cpu time per decode iteration from {worst[1]:.2f}× "
            f"({worst[0][1]} requests, contexts {worst[0][0]}) to {best[1]:.2f}× ({best[0][1]} requests, contexts "
            f"{best[0][0]}); `auto` picks cpu on a CPU."]


def against_transformers(h: dict) -> list[str]:
    best = max(h["hf"], key=lambda b: b["tokens_per_s"])
    if "engines" not in h:
        ratio = h["engine"]["tokens_per_s"] / best["tokens_per_s"]
        return [f"- Against transformers (bench_serve's workload, p = 1): the engine makes {ratio:.2f}× the tokens/s "
                f"of transformers' best static batch (batch {best['batch']}) (target ≥ 3×: {met(ratio >= 3)}; "
                "was 2.52×)."]
    ratio = {(e["attention"], e["max_running"]): e.get("ratio_to_best_hf", e["tokens_per_s"] / best["tokens_per_s"])
             for e in h["engines"]}
    default = ratio[h["engines"][0]["attention"], "default"]
    tuned = max(v for (_, running), v in ratio.items() if running != "default")
    each = ", ".join(f"{a} {v:.2f}×" for (a, running), v in ratio.items() if running == "default")
    return [f"- Against transformers (bench_serve's workload, p = 1; transformers' best static batch is "
            f"{best['batch']}): at the engine's default settings {default:.2f}× "
            f"(target ≥ 3×: {met(default >= 3)}); "
            f"tuned (every request running at once) {tuned:.2f}× (target ≥ 3.5×: {met(tuned >= 3.5)}). "
            f"Per backend at the defaults: {each}. Each ratio is the median over rounds of the ratio within a round "
            "(the engine's "
            "settings and transformers' contenders run in turn), so the machine's drift falls on both sides."]
