"""Varlen vs padded attention: forward time and attention work for a few request-length mixes.

    torchrun --nproc_per_node=2 benchmarks/bench_varlen.py [--variant v2] [--repeats 10]

Each mix runs the TP stack (article03 shapes) with varlen attention (each request
alone, Σ Lᵢ² score entries per head) and with the padded baseline (every request
padded to the longest, R·max² entries), alternating, after a warm-up; medians of
the slowest rank. Ratios only: this machine is noisy. Writes outputs/bench_varlen.json.
The baseline pads inside attention only; a fully padded batch would also run the
linears and the all-reduces on R·max rows instead of T (column "padded rows").
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import parse_args, print_table, write_json
from launch.settings import generate_lengths
from launch.timing import medians
from layers.attention.varlen import Requests, score_entries
from layers.models.config import SERVING_VARIANTS, ModelConfig
from layers.models.dense import DenseStack, init_weights
from layers.models.tp_block import shard_stack
from tp.dist import init_from_env, shutdown


def mixes() -> dict[str, list[int]]:
    return {
        "seeds/04 A+B [10, 30]": [10, 30],
        "10 x 100": [100] * 10,
        "1 x 1000": [1000],
        "uniform 16, mean 64": generate_lengths("uniform", 16, 64, 1024, seed=0),
        "lognormal 16, mean 64": generate_lengths("lognormal", 16, 64, 1024, seed=0),
        "1 long + 15 short": [512] + [8] * 15,
    }


def main() -> int:
    layers = dict(type=int, default=2, help="blocks in the stack (article03 shapes otherwise)")
    # the serving variants: the ones with a padded baseline
    args = parse_args(__doc__, {"--variant": dict(default="v2", choices=SERVING_VARIANTS), "--repeats": 10,
                                "--layers": layers, "--out": "outputs/bench_varlen.json"})
    ctx = init_from_env("auto")
    cfg = ModelConfig(n_layers=args.layers)
    stack = shard_stack(init_weights(DenseStack(cfg, torch.float32, ctx.device), seed=0), args.variant, ctx.group)
    rows = []
    for name, lengths in mixes().items():
        cu = Requests.from_lengths(lengths).cu_seqlens
        x = torch.randn(cu[-1], cfg.d_model, generator=torch.Generator().manual_seed(1)).to(ctx.device)
        t = medians({"varlen": lambda: stack(x, cu), "padded": lambda: stack(x, cu, padded=True)}, args.repeats, ctx)
        work = {layout: score_entries(lengths, layout) for layout in ("varlen", "flat_masked", "padded")}
        rows.append({"mix": name, "requests": len(lengths), "tokens": cu[-1], "score_entries": work,
                     "padded_tokens": len(lengths) * max(lengths),
                     "time_varlen_s": t["varlen"], "time_padded_s": t["padded"]})
    shutdown()
    if ctx.is_main:
        print(f"varlen vs padded, {args.variant}, article03 shapes, L={args.layers}, p={ctx.world_size}, "
              f"{ctx.backend}; medians of {args.repeats} alternating repeats (slowest rank)")
        cells = []
        for r in rows:
            w = r["score_entries"]
            cells.append([r["mix"], r["requests"], r["tokens"], r["padded_tokens"], f"{w['varlen']:,}",
                          f"{w['padded']:,}", f"{w['varlen'] / w['padded']:.3f}",
                          f"{r['time_varlen_s'] / r['time_padded_s']:.3f}"])
        print_table(["mix", "R", "T", "padded rows", "varlen entries", "padded entries", "work v/p",
                     "time v/p"], cells)
        write_json(args.out, {"world_size": ctx.world_size, "variant": args.variant, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
