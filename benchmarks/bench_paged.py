"""Paged KV cache benchmarks: a shared prefix, memory, launch shape.

    torchrun --nproc_per_node=P benchmarks/bench_paged.py [--parts prefix,memory,shape,backends] [--repeats 3]

The article03 GPT-2 LM (d=512, h=8, L=8, vocab 50257), float32, greedy, v2, vocab-parallel, on P ranks:

  prefix   32 requests share a 512-token prefix (a system prompt), one arriving per iteration:
           enable_prefix_caching on against off (the same tokens: checked)
  memory   one KV budget of 1024 token positions per rank (64 blocks of 16; 2 layers, the scheduler's world
           does not depend on the model's depth): paged (block_size 16, blocks as the context grows) against the
           rule before paging, a full-capacity reservation at admission (block_size 1, reserve_capacity)
  shape    aten operations (a TorchDispatchMode count) in one decode-only iteration of 1, 8, 32, 64 requests,
           batched attention against the per-request reference; and bench_serve.py's overhead measure
  backends per attention backend (cpu, batched, reference): one decode-only iteration against the batch size and
           the contexts, and its share inside attention (torch.profiler): the table behind `attention: auto`

What each part measures is said beside its table in docs/benchmarks.md (benchmarks/report_paged.py writes the
section, with bench_serve.py's `hf` ratio against transformers; this script prints its own run's). Ratios only
(one run, a noisy machine). Writes outputs/bench_paged_p{P}.json.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import replace
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.bench_serve import bench_overhead
from benchmarks.common import attention_labelled, parse_args, random_prompts, refuse, write_json
from benchmarks.report_paged import section
from launch.settings import generate_lengths
from launch.timing import medians
from layers.models.config import ARTICLE03
from layers.models.dense import init_weights
from layers.models.lm import DenseLM, TPLM, shard_lm
from serve.offline import OfflineEngine
from serve.config import EngineConfig
from serve.model_runner import prepare_step
from serve.kv_cache import KVPool
from serve.plan import ScheduledRequest, SchedulerOutput
from serve.request import Request
from tp.dist import TPContext, init_from_env, shutdown

PREFIX, PREFIX_REQUESTS, PREFIX_NEW, PREFIX_CHUNK, PREFIX_BUDGET = 512, 32, 8, 256, 512
MEMORY_POSITIONS, MEMORY_BLOCK, MEMORY_REQUESTS, MEMORY_MEAN, MEMORY_NEW = 1024, 16, 32, 48, 64
SHAPE_BATCHES = (1, 8, 32, 64)
BACKEND_NAMES = ("cpu", "batched", "reference")
BACKEND_CONTEXTS = ("128", "512", "lognormal")


# ---- 1. a shared prefix --------------------------------------------------------------------------


def prefix_requests() -> list[Request]:
    gen = torch.Generator().manual_seed(7)
    shared = torch.randint(0, ARTICLE03.vocab_size, (PREFIX,), generator=gen).tolist()
    own = random_prompts([8 + i % 16 for i in range(PREFIX_REQUESTS)], seed=8)
    return [Request(i, shared + p, PREFIX_NEW, arrival=i) for i, p in enumerate(own)]


def bench_prefix(lm: TPLM, ctx: TPContext, repeats: int) -> dict:
    def run(requests: list[Request], cache: bool = True):
        config = EngineConfig(long_prefill_token_threshold=PREFIX_CHUNK, max_num_batched_tokens=PREFIX_BUDGET,
                              enable_prefix_caching=cache, max_num_seqs=PREFIX_BUDGET)
        return OfflineEngine(lm, ctx, config).run(requests)

    run(prefix_requests()[:2])  # warm-up
    out = {}
    for cache in (True, False):
        runs = [run(prefix_requests(), cache) for _ in range(repeats)]
        res = sorted(runs, key=lambda r: r.time_s)[len(runs) // 2]  # the median run
        out["on" if cache else "off"] = {
            "time_s": res.time_s, "mean_ttft_s": statistics.mean(r["ttft_s"] for r in res.requests),
            "rows_computed": res.rows_computed, "prefix_hit_tokens": res.prefix_hit_tokens,
            "iterations": len(res.iterations), "ids": [r["output_ids"] for r in res.requests]}
    on, off = out["on"], out["off"]
    return {"requests": PREFIX_REQUESTS, "prefix": PREFIX, "max_new_tokens": PREFIX_NEW, "chunk_size": PREFIX_CHUNK,
            "max_batched_tokens": PREFIX_BUDGET, "same_ids": on.pop("ids") == off.pop("ids"), "on": on, "off": off,
            "finish_speedup": off["time_s"] / on["time_s"], "ttft_speedup": off["mean_ttft_s"] / on["mean_ttft_s"]}


# ---- 2. memory -----------------------------------------------------------------------------------


def memory_requests() -> list[Request]:
    lengths = generate_lengths("lognormal", MEMORY_REQUESTS, MEMORY_MEAN, 256, seed=4)
    return [Request(i, p, MEMORY_NEW, 0) for i, p in enumerate(random_prompts(lengths, seed=9))]


def bench_memory(lm: TPLM, ctx: TPContext) -> dict:
    out = {}
    for name, block_size, reserve in (("paged", MEMORY_BLOCK, False), ("reserved", 1, True)):
        config = EngineConfig(long_prefill_token_threshold=256, max_num_batched_tokens=512, block_size=block_size,
                              num_gpu_blocks_override=MEMORY_POSITIONS // block_size, enable_prefix_caching=False,
                              reserve_capacity=reserve, max_num_seqs=512)
        res = OfflineEngine(lm, ctx, config).run(memory_requests())
        its = res.iterations
        peak = max(its, key=lambda it: it["blocks_used"])
        out[name] = {
            "block_size": block_size, "kv_blocks": res.num_blocks, "pool_bytes_per_rank": res.kv_pool_bytes_per_rank,
            "peak_reserved_positions": peak["blocks_used"] * block_size,
            "held_positions_at_peak": peak["positions_held"],
            "peak_reserved_bytes_per_rank": res.kv_peak_bytes_per_rank,
            "max_running": max(it["running"] for it in its),
            "mean_running": statistics.mean(it["running"] for it in its),
            "max_waste_blocks_per_request": max((it["blocks_used"] * block_size - it["positions_held"])
                                                / block_size / it["running"] for it in its if it["running"]),
            "max_waste_positions_per_request": max((it["blocks_used"] * block_size - it["positions_held"])
                                                   / it["running"] for it in its if it["running"]),
            "used_over_reserved_at_peak": peak["positions_held"] / (peak["blocks_used"] * block_size),
            "preemptions": res.preemptions, "iterations": len(its), "time_s": res.time_s,
            "ids": [r["output_ids"] for r in res.requests]}
    paged, reserved = out["paged"], out["reserved"]
    return {"positions": MEMORY_POSITIONS, "requests": MEMORY_REQUESTS, "max_new_tokens": MEMORY_NEW,
            "prompt_lengths": [len(r.prompt) for r in memory_requests()],
            "same_ids": paged.pop("ids") == reserved.pop("ids"), "paged": paged, "reserved": reserved,
            "running_ratio": paged["max_running"] / reserved["max_running"],
            "mean_running_ratio": paged["mean_running"] / reserved["mean_running"],
            "finish_speedup": reserved["time_s"] / paged["time_s"]}


# ---- 3. launch shape -----------------------------------------------------------------------------


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def decode_ops(lm, lengths: list[int], mode: str, device="cpu", positions_per_block: int = 16) -> int:
    """aten operations of one decode-only iteration (inputs built, forward, greedy head): request i decodes at
    position lengths[i], its blocks laid one request after another."""
    pool, plan, tokens = decode_plan(lm, lengths, positions_per_block, device)
    with torch.no_grad(), CountOps() as ops:
        step = prepare_step(plan, tokens, positions_per_block, device, mode)
        lm.step(step.ids, step.positions, pool.layers(step.batch), step.sample_rows)
    return ops.n


def decode_plan(lm, lengths: list[int], block_size: int, device) -> tuple[KVPool, SchedulerOutput, dict]:
    """A pool and a decode-only plan: request i decodes at position lengths[i], its blocks laid one request after
    another."""
    tables, start = [], 0
    for n in lengths:
        blocks = -(-(n + 1) // block_size)
        tables.append(tuple(range(start, start + blocks)))
        start += blocks
    cfg, dtype = lm.cfg, next(lm.parameters()).dtype
    pool = KVPool(cfg.n_layers, start, block_size, lm.cache_heads, cfg.d_head, dtype, device)
    plan = SchedulerOutput(0, tuple(ScheduledRequest(i, n, n + 1, decode=True, sample=True, blocks=t)
                                  for i, (n, t) in enumerate(zip(lengths, tables))))
    return pool, plan, {i: [1] * (n + 1) for i, n in enumerate(lengths)}


def context_lengths(kind: str, batch: int) -> list[int]:
    """Each decode's context: all equal (a number), or lognormal (median 100, a long tail, capped at 1000)."""
    if kind != "lognormal":
        return [int(kind)] * batch
    gen = torch.Generator().manual_seed(batch)
    return [int(x) for x in torch.empty(batch).log_normal_(4.6, 0.8, generator=gen).clamp(8, 1000)]


