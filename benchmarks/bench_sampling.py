"""Sampling under the vocab-parallel head: bytes per sampled row against all-gathering the logits, and its cost.

    python benchmarks/bench_sampling.py [--parts bytes,cost] [--repeats 2]

  bytes  p = 2, 4, 8 ranks (started here, gloo), vocab 50257 and 128256 (GPT-2's, Llama 3's), 8 rows of float32
         logits per rank's slice (flat: normal with std 3, the worst case for top-p; peaked: -1.5·log(rank), Zipf-like, over the
         ids in random order, a language model's shape): each filter's sample() under the traffic ledger, the bytes each rank sent per
         sampled row, beside tp/traffic_model.predict_sampler (they must be equal) and beside an all-gather of the
         float32 logits (vLLM's way: every rank gets the [S, V'] logits), measured the same way
  cost   the article03 GPT-2 LM (float32, random weights) through LLM at tensor_parallel_size 2, B requests at once
         (B = 1, 8, 32; random 32-token prompts, 32 new tokens each, ignore_eos): generate()'s time with temperature
         0.8 alone, with top_k 50, with top_p 0.95, against greedy, alternating A B B A within each repeat; the
         ratio is sampled / greedy time. Random weights give nearly flat logits: top_p 0.95 then keeps most of the
         vocabulary, its worst case (the logits gathered and sorted every step)

Writes outputs/bench_sampling.json and prints both tables (markdown).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VOCABS = (50257, 128256)
SIZES = (2, 4, 8)
ROWS = 8
FILTERS = {"greedy": dict(temperature=0.0), "temperature": dict(temperature=0.8), "top_k=50": dict(top_k=50),
           "top_p=0.9 (peaked)": dict(top_p=0.9, peaked=True), "top_p=0.95 (flat)": dict(top_p=0.95),
           "min_p=0.05": dict(min_p=0.05),
           "top_k+top_p+min_p": dict(top_k=50, top_p=0.95, min_p=0.05), "logprobs=5": dict(logprobs=5)}


def measure_bytes(ctx, vocab: int) -> dict:
    import torch

    from layers.parallel.vocab import padded_vocab
    from layers.sampling.sampler import SamplingBatch, sample
    from tp.comm import gather_from_region
    from tp.ledger import TrafficLedger
    from tp.traffic_model import predict_sampler

    p, n = ctx.world_size, padded_vocab(vocab, ctx.world_size) // ctx.world_size
    start = ctx.rank * n
    gen = torch.Generator().manual_seed(ctx.rank)
    flat = torch.randn(ROWS, n, generator=gen) * 3  # float32 logits, as a float32 head gives them
    flat[:, max(0, min(n, vocab - start)):] = float("-inf")
    # peaked: a language model's shape, a few ids far ahead (Zipf-like: logit -1.5 log rank), the ids shuffled
    ranks = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[start:start + n].float() + 1
    peaked = torch.full((ROWS, n), float("-inf"))
    peaked[:, :ranks.numel()] = -1.5 * torch.log(ranks)
    out = {}
    for name, f in FILTERS.items():
        local = peaked if f.get("peaked") else flat
        t = f.get("temperature", 1.0)
        rows = [(t, f.get("top_k", 0), f.get("top_p", 1.0), f.get("min_p", 0.0), i, 0) for i in range(ROWS)]
        batch = SamplingBatch.build(rows, f.get("logprobs", -1), "cpu")
        ledger = TrafficLedger(p)
        with ledger.recording():
            res = sample(local, start, ctx.group, None if batch.greedy_only else batch, vocab)
        seen = [r.traffic() for r in ledger.records]
        model = predict_sampler(p, ROWS, None if batch.greedy_only else (res.rounds, batch.normalisers, res.race), vocab,
                                local.dtype)
        out[name] = {"bytes_per_row": sum(r.bytes_per_rank for r in seen) / ROWS,
                     "model_bytes_per_row": sum(r.bytes_per_rank for r in model) / ROWS,
                     "collectives": len(seen), "ledger_matches_model": seen == model, "rounds": list(res.rounds)}
    ledger = TrafficLedger(p)
    with ledger.recording():
        gather_from_region(flat, ctx.group, "head/logits all-gather")  # [S, V'] on every rank
    out["all-gather logits (float32)"] = {"bytes_per_row": sum(r.bytes_per_rank for r in ledger.records) / ROWS}
    return out


def bytes_table() -> dict:
    from launch.spawn import spawn_ranks

    return {f"{vocab}": {f"{p}": spawn_ranks(p, measure_bytes, vocab, backend="gloo") for p in SIZES}
            for vocab in VOCABS}


COST = {"temperature 0.8": dict(temperature=0.8), "temperature 0.8 + top_k 50": dict(temperature=0.8, top_k=50),
        "temperature 0.8 + top_p 0.95": dict(temperature=0.8, top_p=0.95)}


def cost_table(repeats: int) -> dict:
    import torch

    from serve import LLM, SamplingParams

    out = {}
    with LLM("article03", tensor_parallel_size=2, max_num_seqs=32, max_num_batched_tokens=1024, long_prefill_token_threshold=1024) as llm:
        for B in (1, 8, 32):
            gen = torch.Generator().manual_seed(B)
            prompts = [torch.randint(0, 50257, (32,), generator=gen).tolist() for _ in range(B)]
            greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)

            def timed(q):
                t0 = time.perf_counter()
                llm.generate(prompts, q)
                return time.perf_counter() - t0

            timed(greedy)  # warm-up
            for name, kw in COST.items():
                sampled = SamplingParams(max_tokens=32, ignore_eos=True, **kw)
                ratios = []
                for _ in range(repeats):
                    a1, b1, b2, a2 = timed(greedy), timed(sampled), timed(sampled), timed(greedy)
                    ratios.append((b1 + b2) / (a1 + a2))
                out.setdefault(name, {})[f"{B}"] = {"sampled_over_greedy_time": statistics.median(ratios),
                                                    "runs": ratios}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="bytes,cost")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "outputs/bench_sampling.json"))
    args = ap.parse_args()
    parts = args.parts.split(",")
    result = {}
    if "bytes" in parts:
        result["bytes"] = b = bytes_table()
        names = list(FILTERS) + ["all-gather logits (float32)"]
        print("| vocab | p | " + " | ".join(names) + " |")
        print("|---|---|" + "---|" * len(names))
        for vocab, per_p in b.items():
            for p, ranks in per_p.items():
                r0 = ranks
                cells = [f"{r0[n]['bytes_per_row']:,.0f}" + ("" if r0[n].get("ledger_matches_model", True) else " (≠ model)")
                         for n in names]
                print(f"| {vocab} | {p} | " + " | ".join(cells) + " |")
    if "cost" in parts:
        result["cost"] = c = cost_table(args.repeats)
        print("\n| sampling | B = 1 | B = 8 | B = 32 |\n|---|---|---|---|")
        for name, per_b in c.items():
            print(f"| {name} | " + " | ".join(f"{per_b[B]['sampled_over_greedy_time']:.2f}×" for B in ("1", "8", "32"))
                  + " |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
