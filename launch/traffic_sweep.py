"""Bytes per rank per layer vs n_tokens and p, measured by the traffic ledger, beside the analytic model.

    python launch/traffic_sweep.py                          # n = 16..4096, p = 2, 4, 8, article03
    python launch/traffic_sweep.py --p 2 4 --tokens 16 256 --out outputs/sweep

Prints a table, writes sweep.json and (with matplotlib installed: pip install -e .[plot])
sweep.png: one panel per p, measured points on the model's lines, log-log. The
intra_head counterfactual is measured up to --intra-head-max-n (its [h, n, n] scores
need h·n²·4 bytes per rank: 512 MiB at n = 4096) and modelled beyond.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from launch.spawn import spawn_ranks
from layers.models.config import ALL_VARIANTS as VARIANTS, ModelConfig, validate_model, validate_variants
from layers.models.dense import DenseStack, init_weights
from layers.models.tp_block import shard_stack
from tp.dist import ConfigError, TPContext
from tp.ledger import TrafficLedger
from tp.traffic_model import bytes_per_rank_per_layer

MODEL = ModelConfig(n_layers=2)  # article03 shapes; bytes per layer do not depend on L


def measure(ctx: TPContext, cfg: ModelConfig, ns: list[int], intra_head_max_n: int, repeats: int) -> list[dict]:
    """On every rank: for each n and variant, the ledger's bytes per layer and median collective time."""
    dense = init_weights(DenseStack(cfg, torch.float32, ctx.device), seed=0)
    rows = []
    for variant in VARIANTS:
        stack = shard_stack(dense, variant, ctx.group)
        for n in ns:
            if variant == "intra_head" and n > intra_head_max_n or variant == "v2sp" and n < ctx.world_size:
                continue
            x = torch.randn(n, cfg.d_model, generator=torch.Generator().manual_seed(n)).to(ctx.device)
            ledger = TrafficLedger(ctx.world_size, ctx.device, timing=True)
            times = []
            with torch.no_grad():
                for rep in range(repeats + 1):
                    ledger.clear()
                    with ledger.attach(stack):
                        stack(x)
                    if rep:
                        times.append(sum(r.time_s for r in ledger.records if r.layer == 0))
            layer0 = [r for r in ledger.records if r.layer == 0]
            rows.append({"p": ctx.world_size, "n": n, "variant": variant,
                         "measured_bytes_per_rank": sum(r.bytes_per_rank for r in layer0),
                         "collectives": len(layer0),
                         "time_s": statistics.median(times) if times else 0.0})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--p", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 256, 1024, 4096], help="n_tokens values")
    ap.add_argument("--intra-head-max-n", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--out", default="outputs/traffic_sweep")
    args = ap.parse_args(argv)
    try:
        for p in args.p:
            validate_model(MODEL, p)
            validate_variants(MODEL, p, list(VARIANTS))
        if min(args.tokens) < 1:
            raise ConfigError("--tokens values must be at least 1")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    rows = []
    for p in args.p:
        start = time.perf_counter()
        rows += spawn_ranks(p, measure, MODEL, args.tokens, args.intra_head_max_n, args.repeats, backend=args.backend)
        print(f"p={p}: measured in {time.perf_counter() - start:.0f}s", file=sys.stderr)
    for row in rows:
        row["model_bytes_per_rank"] = bytes_per_rank_per_layer(MODEL, row["p"], row["n"], torch.float32, row["variant"])
    model_only = [{"p": p, "n": n, "variant": v,
                   "model_bytes_per_rank": bytes_per_rank_per_layer(MODEL, p, n, torch.float32, v)}
                  for p in args.p for n in args.tokens for v in VARIANTS]

    print(f"bytes sent per rank per layer, forward, article03 shapes (d={MODEL.d_model}, h={MODEL.n_heads}, "
          f"ffn={MODEL.d_ffn}), float32; time = median collective time of one layer")
    print(f"{'p':>2} {'n':>5} {'variant':>10} {'coll':>4} {'measured KiB':>13} {'model KiB':>11} {'equal':>5} "
          f"{'time ms':>8} {'v2/v1 bytes':>11}")
    by = {(r["p"], r["n"], r["variant"]): r for r in rows}
    for r in rows:
        v1 = by.get((r["p"], r["n"], "v1"))
        ratio = (f"{r['measured_bytes_per_rank'] / v1['measured_bytes_per_rank']:.3f}"
                 if r["variant"] == "v2" and v1 else "")
        print(f"{r['p']:>2} {r['n']:>5} {r['variant']:>10} {r['collectives']:>4} "
              f"{r['measured_bytes_per_rank'] / 1024:>13.1f} {r['model_bytes_per_rank'] / 1024:>11.1f} "
              f"{'yes' if r['measured_bytes_per_rank'] == r['model_bytes_per_rank'] else 'NO':>5} "
              f"{r['time_s'] * 1e3:>8.2f} {ratio:>11}")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps({"model": MODEL.asdict(), "measured": rows, "model_lines": model_only},
                                               indent=2) + "\n")
    print(f"data: {out / 'sweep.json'}")
    try:
        plot(rows, model_only, args.p, out / "sweep.png")
        print(f"plot: {out / 'sweep.png'}")
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install -e .[plot])")
    return 0 if all(r["measured_bytes_per_rank"] == r["model_bytes_per_rank"] for r in rows) else 1


def plot(rows: list[dict], model_only: list[dict], ps: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"v1": "tab:blue", "v2": "tab:green", "intra_head": "tab:red", "v2sp": "tab:olive"}  # v2sp on v2
    fig, axes = plt.subplots(1, len(ps), figsize=(5 * len(ps), 4.2), sharey=True, squeeze=False)
    for ax, p in zip(axes[0], ps):
        for v in VARIANTS:
            line = sorted((r["n"], r["model_bytes_per_rank"]) for r in model_only if r["p"] == p and r["variant"] == v)
            ax.plot([a for a, _ in line], [b for _, b in line], color=colors[v], label=f"{v} model")
            pts = sorted((r["n"], r["measured_bytes_per_rank"]) for r in rows if r["p"] == p and r["variant"] == v)
            ax.plot([a for a, _ in pts], [b for _, b in pts], "o", color=colors[v], mfc="none", label=f"{v} measured")
        ax.set(xscale="log", yscale="log", title=f"p = {p}", xlabel="n_tokens")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("bytes sent per rank per layer (forward)")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle("TP traffic per layer: ledger (points) vs ring model (lines); intra_head grows as n^2")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
