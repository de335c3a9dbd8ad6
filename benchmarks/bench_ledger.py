"""Overhead of the traffic ledger: forward time with the ledger on vs off, as a ratio measured in one run.

    torchrun --nproc_per_node=8 benchmarks/bench_ledger.py [--tokens 40 512] [--repeats 40]

On and off forwards alternate in ABBA order (after warm-up), every forward starts behind a barrier;
the ratio is the median of the on/off pair ratios, the slowest rank's. Target: ratio <= 1.05.
Writes outputs/bench_ledger.json on rank 0.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import parse_args, print_table, write_json
from launch.timing import sample, slowest
from layers.models.config import ARTICLE03
from layers.models.dense import DenseStack, init_weights
from layers.models.tp_block import shard_stack
from tp.dist import init_from_env, shutdown
from tp.ledger import TrafficLedger


def main() -> int:
    args = parse_args(__doc__, {"--tokens": dict(type=int, nargs="+", default=[40, 512], help="n_tokens values"),
                                "--repeats": 40, "--variants": ["v1", "v2"], "--out": "outputs/bench_ledger.json"})
    ctx = init_from_env("auto")
    dense = init_weights(DenseStack(ARTICLE03, torch.float32, ctx.device), seed=0)
    rows = []
    for variant in args.variants:
        stack = shard_stack(dense, variant, ctx.group)
        for n in args.tokens:
            x = torch.randn(n, ARTICLE03.d_model, generator=torch.Generator().manual_seed(0)).to(ctx.device)
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
        print_table(["variant", "n", "off ms", "on ms", "on/off"],
                    [[r["variant"], r["n"], f"{r['off_s'] * 1e3:.2f}", f"{r['on_s'] * 1e3:.2f}",
                      f"{r['ratio']:.3f}"] for r in rows])
        write_json(args.out, {"world_size": ctx.world_size, "backend": ctx.backend, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
