"""Overhead of the traffic ledger: forward time with the ledger on vs off, as a ratio measured in one run.

    torchrun --nproc_per_node=8 benchmarks/bench_ledger.py [--tokens 40 512] [--repeats 20]

On and off forwards alternate in ABBA order (after warm-up), every forward starts behind a barrier,
and each rank reports medians; the slowest rank's median is used. Target: ratio <= 1.05.
Writes outputs/bench_ledger.json on rank 0.
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
import torch.distributed as dist

from layers.config import ModelConfig
from layers.dense import DenseStack, init_weights
from layers.tp_block import shard_stack
from tp.dist import init_from_env, shutdown
from tp.ledger import TrafficLedger


def timed(fn, ctx) -> float:
    dist.barrier(group=ctx.group)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    start = time.perf_counter()
    fn()
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[40, 512], help="n_tokens values")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--variants", nargs="+", default=["v1", "v2"])
    ap.add_argument("--out", default="outputs/bench_ledger.json")
    args = ap.parse_args()
    ctx = init_from_env("auto")
    cfg = ModelConfig()
    dense = init_weights(DenseStack(cfg, torch.float32, ctx.device), seed=0)
    rows = []
    for variant in args.variants:
        stack = shard_stack(dense, variant, ctx.group)
        for n in args.tokens:
            x = torch.randn(n, cfg.d_model, generator=torch.Generator().manual_seed(0)).to(ctx.device)
            ledger = TrafficLedger(ctx.world_size, ctx.device)

            def on():
                ledger.clear()
                with ledger.attach(stack):
                    stack(x)

            off, with_ledger = [], []
            with torch.no_grad():
                for rep in range(args.repeats + 3):
                    if rep % 2:  # ABBA order, so that neither side always runs second
                        t_on, t_off = timed(on, ctx), timed(lambda: stack(x), ctx)
                    else:
                        t_off, t_on = timed(lambda: stack(x), ctx), timed(on, ctx)
                    if rep >= 3:
                        off.append(t_off)
                        with_ledger.append(t_on)
            med = torch.tensor([statistics.median(off), statistics.median(with_ledger)], dtype=torch.float64,
                               device=ctx.device)
            dist.all_reduce(med, op=dist.ReduceOp.MAX, group=ctx.group)
            rows.append({"variant": variant, "n": n, "off_s": med[0].item(), "on_s": med[1].item(),
                         "ratio": med[1].item() / med[0].item()})
    shutdown()
    if ctx.is_main:
        print(f"traffic ledger overhead, article03, p={ctx.world_size}, {ctx.backend}, "
              f"{args.repeats} alternating repeats, medians (slowest rank)")
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