def bench_backends(lm: TPLM, ctx: TPContext, repeats: int) -> dict:
    """Per attention backend: one decode-only iteration (inputs built, forward, greedy head) against the batch size
    and the context lengths, the median of 2 + 3·repeats iterations (the backends in turn, ABBA), and the share of it
    inside attention (the layers' paged_attention calls: torch.profiler's record_function around each, over
    `repeats` iterations)."""
    rows = []
    with attention_labelled():
        for kind in BACKEND_CONTEXTS:
            for batch in SHAPE_BATCHES:
                lengths = context_lengths(kind, batch)
                pool, plan, tokens = decode_plan(lm, lengths, 16, ctx.device)

                def iteration(name):
                    with torch.no_grad():
                        step = prepare_step(plan, tokens, 16, ctx.device, name)
                        lm.step(step.ids, step.positions, pool.layers(step.batch), step.sample_rows)

                # the backends alternate (ABBA), so that the machine's drift falls on all of them alike
                times = medians({name: (lambda n=name: iteration(n)) for name in BACKEND_NAMES}, 2 + 3 * repeats, ctx)
                for name in BACKEND_NAMES:
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                        for _ in range(repeats):
                            with torch.profiler.record_function("iteration"):
                                iteration(name)
                    totals = {e.key: e.cpu_time_total for e in prof.key_averages()
                              if e.key in ("iteration", "paged_attention")}
                    rows.append({"context": kind, "batch": batch, "keys": sum(lengths) + batch,
                                 "longest": max(lengths) + 1, "attention": name, "iteration_s": times[name],
                                 "attention_share": totals.get("paged_attention", 0.0) / totals["iteration"]})
                del pool
    return {"rows": rows, "layers": lm.cfg.n_layers, "block_size": 16}


