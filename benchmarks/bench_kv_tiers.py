"""KV tiers and cache-aware routing on a real workload (docs/kv_tiers.md): Mooncake's FAST'25 conversation trace
(benchmarks/data/, 12,031 requests over an hour, a hash id per 512-token block), replayed through the engine's own
scheduler, block manager, OffloadingConnector index and router, without a model.

    python benchmarks/bench_kv_tiers.py [--parts capacity,replicas] [--requests N]

  The replay   one token stands for one 512-token block of the trace (its hash id; block_size 1), so the prefix
               cache, the tiers and the router see the trace's own sharing. An iteration is --iteration-ms of the
               trace's clock and computes up to --budget blocks of prompt (chunked prefill); a request arrives at
               its timestamp and finishes at its first token (the outputs, 343 tokens on average, are under one
               block: not modelled), max_num_seqs 64. Hit ratio: the blocks each request found (in the device
               pool or a tier, at its admission) over its blocks; the token-weighted figure counts 512 tokens a
               block, capped at the request's input length.
  capacity     one replica: the device pool at 1,000 / 3,000 / 6,000 blocks (0.5M / 1.5M / 3M tokens), crossed with
               a CPU tier of 0 / 6,000 / 20,000 blocks and a disk tier of 0 / 100,000; and the ceiling (every block
               kept forever). Mooncake reports a 40 % cache ratio for this trace (its paper's Table 2).
  replicas     N = 1, 2, 4 replicas of 3,000 blocks each, no tiers: cache_aware routing (serve/router.py, SGLang's
               policy and defaults) against round_robin; the hit ratio and how evenly the requests spread.

  model        the trained model (models/stdlib: GPT-2, 4 layers, 256 positions; `make model`) through LLM, the
               trace scaled down: the first --model-requests requests, each block of the trace 16 tokens (its hash
               id seeds them; at most 15 blocks, so a prompt fits the context), 4 greedy tokens each, arrivals at the
               trace's times divided by --speedup; a device pool of 48 blocks of 16, max_num_seqs 8; without and with
               a CPU tier of 4,096 blocks (OffloadingConnector). Time to first token from each arrival, the hit
               ratio, the tiers' counters, and whether the tokens are the same.

  cost         the CPU tier when nothing hits (vLLM's roadmap asks for it on by default at no cost then): the trained
               model, 48 random prompts of 192 tokens (new ones each round), 16 greedy tokens each, max_num_seqs 4, a
               pool of 64 blocks of 16 (no preemption, but every finished request's named blocks are overwritten
               later: spilled); generate()'s time without and with a CPU tier of 4,096 blocks, in turn, medians of
               --repeats; the tokens compared.

Writes outputs/bench_kv_tiers.json and outputs/kv_tiers_capacity.png (copied to docs/), and prints the tables.
"""

from __future__ import annotations

import gzip
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import ROOT, parse_args, print_table, save_figure, write_json

TRACE = ROOT / "benchmarks" / "data" / "mooncake_conversation_trace.jsonl.gz"
BLOCK_TOKENS = 512  # the trace's block


def load_trace(path: Path = TRACE, limit: int | None = None) -> list[dict]:
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f]
    return rows if limit is None else rows[:limit]


def ceiling(trace: list[dict]) -> dict:
    """The hit ratio with every block kept forever: a block hits when an earlier request had it (its last block
    aside, as the replay computes it; the trace's last block is the partial one)."""
    seen, hit, blocks, tokens, hit_tokens = set(), 0, 0, 0, 0
    for r in trace:
        ids = r["hash_ids"]
        found = next((i for i, h in enumerate(ids[:-1]) if h not in seen), len(ids) - 1)  # a prefix: leading blocks
        hit += found
        blocks += len(ids)
        tokens += r["input_length"]
        hit_tokens += min(found * BLOCK_TOKENS, r["input_length"])
        seen.update(ids)
    return {"hit_ratio": hit / blocks, "token_hit_ratio": hit_tokens / tokens}


