"""Overhead of the traffic ledger: forward time with the ledger on vs off, as a ratio measured in one run.

    torchrun --nproc_per_node=8 benchmarks/bench_ledger.py [--tokens 40 512] [--repeats 40]

On and off forwards alternate in ABBA order (after warm-up), every forward starts behind a barrier;
the ratio is the median of the on/off pair ratios, the slowest rank's. Target: ratio <= 1.05.
Writes outputs/bench_ledger.json on rank 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from launch.timing import sample, slowest
from layers.models.config import ARTICLE03
from layers.models.dense import DenseStack, init_weights
from layers.models.tp_block import shard_stack
from tp.dist import init_from_env, shutdown
from tp.ledger import TrafficLedger


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[40, 512], help="n_tokens values")
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--variants", nargs="+", default=["v1", "v2"])
    ap.add_argument("--out", default="outputs/bench_ledger.json")
    args = ap.parse_args()
    ctx = init_from_env("auto")
    cfg = ARTICLE03
    dense = init_weights(DenseStack(cfg, torch.float32, ctx.device), seed=0)
    rows = []
    for variant in args.variants:
        stack = shard_stack(dense, variant, ctx.group)
        for n in args.tokens:
            x = torch.randn(n, cfg.d_model, generator=torch.Generator().manual_seed(0)).to(ctx.device)
            ledger = TrafficLedger(ctx.world_size, ctx.device, timing=True)

            def on():
                ledger.clear()
                with ledger.attach(stack):
                    stack(x)

            times = sample({"off": lambda: stack(x), "on": on}, args.repeats, ctx)
            # Each on/off pair ran back to back: the median of the pair ratios resists drift better
            # than a ratio of medians.
            pair = statistics.median(a / b for a, b in zip(times["on"], times["off"]))
            off_s, on_s, ratio = slowest([statistics.median(times["off"]), statistics.median(times["on"]), pair], ctx)
            rows.append({"variant": variant, "n": n, "off_s": off_s, "on_s": on_s, "ratio": ratio})
    shutdown()
    if ctx.is_main:
        print(f"traffic ledger overhead, article03, p={ctx.world_size}, {ctx.backend}, "
              f"{args.repeats} alternating repeats; on/off = median of pair ratios (slowest rank)")
        print(f"{'variant':>8} {'n':>6} {'off ms':>9} {'on ms':>9} {'on/off':>7}")
        for r in rows:
            print(f"{r['variant']:>8} {r['n']:>6} {r['off_s'] * 1e3:>9.2f} {r['on_s'] * 1e3:>9.2f} {r['ratio']:>7.3f}")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"world_size": ctx.world_size, "backend": ctx.backend, "rows": rows},
                                             indent=2) + "\n")
        print(f"data: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
