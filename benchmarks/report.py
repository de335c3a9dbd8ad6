"""Write docs/benchmarks.md from the JSON files the benchmarks left in outputs/.

    make bench      # runs every benchmark, then this

A section whose benchmark left no JSON here (run on another day, or not at all) stays on the page as it stands;
every section with data is rewritten from it.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_decode import section as decode_section  # noqa: E402
from benchmarks.bench_http import section as http_section  # noqa: E402
from benchmarks.bench_kv import section as kv_section  # noqa: E402
from benchmarks.bench_kv_tiers import section as kv_tiers_section  # noqa: E402
from benchmarks.bench_load import section as load_section  # noqa: E402
from benchmarks.bench_pp import section as pp_section  # noqa: E402
from benchmarks.bench_pp_serve import plot as pp_serve_plot, section as pp_serve_section  # noqa: E402
from benchmarks.bench_threads import section as threads_section  # noqa: E402
from benchmarks.bench_tp import section as tp_section  # noqa: E402
from benchmarks.bench_train import section as train_section  # noqa: E402
from benchmarks.common import OUT, load_json, merge, table  # noqa: E402
from benchmarks.report_paged import section as paged_section  # noqa: E402
from benchmarks.report_serve import pd_section, plot_timeline, section as serving_section  # noqa: E402
from layers.models.config import VARIANTS  # noqa: E402


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
    head = ["# Benchmarks", "",
             "Reproduce everything on this page with `make bench` (about 25 minutes on 2 cores, after `make model`",
             "trains the model the speculative-decoding benchmark measures, which it runs first if need be); it runs",
             "the scripts below and rewrites this file from their JSON output. Every figure is a ratio of two",
             "timings taken in the same run (medians, slowest rank), never a lone absolute time.", "",
             f"Machine: {machine()}.", ""]
    Path("docs").mkdir(exist_ok=True)
    print(plot_timeline(OUT))  # first: the serving section shows the figure where there is one
    pp_serve = load_json("bench_pp_serve.json")
    if pp_serve:
        print(pp_serve_plot(pp_serve))
    lines = tp_section(load_json("bench_tp.json")) + profile_section(OUT / "profile_forward.txt")
    lines += ledger_section({p: load_json(f"bench_ledger_p{p}.json") for p in (2, 8)})
    lines += varlen_section(load_json("bench_varlen.json")) + sweep_section(load_json("traffic_sweep/sweep.json"))
    lines += serving_section(OUT) + paged_section(load_json("bench_paged_p1.json"), load_json("bench_serve_p1.json"))
    lines += pd_section(load_json("bench_pd.json"))
    lines += pp_section([run for run in (load_json(f"bench_pp_pp{pp}.json") for pp in (2, 4)) if run])
    lines += pp_serve_section(pp_serve) + kv_section(load_json("bench_kv.json"))
    lines += http_section(load_json("bench_http.json")) + load_section(load_json("bench_load.json"))
    lines += threads_section(load_json("bench_threads.json")) + train_section(load_json("bench_train.json"))
    lines += decode_section(load_json("bench_decode.json")) + kv_tiers_section(load_json("bench_kv_tiers.json"))
    page = Path("docs/benchmarks.md")
    if not lines and page.exists():  # the machine line belongs to the figures on the page: nothing to rewrite
        print("no data in outputs/: docs/benchmarks.md left as it stands")
        return 0
    text, kept = merge("\n".join(head + lines) + "\n", page.read_text() if page.exists() else "")
    page.write_text(text)
    print("wrote docs/benchmarks.md"
          + (f"; kept as they stand (no data in outputs/): {', '.join(kept)}" if kept else ""))
    return 0


def profile_section(path: Path) -> list[str]:
    if not path.exists():
        return []
    return ["## Where a forward spends its time", "",
            "`.venv/bin/torchrun --nproc_per_node=2 benchmarks/profile_forward.py` (torch.profiler's operator table;",
            "attention's share fell when SDPA got 4-D inputs, which keep PyTorch on its fused CPU kernel):", "",
            "```", path.read_text().rstrip(), "```", ""]


def ledger_section(runs: dict[int, dict | None]) -> list[str]:
    if not any(runs.values()):
        return []
    rows = [[p, r["variant"], r["n"], f"{r['ratio']:.3f}"] for p, d in runs.items() for r in (d or {}).get("rows", [])]
    return ["## Traffic ledger overhead", "",
            "`.venv/bin/torchrun --nproc_per_node=P benchmarks/bench_ledger.py`: forward with the ledger on / off.", "",
            *table(["p", "variant", "n_tokens", "on / off"], rows), ""]


def varlen_section(varlen: dict | None) -> list[str]:
    if not varlen:
        return []
    rows = []
    for r in varlen["rows"]:
        w = r["score_entries"]
        rows.append([r["mix"], r["requests"], r["tokens"], f"{w['varlen']:,}", f"{w['padded']:,}",
                     f"{w['varlen'] / w['padded']:.3f}", f"{r['time_varlen_s'] / r['time_padded_s']:.3f}"])
    return ["## Varlen against padded attention", "",
            f"`.venv/bin/torchrun --nproc_per_node={varlen['world_size']} benchmarks/bench_varlen.py`: "
            f"{varlen['variant']}, article03 shapes, 2 layers.", "",
            *table(["mix", "requests", "tokens", "varlen entries", "padded entries", "work varlen/padded",
                    "time varlen/padded"], rows), ""]


def sweep_section(sweep: dict | None) -> list[str]:
    """Bytes per rank per layer and the collective time relative to the smallest n, from launch/traffic_sweep.py."""
    if not sweep:
        return []
    measured = sweep["measured"]
    ns = sorted({r["n"] for r in measured})
    rows = []
    for p in sorted({r["p"] for r in measured}):
        for v in VARIANTS:
            by = {r["n"]: r for r in measured if r["p"] == p and r["variant"] == v}
            base = by.get(ns[0])
            rows.append([p, v] + [f"{by[n]['measured_bytes_per_rank'] / 1024:,.0f} KiB, "
                                  f"t×{by[n]['time_s'] / base['time_s']:.1f}" if n in by and base and base["time_s"]
                                  else "-" for n in ns])
    return ["## Scaling: bytes and time per layer vs n_tokens and p", "",
            "`python launch/traffic_sweep.py`: bytes each rank sends per layer (ledger, equal to the model)",
            "and the layer's collective time relative to n = 16 at the same p.", "",
            *table(["p", "variant"] + [f"n={n}" for n in ns], rows), "",
            "Bytes grow linearly in n for v1 and v2 (v2 = 4/7 of v1 at every point) and as n² for",
            "intra_head's scores all-reduce. Times on this machine grow far slower than bytes at small n:",
            "a collective among processes sharing 2 cores costs milliseconds of scheduling before it moves",
            "a byte.", ""]


if __name__ == "__main__":
    sys.exit(main())
