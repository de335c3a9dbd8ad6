"""Context parallelism on this machine: one long prompt's prefill by ring attention, and a decode over a split cache.

    .venv/bin/torchrun --nproc_per_node=4 benchmarks/bench_cp.py [--prompts 4096 8192] [--context 16384]

One launch of 4 ranks; for cp = 1, 2, 4 the first cp ranks form the group (tp = 1) and the others wait. A Llama stack
of llama_tiny's attention (CFG: 8 query heads, 2 K,V heads of 32, d = 256) and 2 layers, float32; times on the
group's first rank, medians of repeats.

    prefill   one prompt of 4k and 8k tokens: cp = 1 the plain block (SDPA, causal), cp > 1 ring attention over
              zigzag chunks (RingPrefill); the pass-KV bytes each rank sent per layer (the ledger) beside the formula
    decode    one new token against a 16k-position cache: cp = 1 over all of it, cp > 1 each rank over its 1/cp
              (SplitKVDecode) and one all-gather merges

At cp = 4 four ranks share this machine's 2 cores, so the ratios bound what the split buys from below, and the
attention is the readable partial_attention, not a fused kernel (docs/cp.md, "Measured").
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from benchmarks.common import median_time, parse_args, print_table, write_json
from layers.attention.context_parallel import RingPrefill, SplitKVDecode, zigzag_positions
from layers.models.dense import DenseStack, init_weights
from layers.models.llama import LlamaConfig
from layers.models.tp_block import tp_stack
from layers.parallel.shard import DenseSource, load_plan
from tp.dist import init_from_env, shutdown
from tp.ledger import TrafficLedger
from tp.traffic_model import pass_kv_bytes_per_rank_per_layer

CFG = LlamaConfig(d_model=256, n_heads=8, n_kv_heads=2, d_head=32, d_ffn=688, n_layers=2, max_seq_len=32768,
                  vocab_size=1000)


def main(argv=None) -> int:
    args = parse_args(__doc__, {"--prompts": [4096, 8192], "--context": 16384, "--repeats": 3,
                                "--out": "outputs/bench_cp.json"}, argv)
    ctx = init_from_env()
    rank, world = ctx.rank, ctx.world_size
    dense = init_weights(DenseStack(CFG, torch.float32), 0)
    sizes = [cp for cp in (1, 2, 4) if cp <= world]
    groups = {cp: dist.new_group(list(range(cp))) for cp in sizes}  # every rank, the same order
    # tp = 1: each rank's TP group is itself (every rank creates every such group, in the same order)
    alone = {r: dist.new_group([r]) for r in range(world)}[rank]
    rows = {"prefill": [], "decode": []}
    with torch.no_grad():
        for cp in sizes:
            group = groups[cp]
            inside = rank < cp
            barrier = partial(dist.barrier, group=group)
            stack = None
            if inside:
                stack = tp_stack(CFG, "v2", alone, torch.float32, None)
                load_plan(stack, stack.plan(), DenseSource(dense))
            for n in args.prompts:
                if inside:
                    x = torch.randn(n, CFG.d_model, generator=torch.Generator().manual_seed(1))
                    positions = [zigzag_positions(n, cp, r) for r in range(cp)]

                    def prefill():
                        if cp == 1:
                            return stack(x, None)
                        ring = RingPrefill(group, positions)
                        h = x[positions[rank]]
                        for block in stack.blocks:
                            h = block(h, ring)
                        return h

                    t = median_time(prefill, args.repeats, barrier)
                    ledger = TrafficLedger(cp)
                    with ledger.attach(stack):
                        prefill()
                    sent = sum(m.bytes for m in ledger.transfers if m.kind == "send") / CFG.n_layers
                    rows["prefill"].append({"cp": cp, "tokens": n, "rank": rank, "time_s": t,
                                            "pass_kv_sent_per_layer": sent,
                                            "formula": pass_kv_bytes_per_rank_per_layer(CFG, cp, 1, n, 4)})
                dist.barrier()
            if inside:
                n = args.context
                held = list(range(rank, n, cp))
                gen = torch.Generator().manual_seed(2)
                caches = [torch.randn(2, CFG.n_kv_heads, len(held), CFG.d_head, generator=gen)
                          for _ in range(CFG.n_layers)]
                x = torch.randn(1, CFG.d_model, generator=gen)

                def decode():
                    split = SplitKVDecode(group, list(caches), list(held), [n])
                    h = x
                    for block in stack.blocks:
                        h = block(h, split)
                    return h

                rows["decode"].append({"cp": cp, "context": n, "rank": rank,
                                       "time_s": median_time(decode, max(args.repeats, 5), barrier),
                                       "cached_per_rank": len(held)})
            dist.barrier()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        prefill = [r for g in gathered for r in g["prefill"] if r["rank"] == 0]
        decode = [r for g in gathered for r in g["decode"] if r["rank"] == 0]
        base = {r["tokens"]: r["time_s"] for r in prefill if r["cp"] == 1}
        one = next(r["time_s"] for r in decode if r["cp"] == 1)
        print(f"one prompt's prefill, then one token's decode; {CFG.n_layers} layers of d={CFG.d_model}, "
              f"h={CFG.n_heads}, h_kv={CFG.n_kv_heads}, float32 ({world} ranks on this machine's cores)")
        print_table(["prefill tokens", "cp", "time / cp=1", "pass-KV KiB sent per rank per layer",
                     "formula KiB"],
                    [[r["tokens"], r["cp"], f"{r['time_s'] / base[r['tokens']]:.2f}",
                      f"{r['pass_kv_sent_per_layer'] / 1024:.0f}", f"{r['formula'] / 1024:.0f}"]
                     for r in prefill])
        print_table(["decode at positions", "cp", "cached per rank", "time / cp=1"],
                    [[r["context"], r["cp"], r["cached_per_rank"], f"{r['time_s'] / one:.2f}"]
                     for r in decode])
        write_json(args.out, {"prefill": prefill, "decode": decode, "model": CFG.asdict()})
    shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