def bench_shape(lm: TPLM, ctx: TPContext, repeats: int) -> dict:
    lengths = lambda b: [40 + 7 * (i % 50) for i in range(b)]  # noqa: E731
    ops = [{"batch": b, "batched": decode_ops(lm, lengths(b), "batched", device=ctx.device),
            "reference": decode_ops(lm, lengths(b), "reference", device=ctx.device)} for b in SHAPE_BATCHES]
    overhead = [{k: v for k, v in r.items() if k != "records"}
                for r in bench_overhead(lm, ctx, repeats, batches=SHAPE_BATCHES, backend="batched")]
    return {"ops": ops, "overhead": overhead, "layers": lm.cfg.n_layers}


def main() -> int:
    args = parse_args(__doc__, {"--parts": dict(default="prefix,memory,shape,backends",
                                                help="comma-separated: prefix, memory, shape, backends"),
                                "--repeats": 3, "--out": dict(default=None)})
    parts = set(args.parts.split(","))
    if not parts <= {"prefix", "memory", "shape", "backends"} or args.repeats < 1:
        return refuse(f"--parts {args.parts!r} must name prefix, memory, shape, backends; --repeats >= 1")
    ctx = init_from_env()
    torch.set_num_threads(1)
    try:
        dense = init_weights(DenseLM(ARTICLE03), seed=0).to(ctx.device)
        lm = shard_lm(dense, "v2", ctx.group)
        out = {"world_size": ctx.world_size, "backend": ctx.backend, "model": "article03", "dtype": "float32"}
        if "prefix" in parts:
            out["prefix"] = bench_prefix(lm, ctx, args.repeats)
        if "memory" in parts:
            short = init_weights(DenseLM(replace(ARTICLE03, n_layers=2)), seed=0).to(ctx.device)
            out["memory"] = bench_memory(shard_lm(short, "v2", ctx.group), ctx)
        if "shape" in parts:
            out["shape"] = bench_shape(lm, ctx, args.repeats)
        if "backends" in parts:
            out["backends"] = bench_backends(lm, ctx, args.repeats)
        if ctx.rank == 0:
            print("\n".join(section(out, None)))
            write_json(args.out or f"outputs/bench_paged_p{ctx.world_size}.json", out)
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
