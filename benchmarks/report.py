"""Write docs/benchmarks.md from the JSON files the benchmarks left in outputs/.

    make bench      # runs every benchmark, then this

A section whose benchmark left no JSON here (run on another day, or not at all) stays on the page as it stands;
every section with data is rewritten from it.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_http import section as http_section  # noqa: E402
from benchmarks.bench_load import section as load_section  # noqa: E402
from benchmarks.bench_pp import section as pp_section  # noqa: E402
from benchmarks.bench_pp_serve import plot as pp_serve_plot, section as pp_serve_section  # noqa: E402
from benchmarks.bench_threads import section as threads_section  # noqa: E402
from benchmarks.report_paged import section as paged_section  # noqa: E402
from benchmarks.report_serve import pd_section, plot_timeline, section as serving_section  # noqa: E402
from layers.models.config import VARIANTS  # noqa: E402

OUT = Path("outputs")


def _load(name: str):
    path = OUT / name
    return json.loads(path.read_text()) if path.exists() else None


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return (f"{cpu}, {os.cpu_count()} cores, {gpus} GPU(s); Python {platform.python_version()}, "
            f"torch {torch.__version__}")


def main() -> int:
    lines = ["# Benchmarks", "",
             "Reproduce everything on this page with `make bench` (about 25 minutes on 2 cores); it runs the",
             "scripts below and rewrites this file from their JSON output. Every figure is a ratio of two",
             "timings taken in the same run (medians, slowest rank), never a lone absolute time.", "",
             f"Machine: {machine()}.", ""]
    tp = _load("bench_tp.json")
    if tp:
        lines += ["## v2 against DTensor, and the distance to the limit", "",
                  "`.venv/bin/python benchmarks/bench_tp.py`: article03 stack (d=512, h=8, ffn=2048, L=8), float32, forward.",
                  "DTensor = `parallelize_module` with `ColwiseParallel`/`RowwiseParallel` on the same weights",
                  "(fused QKV rows reordered rank-major so DTensor's contiguous cut is head-aligned); both outputs",
                  "agree to the listed relative difference. Distance = our v2 forward / (the same forward with",
                  "every collective skipped + the same all-reduces issued alone).", "",
                  "| backend | p | n_tokens | ours / DTensor | v1 / v2 | distance to limit | rel. diff vs DTensor |",
                  "|---|---|---|---|---|---|---|"]
        for r in tp["rows"]:
            lines.append(f"| {r['backend']} | {r['p']} | {r['n']} | {r['ours_over_dtensor']:.3f} | "
                         f"{r['v1_over_v2']:.3f} | {r['distance_to_limit']:.3f} | {r['max_rel_diff_vs_dtensor']:.1e} |")
        lines.append("")
    prof = OUT / "profile_forward.txt"
    if prof.exists():
        lines += ["## Where a forward spends its time", "",
                  "`.venv/bin/torchrun --nproc_per_node=2 benchmarks/profile_forward.py` (torch.profiler's operator table;",
                  "attention's share fell when SDPA got 4-D inputs, which keep PyTorch on its fused CPU kernel):", "",
                  "```", prof.read_text().rstrip(), "```", ""]
    ledger = [(p, _load(f"bench_ledger_p{p}.json")) for p in (2, 8)]
    if any(d for _, d in ledger):
        lines += ["## Traffic ledger overhead", "",
                  "`.venv/bin/torchrun --nproc_per_node=P benchmarks/bench_ledger.py`: forward with the ledger on / off.", "",
                  "| p | variant | n_tokens | on / off |", "|---|---|---|---|"]
        for p, d in ledger:
            for r in (d or {}).get("rows", []):
                lines.append(f"| {p} | {r['variant']} | {r['n']} | {r['ratio']:.3f} |")
        lines.append("")
    varlen = _load("bench_varlen.json")
    if varlen:
        lines += ["## Varlen against padded attention", "",
                  f"`.venv/bin/torchrun --nproc_per_node={varlen['world_size']} benchmarks/bench_varlen.py`: "
                  f"{varlen['variant']}, article03 shapes, 2 layers.", "",
                  "| mix | requests | tokens | varlen entries | padded entries | work varlen/padded | time varlen/padded |",
                  "|---|---|---|---|---|---|---|"]
        for r in varlen["rows"]:
            w = r["score_entries"]
            lines.append(f"| {r['mix']} | {r['requests']} | {r['tokens']} | {w['varlen']:,} | {w['padded']:,} | "
                         f"{w['varlen'] / w['padded']:.3f} | {r['time_varlen_s'] / r['time_padded_s']:.3f} |")
        lines.append("")
    sweep = _load("traffic_sweep/sweep.json")
    if sweep:
        lines += ["## Scaling: bytes and time per layer vs n_tokens and p", "",
                  "`python launch/traffic_sweep.py`: bytes each rank sends per layer (ledger, equal to the model)",
                  "and the layer's collective time relative to n = 16 at the same p.", "",
                  "| p | variant | " + " | ".join(f"n={n}" for n in sorted({r['n'] for r in sweep['measured']})) + " |",
                  "|---|---|" + "---|" * len({r['n'] for r in sweep["measured"]})]
        ns = sorted({r["n"] for r in sweep["measured"]})
        for p in sorted({r["p"] for r in sweep["measured"]}):
            for v in VARIANTS:
                by = {r["n"]: r for r in sweep["measured"] if r["p"] == p and r["variant"] == v}
                base = by.get(ns[0])
                cells = [f"{by[n]['measured_bytes_per_rank'] / 1024:,.0f} KiB, t×{by[n]['time_s'] / base['time_s']:.1f}"
                         if n in by and base and base["time_s"] else "-" for n in ns]
                lines.append(f"| {p} | {v} | " + " | ".join(cells) + " |")
        lines += ["", "Bytes grow linearly in n for v1 and v2 (v2 = 4/7 of v1 at every point) and as n² for",
                  "intra_head's scores all-reduce. Times on this machine grow far slower than bytes at small n:",
                  "a collective among processes sharing 2 cores costs milliseconds of scheduling before it moves",
                  "a byte.", ""]
    Path("docs").mkdir(exist_ok=True)
    print(plot_timeline(OUT))
    lines += serving_section(OUT) + paged_section(_load("bench_paged_p1.json"), _load("bench_serve_p1.json"))
    lines += pd_section(OUT)
    lines += pp_section([run for run in (_load(f"bench_pp_pp{pp}.json") for pp in (2, 4)) if run])
    pp_serve = _load("bench_pp_serve.json")
    if pp_serve:
        print(pp_serve_plot(pp_serve))
    lines += pp_serve_section(pp_serve)
    for name, render in (("bench_kv.json", kv_section), ("bench_http.json", http_section),
                         ("bench_load.json", load_section), ("bench_threads.json", threads_section)):
        data = _load(name)
        if data:
            lines += render(data)
    page = Path("docs/benchmarks.md")
    text, kept = merge("\n".join(lines) + "\n", page.read_text() if page.exists() else "")
    page.write_text(text)
    print("wrote docs/benchmarks.md" + (f"; kept as they stand (no data in outputs/): {', '.join(kept)}" if kept else ""))
    return 0


def sections(text: str) -> tuple[str, dict[str, str]]:
    """The page's preamble, and each "## " section (its heading line -> its whole text), in order."""
    parts = text.split("\n## ")
    return parts[0], {("## " + p).split("\n", 1)[0]: "## " + p for p in parts[1:]}


