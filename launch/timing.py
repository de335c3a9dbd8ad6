"""Timing shared by the benchmarks and run_block: every forward behind a barrier, ABBA order, medians of the slowest
rank."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from tp.dist import TPContext, max_over_ranks, wait_for_stream


def timed(fn, ctx: TPContext) -> float:
    """Wall time of fn() on this rank, started together with the other ranks, device work included."""
    dist.barrier(group=ctx.group)
    wait_for_stream(ctx.device)
    start = time.perf_counter()
    fn()
    wait_for_stream(ctx.device)
    return time.perf_counter() - start


def sample(runs: dict, repeats: int, ctx: TPContext, after_round=None) -> dict[str, list[float]]:
    """`repeats` timings of each run after one warm-up round, alternating in ABBA order under no_grad.

    after_round(): called after every timed round (not the warm-up), e.g. to collect what a ledger saw."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    with torch.no_grad():
        for rep in range(repeats + 1):
            for name in (names if rep % 2 else names[::-1]):
                t = timed(runs[name], ctx)
                if rep:
                    times[name].append(t)
            if rep and after_round is not None:
                after_round()
    return times


def slowest(values: list[float], ctx: TPContext) -> list[float]:
    """Element-wise maximum over ranks."""
    return max_over_ranks(values, ctx.group)


def medians(runs: dict, repeats: int, ctx: TPContext) -> dict[str, float]:
    times = sample(runs, repeats, ctx)
    return dict(zip(runs, slowest([statistics.median(times[n]) for n in runs], ctx)))
