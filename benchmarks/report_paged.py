"""The paged KV cache section of docs/benchmarks.md (benchmarks/bench_paged.py, and bench_serve.py's `hf` part)."""

from __future__ import annotations

from benchmarks.report_serve import met


def section(paged: dict | None, serve_p1: dict | None) -> list[str]:
    if not paged:
        return []
    p = paged["world_size"]
    lines = ["## Paged KV cache: a shared prefix, memory, launch shape", "",
             f"`torchrun --nproc_per_node={p} benchmarks/bench_paged.py` (article03, float32, v2, p = {p}; medians "
             "of 3 runs where timed). Ratios from one run each.", ""]
    targets = []
    if "prefix" in paged:
        x = paged["prefix"]
        on, off = x["on"], x["off"]
        lines += [f"**Shared prefix.** {x['requests']} requests share a {x['prefix']}-token prefix, then 8–23 tokens of "
                  f"their own, {x['max_new_tokens']} new tokens each, one arriving per iteration (chunk_size "
                  f"{x['chunk_size']}, max_batched_tokens {x['max_batched_tokens']}). Same tokens with and without "
                  f"the cache: {'yes' if x['same_ids'] else '**no**'}.", "",
                  "| prefix_cache | rows computed | prompt tokens from the cache | iterations | time to finish | "
                  "mean TTFT |", "|---|---|---|---|---|---|"]
        for name, r in (("false", off), ("true", on)):
            lines.append(f"| {name} | {r['rows_computed']:,} | {r['prefix_hit_tokens']:,} | {r['iterations']} | "
                         f"{r['time_s'] / off['time_s']:.3f} | {r['mean_ttft_s'] / off['mean_ttft_s']:.3f} |")
        lines += ["", "(times relative to prefix_cache=false)", ""]
        targets.append(f"- Shared prefix: {x['finish_speedup']:.2f}× faster to finish with the prefix cache "
                       f"(target ≥ 3×: {met(x['finish_speedup'] >= 3)}); mean TTFT {x['ttft_speedup']:.1f}× lower.")
    if "memory" in paged:
        m = paged["memory"]
        lines += [f"**Memory.** One budget of {m['positions']} token positions per rank; {m['requests']} requests "
                  f"(lognormal prompts, {min(m['prompt_lengths'])}–{max(m['prompt_lengths'])} tokens) with "
                  f"{m['max_new_tokens']} new tokens each, all arriving at once; prefix caching off. Paged: blocks of "
                  f"16 taken as the context grows, preemption when none is free. Reserved: the rule before paging, "
                  f"prompt + max_new_tokens − 1 positions taken at admission (block_size 1, reserve_capacity). "
                  f"Same tokens: {'yes' if m['same_ids'] else '**no**'}.", "",
                  "| layout | peak reserved (positions) | holding K,V then | largest waste per running request | "
                  "running at once (max / mean) | preemptions | time to finish |",
                  "|---|---|---|---|---|---|---|"]
        for name in ("reserved", "paged"):
            r = m[name]
            lines.append(f"| {name} | {r['peak_reserved_positions']:,} | {r['held_positions_at_peak']:,} "
                         f"({r['used_over_reserved_at_peak']:.0%}) | {r['max_waste_positions_per_request']:.1f} "
                         f"positions | {r['max_running']} / {r['mean_running']:.1f} | {r['preemptions']} | "
                         f"{r['time_s'] / m['reserved']['time_s']:.3f} |")
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
                  "bench_serve's overhead measure).", "",
                  "| requests | ops, batched | ops, reference | engine iteration ÷ bare forward (batched) |",
                  "|---|---|---|---|"]
        over = {r["batch"]: r for r in s["overhead"]}
        for r in s["ops"]:
            o = over.get(r["batch"])
            lines.append(f"| {r['batch']} | {r['batched']} | {r['reference']} | "
                         f"{o['iteration_over_bare']:.3f} |" if o else "- |")
        lines.append("")
        flat = len({r["batched"] for r in s["ops"]}) == 1
        big = [r for r in s["overhead"] if r["batch"] >= 8]
        worst = max(r["iteration_over_bare"] for r in big) if big else float("nan")
        targets.append(f"- Launch shape: the batched iteration runs {s['ops'][0]['batched']} aten operations for "
                       f"every number of requests ({'constant' if flat else '**not constant**'}), the reference "
                       f"{s['ops'][-1]['reference']} at {s['ops'][-1]['batch']}; engine iteration ÷ bare forward at "
                       f"8 requests or more at most {worst:.3f}× (target ≤ 1.05×: {met(worst <= 1.05)}; was 1.11× "
                       "at 32).")
    if serve_p1 and "hf" in serve_p1:
        h = serve_p1["hf"]
        best = max(h["hf"], key=lambda b: b["tokens_per_s"])
        ratio = h["engine"]["tokens_per_s"] / best["tokens_per_s"]
        targets.append(f"- Against transformers (bench_serve's workload, p = 1): the engine makes {ratio:.2f}× the "
                       f"tokens/s of transformers' best static batch (batch {best['batch']}) (target ≥ 3×: "
                       f"{met(ratio >= 3)}; was 2.52×).")
    return lines + ["Targets:", ""] + targets + [""]
