"""KV cache quantization: what a fixed pool holds and serves per cache dtype, and the error the cache adds.

    python benchmarks/bench_kv_quant.py [--p 2] [--repeats 3]

Part 1, capacity and throughput: llama_tiny in bfloat16 through LLM with kv_cache_dtype auto, fp8_e4m3, fp8_e5m2 and
int8, and kv_cache_memory_bytes the bytes of 8 requests at their largest in bfloat16: the pool's blocks (rank 0's),
the requests that fit at once, and tokens/s on 48 requests of 64-token prompts and 32 new tokens given at once, with
the preemptions it took. Each repeat runs every dtype once, in turn; the ratio to auto is taken within a repeat (the
machine is noisy) and its median reported.

Part 2, error, in float32 (so that the cache is the only difference): 16 prompts of 8 to 40 tokens, 24 greedy tokens
each, every dtype against auto: the requests giving the very same tokens, the share of tokens before a request's
first difference, and the largest |logprob difference| of the chosen tokens up to it.

Writes outputs/bench_kv_quant.json (docs/kv_quant.md, "Measured").
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import ROOT, parse_args, print_table, timed_generate, write_json

DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2", "int8")
MODEL, BLOCK = "llama_tiny", 16
COUNT, PROMPT, NEW = 48, 64, 32


def workload(count: int, lengths: tuple[int, int] | int, seed: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    lo, hi = (lengths, lengths) if isinstance(lengths, int) else lengths
    return [torch.randint(0, 32000, (int(torch.randint(lo, hi + 1, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(count)]


def capacity(p: int, name: str, memory: int, prompts: list[list[int]]) -> dict:
    from serve import LLM, SamplingParams

    with LLM(MODEL, tensor_parallel_size=p, dtype="bfloat16", kv_cache_memory_bytes=memory, kv_cache_dtype=name,
             calculate_kv_scales=name != "auto",
             block_size=BLOCK, max_num_seqs=COUNT, max_num_batched_tokens=2048,
             long_prefill_token_threshold=512) as llm:
        llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=1))  # warm-up
        ids, took = timed_generate(llm, prompts, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
        stats = llm.stats()
    per_request = -(-(PROMPT + NEW - 1) // BLOCK)  # blocks of one request at its largest
    return {"blocks": llm.num_blocks, "requests_held": llm.num_blocks // per_request,
            "tokens_per_s": sum(map(len, ids)) / took, "preemptions": stats["preemptions"]}


def generate(p: int, name: str, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    from serve import LLM, SamplingParams

    with LLM(MODEL, tensor_parallel_size=p, dtype="float32", kv_cache_dtype=name,
             calculate_kv_scales=name != "auto") as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, logprobs=0, ignore_eos=True))
    return [(o.outputs[0].token_ids, [step[t] for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


def compare(base, got) -> dict:
    same, before, total, worst = 0, 0, 0, 0.0
    for (ids, lps), (qids, qlps) in zip(base, got):
        n = next((i for i, (a, b) in enumerate(zip(ids, qids)) if a != b), len(ids))
        same += n == len(ids)
        before += n
        total += len(ids)
        worst = max([worst] + [abs(a - b) for a, b in zip(lps[:n + 1], qlps[:n + 1])])  # the first difference too
    return {"same_requests": same, "requests": len(base), "tokens_before_first_difference": before / total,
            "max_abs_logprob_error": worst}


def main() -> int:
    args = parse_args(__doc__, {"--p": 2, "--repeats": 3})
    from layers.models.llama import LlamaConfig  # noqa: F401  (the preset's family)
    from serve.llm import resolve_model
    from tp.partition import kv_bytes_per_token, kv_heads_per_rank

    cfg, _ = resolve_model(MODEL, args.p, "tp")
    per_token = kv_bytes_per_token(cfg.n_layers, kv_heads_per_rank(cfg.n_kv_heads, args.p), cfg.d_head, 2)
    memory = 8 * -(-(PROMPT + NEW - 1) // BLOCK) * BLOCK * per_token  # 8 requests at their largest, bfloat16
    prompts = workload(COUNT, PROMPT, seed=0)
    runs = {name: [] for name in DTYPES}
    for _ in range(args.repeats):
        for name in DTYPES:
            runs[name].append(capacity(args.p, name, memory, prompts))
    part1 = {}
    for name in DTYPES:
        r = runs[name]
        part1[name] = {"blocks": r[0]["blocks"], "requests_held": r[0]["requests_held"],
                       "preemptions": r[0]["preemptions"],
                       "tokens_per_s_ratio_to_auto": statistics.median(
                           x["tokens_per_s"] / a["tokens_per_s"] for x, a in zip(r, runs["auto"]))}
    short = workload(16, (8, 40), seed=1)
    base = generate(args.p, "auto", short)
    part2 = {name: compare(base, generate(args.p, name, short)) for name in DTYPES[1:]}
    out = {"model": MODEL, "p": args.p, "pool_bytes_per_rank": memory, "bytes_per_token_bfloat16": per_token,
           "workload": {"requests": COUNT, "prompt": PROMPT, "new": NEW}, "capacity": part1, "error": part2}
    print(f"{MODEL} at p = {args.p}, bfloat16 model, a pool of {memory // 1024} KiB per rank "
          f"({per_token} B per token in bfloat16):")
    print_table(["kv_cache_dtype", "blocks", "requests held", "preemptions", "tokens/s vs auto"],
                [[name, r["blocks"], r["requests_held"], r["preemptions"],
                  f"{r['tokens_per_s_ratio_to_auto']:.2f}"] for name, r in part1.items()])
    print("error against the unquantized cache (float32 model, 16 requests x 24 greedy tokens):")
    print_table(["kv_cache_dtype", "same tokens", "tokens before a difference", "max abs logprob error"],
                [[name, f"{e['same_requests']} of {e['requests']}",
                  f"{e['tokens_before_first_difference']:.3f}", f"{e['max_abs_logprob_error']:.2e}"]
                 for name, e in part2.items()])
    write_json(ROOT / "outputs" / "bench_kv_quant.json", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
