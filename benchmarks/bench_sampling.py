"""Sampling under the vocab-parallel head: bytes per sampled row against all-gathering the logits, and its cost.

    python benchmarks/bench_sampling.py [--parts bytes,cost] [--repeats 2]

  bytes  p = 2, 4, 8 ranks (started here, gloo), vocab 50257 and 128256, 8 rows of float32 logits per rank's slice
         (flat: normal with std 3, the worst case for top-p; peaked: Zipf-like over the ids in random order, a
         language model's shape): each filter's sample() under the traffic ledger, the bytes each rank sent per
         sampled row, beside predict_sampler (they must be equal) and beside an all-gather of the float32 logits
         (vLLM's way), measured the same way
  cost   the article03 GPT-2 LM through LLM at tensor_parallel_size 2, B = 1, 8, 32 requests at once: generate()'s
         time sampled (COST) against greedy, alternating A B B A within each repeat. Random weights give nearly flat
         logits: top_p 0.95 then keeps most of the vocabulary, its worst case

Writes outputs/bench_sampling.json and prints both tables (docs/sampling.md).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import ROOT, in_turn, parse_args, print_table, random_prompts, timed_generate, write_json

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
        model = predict_sampler(p, ROWS, None if batch.greedy_only else (res.rounds, batch.normalisers, res.race),
                                vocab, local.dtype)
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
    from serve import LLM, SamplingParams

    out = {}
    with LLM("article03", tensor_parallel_size=2, max_num_seqs=32, max_num_batched_tokens=1024,
             long_prefill_token_threshold=1024) as llm:
        for B in (1, 8, 32):
            prompts = random_prompts([32] * B, seed=B)
            greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
            timed_generate(llm, prompts, greedy)  # warm-up
            for name, kw in COST.items():
                sampled = SamplingParams(max_tokens=32, ignore_eos=True, **kw)
                ratios = []
                for _ in range(repeats):  # greedy, sampled, sampled, greedy
                    t = in_turn({"greedy": lambda: timed_generate(llm, prompts, greedy)[1],
                                 "sampled": lambda: timed_generate(llm, prompts, sampled)[1]}, 2)
                    ratios.append(sum(t["sampled"]) / sum(t["greedy"]))
                out.setdefault(name, {})[f"{B}"] = {"sampled_over_greedy_time": statistics.median(ratios),
                                                    "runs": ratios}
    return out


def main() -> None:
    args = parse_args(__doc__, {"--parts": "bytes,cost", "--repeats": 2,
                                "--out": str(ROOT / "outputs/bench_sampling.json")})
    parts = args.parts.split(",")
    result = {}
    if "bytes" in parts:
        result["bytes"] = bytes_table()
        names = list(FILTERS) + ["all-gather logits (float32)"]
        rows = []
        for vocab, per_p in result["bytes"].items():
            for p, r in per_p.items():
                rows.append([vocab, p] + [f"{r[n]['bytes_per_row']:,.0f}"
                                          + ("" if r[n].get("ledger_matches_model", True) else " (≠ model)")
                                          for n in names])
        print_table(["vocab", "p", *names], rows)
    if "cost" in parts:
        result["cost"] = cost_table(args.repeats)
        print_table(["sampling", "B = 1", "B = 8", "B = 32"], [
            [name] + [f"{per_b[B]['sampled_over_greedy_time']:.2f}×" for B in ("1", "8", "32")]
            for name, per_b in result["cost"].items()])
    write_json(args.out, result)


if __name__ == "__main__":
    main()