def merge(new: str, old: str) -> tuple[str, list[str]]:
    """The sections rendered now replace theirs on the page; a section the page has and this run has no data for
    (its benchmark not run here) stays as it stands, in its place; a section new to the page goes after the one
    rendered before it. Returns the page and the headings kept (a renamed heading's old section is kept too: delete
    it by hand)."""
    head, fresh = sections(new)
    _, before = sections(old)
    order = list(before)
    previous = None
    for h in fresh:
        if h not in order:
            order.insert(order.index(previous) + 1 if previous in order else len(order), h)
        previous = h
    kept = [h for h in before if h not in fresh]
    body = [fresh.get(h) or before[h] for h in order]
    return "\n".join([head.rstrip("\n") + "\n"] + [b.rstrip("\n") + "\n" for b in body]), [h[3:] for h in kept]


def _kib(b: float) -> str:
    return f"{b / 1024:g} KiB"


def kv_section(kv: dict) -> list[str]:
    """KV cache per token per rank: measured in the engine's cache beside 2·L·max(h_kv/p, 1)·d_head·e."""
    m, sizes = kv["model"], sorted({r["p"] for r in kv["rows"]})
    lines = ["## KV cache per token per rank: MHA vs GQA vs p", "",
             f"`.venv/bin/torchrun --nproc_per_node={kv['world_size']} benchmarks/bench_kv.py`: the serving engine on "
             f"llama_tiny's shape (h = {m['n_heads']} query heads of d_head = {m['d_head']}, L = {m['n_layers']}, "
             f"{kv['dtype']}), {len(kv['requests'])} requests, each run's tokens checked against the "
             "single-device oracle. Measured: the bytes the rank's cache tensors held per token position at their "
             "peak (every rank of the group agrees; attention wrote every token's K,V into those tensors and read them "
             "back, and the tokens equal the oracle's); formula: 2·L·max(h_kv/p, 1)·d_head·e.", "",
             "| attention | h_kv | " + " | ".join(f"p = {p}" for p in sizes) + " |",
             "|---|---|" + "---|" * len(sizes)]
    for name in dict.fromkeys(r["attention"] for r in kv["rows"]):
        rows = {r["p"]: r for r in kv["rows"] if r["attention"] == name}
        h_kv = next(iter(rows.values()))["n_kv_heads"]
        cells = []
        for p in sizes:
            r = rows.get(p)
            if r is None:
                cells.append("-")
                continue
            got = ", ".join(f"{b:,}" for b in r["measured_per_rank"])
            mark = "" if r["ok"] else " **≠**"
            cells.append(f"{got} B ({r['formula']:,}){mark}, {r['cache_heads'][0]} head"
                         + ("s" if r["cache_heads"][0] > 1 else ""))
        lines.append(f"| {name} | {h_kv} | " + " | ".join(cells) + " |")
    lines += ["", "Each cell: measured bytes (formula), K,V heads per rank. MHA halves with every doubling of p; "
              "GQA stops at p = h_kv = 2 and MQA never shrinks: from there on each K,V head is replicated on "
              "p/h_kv ranks. " + ("Every measurement equals the formula and every run's tokens equal the oracle's."
                                  if kv["ok"] else "**Some measurement or token check failed (≠ above).**"), ""]
    ps = sorted({int(p) for r in kv["real_sizes_fp16"] for p in r["per_rank"]})
    lines += ["The same formula at real sizes, fp16 (formula only):", "",
              "| model | " + " | ".join(f"p = {p}" for p in ps) + " |", "|---|" + "---|" * len(ps)]
    for r in kv["real_sizes_fp16"]:
        per = {int(p): b for p, b in r["per_rank"].items()}
        lines.append(f"| {r['model']} | " + " | ".join(_kib(per[p]) if p in per else "-" for p in ps) + " |")
    lines += ["", "MLA caches one latent vector per token that every TP rank holds whole, so its per-rank cache "
              "does not shrink with p at all; GQA's stops shrinking at p = h_kv.", ""]
    return lines


if __name__ == "__main__":
    sys.exit(main())