def replay(trace: list[dict], device_blocks: int, cpu_blocks: int = 0, disk_blocks: int = 0, replicas: int = 1,
           policy: str = "cache_aware", iteration_ms: float = 100.0, budget: int = 16, running: int = 16) -> dict:
    """The trace through `replicas` schedulers, each with its pool, tiers (an OffloadingConnector's index) and the
    router in front. Returns hit ratios, the tiers' counters and the requests per replica."""
    from serve.block_manager import KVCacheManager
    from serve.config import EngineConfig
    from serve.kv_connector.config import KVTransferConfig
    from serve.kv_connector.offloading import OffloadingConnector
    from serve.request import Request
    from serve.router import Router
    from serve.scheduler import Scheduler

    config = EngineConfig(block_size=1, max_num_seqs=running, max_num_batched_tokens=budget,
                          long_prefill_token_threshold=budget, num_gpu_blocks_override=device_blocks)
    scheds, connectors = [], []
    for _ in range(replicas):
        sched = Scheduler(config, KVCacheManager(device_blocks, 1, True))
        if cpu_blocks or disk_blocks:
            extra = {"cpu_bytes": cpu_blocks} | ({"disk_path": "(index only)", "disk_bytes": disk_blocks}
                                                 if disk_blocks else {})
            kv = KVTransferConfig("OffloadingConnector", "kv_both", extra)
            connector = OffloadingConnector(kv, block_size=1, block_bytes=1)  # capacities in blocks; no store
            sched.set_connector(connector)
            connectors.append(connector)
        scheds.append(sched)
    router = Router(replicas, policy, 1)
    requests = [Request(i, list(r["hash_ids"]), 1, int(r["timestamp"] // iteration_ms)) for i, r in enumerate(trace)]
    placed = [0] * replicas
    at, index = 0, 0
    while at < len(requests) or any(s.has_work() for s in scheds):
        while at < len(requests) and requests[at].arrival <= index:
            r = requests[at]
            loads = [len(s.running) + len(s.waiting) + len(s.pending) for s in scheds]
            i = router.route(r.prompt, loads)
            placed[i] += 1
            scheds[i].add(r)
            at += 1
        for s in scheds:
            plan = s.schedule(index)
            if plan is not None:
                s.update_from_output(plan, {c.request: 0 for c in plan.scheduled if c.sample})
        index += 1
        if at < len(requests) and not any(s.has_work() for s in scheds):
            index = max(index, requests[at].arrival)  # an idle stretch: nothing to plan until the next arrival
    hit = sum(r.num_cached_tokens or 0 for r in requests)
    blocks = sum(len(r.prompt) for r in requests)
    hit_tokens = sum(min((r.num_cached_tokens or 0) * BLOCK_TOKENS, t["input_length"]) for r, t in zip(requests, trace))
    counts = {k: sum(c.index.counts[k] for c in connectors) for k in ("offloaded", "demoted", "cpu_hits", "disk_hits")}
    return {"hit_ratio": hit / blocks, "token_hit_ratio": hit_tokens / sum(t["input_length"] for t in trace),
            "iterations": index, "preemptions": sum(s.preemptions for s in scheds), "requests_per_replica": placed,
            "router": dict(router.decisions), **counts}


def part_capacity(trace, out) -> None:
    best = ceiling(trace)
    out["ceiling"] = best
    rows = []
    for device in (1000, 3000, 6000):
        for cpu in (0, 6000, 20000):
            for disk in (0, 100_000):
                start = time.perf_counter()
                got = replay(trace, device, cpu, disk)
                row = {"device_blocks": device, "cpu_blocks": cpu, "disk_blocks": disk, **got,
                       "of_ceiling": got["hit_ratio"] / best["hit_ratio"], "replay_s": time.perf_counter() - start}
                out["capacity"].append(row)
                rows.append([device, cpu, disk, f"{got['hit_ratio']:.1%}", f"{got['token_hit_ratio']:.1%}",
                             f"{row['of_ceiling']:.0%}", got["cpu_hits"], got["disk_hits"]])
                print(rows[-1], flush=True)
    rows.append(["every block kept", "", "", f"{best['hit_ratio']:.1%}", f"{best['token_hit_ratio']:.1%}", "100%",
                 "", ""])
    print_table(["device blocks", "CPU tier", "disk tier", "hit ratio (blocks)", "hit ratio (tokens)",
                 "of the ceiling", "CPU hits", "disk hits"], rows)


def part_replicas(trace, out) -> None:
    rows = []
    for n in (1, 2, 4):
        for policy in ("round_robin", "cache_aware"):
            got = replay(trace, 3000, replicas=n, policy=policy)
            spread = max(got["requests_per_replica"]) / (len(trace) / n)
            out["replicas"].append({"replicas": n, "policy": policy, **got, "busiest_over_mean": spread})
            rows.append([n, policy, f"{got['hit_ratio']:.1%}", f"{got['token_hit_ratio']:.1%}",
                         " / ".join(map(str, got["requests_per_replica"])), f"{spread:.2f}"])
            print(rows[-1], flush=True)
    print_table(["replicas", "routing", "hit ratio (blocks)", "hit ratio (tokens)", "requests per replica",
                 "busiest / mean"], rows)


def scaled_requests(trace: list[dict], n: int, vocab: int, block: int = 16, most_blocks: int = 15):
    """The first n requests with each trace block as `block` tokens, seeded by its hash id (equal ids, equal tokens):
    (arrival s, prompt)."""
    import torch

    out = []
    for r in trace[:n]:
        ids = []
        for h in r["hash_ids"][:most_blocks]:
            ids += torch.randint(0, vocab, (block,), generator=torch.Generator().manual_seed(int(h))).tolist()
        out.append((r["timestamp"] / 1000, ids))
    return out


def serve_timed(llm, requests, speedup: float, params) -> dict:
    """Each request added at its arrival (trace time / speedup, wall clock), the engine stepped while any is
    unfinished: time to first token per request, and the tokens."""
    start = time.perf_counter()
    arrived, first, tokens = {}, {}, {}
    at = 0
    while at < len(requests) or llm.has_unfinished_requests():
        now = time.perf_counter() - start
        while at < len(requests) and requests[at][0] / speedup <= now:
            llm.add_request(f"q{at}", requests[at][1], params)
            arrived[f"q{at}"] = time.perf_counter()
            at += 1
        if not llm.has_unfinished_requests():
            time.sleep(max(0.0, requests[at][0] / speedup - (time.perf_counter() - start)))
            continue
        for o in llm.step():
            if o.outputs[0].token_ids and o.request_id not in first:
                first[o.request_id] = time.perf_counter() - arrived[o.request_id]
            if o.finished:
                tokens[o.request_id] = list(o.outputs[0].token_ids)
    return {"ttft": [first[f"q{i}"] for i in range(len(requests))], "tokens": [tokens[f"q{i}"] for i in
                                                                               range(len(requests))],
            "stats": llm.stats(), "wall_s": time.perf_counter() - start}


def part_model(args, trace, out) -> None:
    import statistics

    import torch

    from serve import LLM
    from serve.kv_cache import cache_layout_of, layout_block_bytes
    from serve.sampling_params import SamplingParams

    model = str(ROOT / args.model)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    settings = dict(num_gpu_blocks_override=48, block_size=16, max_num_seqs=8, max_num_batched_tokens=256,
                    long_prefill_token_threshold=256)
    rows, runs, extra = [], {}, {}
    for name in ("device pool only", "+ CPU tier"):
        with LLM(model, **settings, **extra) as llm:
            requests = scaled_requests(trace, args.model_requests, llm.model_config.vocab_size)
            got = serve_timed(llm, requests, args.speedup, params)
            cfg, dtype = llm.model_config, getattr(torch, llm.dtype)
        bb = layout_block_bytes(cfg.n_layers, cache_layout_of(cfg, 1), 16, dtype)  # one block's bytes
        extra = {"kv_transfer_config": {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                        "kv_connector_extra_config": {"cpu_bytes": 4096 * bb}}}
        runs[name] = got
        s, ttft = got["stats"], got["ttft"]
        row = {"setting": name, "ttft_mean_ms": 1e3 * statistics.mean(ttft),
               "ttft_p50_ms": 1e3 * statistics.median(ttft),
               "ttft_p90_ms": 1e3 * statistics.quantiles(ttft, n=10)[-1],
               "hit_ratio": s["prefix_hit_tokens"] / s["prefix_queried_tokens"],
               "tier_hit_blocks": s.get("kv_tier_hit_blocks"), "offloaded_blocks": s.get("kv_offloaded_blocks", 0),
               "wall_s": got["wall_s"]}
        out["model"].append(row)
        rows.append([name, f"{row['ttft_mean_ms']:.1f}", f"{row['ttft_p50_ms']:.1f}", f"{row['ttft_p90_ms']:.1f}",
                     f"{row['hit_ratio']:.1%}", row["offloaded_blocks"],
                     "" if row["tier_hit_blocks"] is None else row["tier_hit_blocks"]["cpu"]])
    a, b = runs["device pool only"], runs["+ CPU tier"]
    same = sum(x == y for x, y in zip(a["tokens"], b["tokens"]))
    out["model_same_tokens"] = [same, len(a["tokens"])]
    out["model_ttft_ratio"] = statistics.mean(b["ttft"]) / statistics.mean(a["ttft"])
    print_table(["models/stdlib, scaled trace", "TTFT mean (ms)", "p50", "p90", "prompt tokens hit",
                 "blocks offloaded", "CPU-tier hits"], rows)
    print(f"same tokens: {same} of {len(a['tokens'])}; mean TTFT with the CPU tier / without: "
          f"{out['model_ttft_ratio']:.2f}")


def part_cost(args, out) -> None:
    import statistics

    import torch

    from benchmarks.common import in_turn, random_prompts, timed_generate
    from serve import LLM
    from serve.kv_cache import cache_layout_of, layout_block_bytes
    from serve.sampling_params import SamplingParams

    model = str(ROOT / args.model)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    settings = dict(num_gpu_blocks_override=64, block_size=16, max_num_seqs=4)
    plain = LLM(model, **settings)
    cfg, dtype = plain.model_config, getattr(torch, plain.dtype)
    bb = layout_block_bytes(cfg.n_layers, cache_layout_of(cfg, 1), 16, dtype)
    tiered = LLM(model, **settings, kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                                         "kv_connector_extra_config": {"cpu_bytes": 4096 * bb}})
    rounds = {"device pool only": 0, "+ CPU tier": 0}

    def run(name, llm):
        def go():
            rounds[name] += 1  # each round its own prompts, the same for both settings: nothing can hit
            return timed_generate(llm, random_prompts([192] * 48, seed=rounds[name], vocab=cfg.vocab_size), params)
        return go

    try:
        got = in_turn({"device pool only": run("device pool only", plain), "+ CPU tier": run("+ CPU tier", tiered)},
                      args.repeats)
        stats = tiered.stats()
    finally:
        plain.shutdown()
        tiered.shutdown()
    times = {name: statistics.median(t for _, t in runs) for name, runs in got.items()}
    same = all(a[0] == b[0] for a, b in zip(got["device pool only"], got["+ CPU tier"]))
    out["cost"] = {"generate_s": times, "ratio": times["+ CPU tier"] / times["device pool only"], "same_tokens": same,
                   "offloaded_blocks": stats["kv_offloaded_blocks"], "tier_hit_blocks": stats["kv_tier_hit_blocks"],
                   "rounds": args.repeats}
    print(f"the CPU tier with nothing to hit: generate() {out['cost']['ratio']:.3f}x the pool alone's time "
          f"({stats['kv_offloaded_blocks']} blocks spilled, hits {stats['kv_tier_hit_blocks']}); same tokens: {same}")


def plot_capacity(out) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for cpu, disk, style in ((0, 0, "o-"), (6000, 0, "s-"), (20000, 0, "^-"), (20000, 100_000, "d-")):
        rows = [r for r in out["capacity"] if r["cpu_blocks"] == cpu and r["disk_blocks"] == disk]
        label = "device pool only" if not cpu else f"+ CPU {cpu * BLOCK_TOKENS / 1e6:.0f}M tokens" + (
            f" + disk {disk * BLOCK_TOKENS / 1e6:.0f}M" if disk else "")
        ax.plot([r["device_blocks"] * BLOCK_TOKENS / 1e6 for r in rows], [100 * r["hit_ratio"] for r in rows], style,
                label=label)
    ax.axhline(100 * out["ceiling"]["hit_ratio"], color="gray", ls="--", label="every block kept")
    ax.set_xlabel("device pool (million tokens)")
    ax.set_ylabel("prefix hit ratio (% of blocks)")
    ax.set_title("Mooncake conversation trace, replayed without a model")
    ax.legend(fontsize=8)
    save_figure(fig, "kv_tiers_capacity.png")


def tables(data: dict) -> dict[str, list[str]]:
    """The measured tables as markdown lines: capacity, replicas, model (those the run has)."""
    from benchmarks.common import table

    out = {}
    if data.get("capacity"):
        best = data["ceiling"]
        def tokens(blocks):
            return f"{blocks * BLOCK_TOKENS / 1e6:g}M" if blocks else "none"

        rows = [[tokens(r["device_blocks"]), tokens(r["cpu_blocks"]), tokens(r["disk_blocks"]), f"{r['hit_ratio']:.1%}",
                 f"{r['token_hit_ratio']:.1%}",
                 f"{r['of_ceiling']:.0%}", f"{r['cpu_hits']:,}", f"{r['disk_hits']:,}"] for r in data["capacity"]]
        rows.append(["every block kept", "", "", f"{best['hit_ratio']:.1%}", f"{best['token_hit_ratio']:.1%}", "100%",
                     "", ""])
        out["capacity"] = table(["device pool (tokens)", "CPU tier", "disk tier", "hit ratio (blocks)",
                                 "hit ratio (tokens)", "of the ceiling", "CPU-tier hits", "disk-tier hits"], rows)
    if data.get("replicas"):
        rows = [[r["replicas"], r["policy"], f"{r['hit_ratio']:.1%}", f"{r['token_hit_ratio']:.1%}",
                 " / ".join(f"{n:,}" for n in r["requests_per_replica"]), f"{r['busiest_over_mean']:.2f}"]
                for r in data["replicas"]]
        out["replicas"] = table(["replicas (1.5M tokens each)", "routing", "hit ratio (blocks)", "hit ratio (tokens)",
                                 "requests per replica", "busiest / mean"], rows)
    if data.get("model"):
        rows = [[r["setting"], f"{r['ttft_mean_ms']:.1f}", f"{r['ttft_p50_ms']:.1f}", f"{r['ttft_p90_ms']:.1f}",
                 f"{r['hit_ratio']:.1%}", f"{r['offloaded_blocks']:,}",
                 "" if r["tier_hit_blocks"] is None else f"{r['tier_hit_blocks']['cpu']:,}"] for r in data["model"]]
        out["model"] = table(["models/stdlib, the trace scaled down", "TTFT mean (ms)", "p50", "p90",
                              "prompt tokens hit", "blocks offloaded", "CPU-tier hits"], rows)
    return out


def section(data: dict | None) -> list[str]:
    """Its section of docs/benchmarks.md."""
    if not data:
        return []
    found = tables(data)
    lines = ["## KV tiers and routing: Mooncake's conversation trace", "",
             "`.venv/bin/python benchmarks/bench_kv_tiers.py`: the trace replayed through the scheduler, block "
             "manager, OffloadingConnector index and router without a model (one token per 512-token block); then "
             "scaled down through the trained model. The write-up: [kv_tiers.md](kv_tiers.md).", ""]
    for name in ("capacity", "replicas", "model"):
        if name in found:
            lines += found[name] + [""]
    if "cost" in data:
        c = data["cost"]
        lines += [f"The CPU tier with nothing to hit (48 random prompts of 192 tokens, 16 tokens each, a pool of 64 "
                  f"blocks: every finished request's blocks spilled later): generate() took {c['ratio']:.3f}x the "
                  f"pool alone's time (medians of {c['rounds']}, in turn; {c['offloaded_blocks']:,} blocks spilled; "
                  f"the same tokens: {'yes' if c['same_tokens'] else 'no'}).", ""]
    if "model_ttft_ratio" in data:
        same, n = data["model_same_tokens"]
        lines += [f"Mean time to first token with the CPU tier / without: {data['model_ttft_ratio']:.2f}; the same "
                  f"tokens: {same} of {n}.", ""]
    return lines


def main(argv=None) -> None:
    args = parse_args(__doc__, {"--parts": "capacity,replicas,model,cost", "--requests": {"type": int, "default": None},
                                "--iteration-ms": 100.0, "--budget": 16, "--model": "models/stdlib",
                                "--model-requests": 800, "--speedup": 8.0, "--repeats": 5}, argv)
    trace = load_trace(limit=args.requests)
    out = {"trace": str(TRACE.relative_to(ROOT)), "requests": len(trace), "capacity": [], "replicas": [],
           "model": []}
    parts = args.parts.split(",")
    if "capacity" in parts:
        part_capacity(trace, out)
        plot_capacity(out)
    if "replicas" in parts:
        part_replicas(trace, out)
    if "model" in parts:
        part_model(args, trace, out)
    if "cost" in parts:
        part_cost(args, out)
    write_json(ROOT / "outputs" / "bench_kv_tiers.json", out)


if __name__ == "__main__":
    main()
