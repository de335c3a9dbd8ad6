"""Speculative decoding with n-gram proposals: tokens/s with and without it, and the bytes a verified row moves.

    python benchmarks/bench_spec_decode.py [--repeats 2] [--max-tokens 96] [--tp 1]

  speed  the article03 GPT-2 LM through LLM at tensor_parallel_size --tp, B = 1, 4, 16 requests at once, greedy,
         K = 4 proposals: n-gram (NGRAM), and a self-draft (article03 as its own draft: every proposal accepted, the
         upper bound of any draft, at the cost of a draft as large as the target): generate()'s time with
         speculation against without, alternating A B B A within each repeat, medians; tokens checked equal. Random
         16-token prompts whose continuations, under random weights, fall into runs of repeated tokens and phrases
         (what prompt lookup finds). Acceptance: vLLM's rate and mean acceptance length (1 + accepted / drafts).
  bytes  per verified row per rank (predict_sampler, which the ledger equals in the tests): the greedy race's
         all-gather of (value, id) against all-gathering the float32 logits. A verified chunk of K + 1 rows moves
         K + 1 times a row's bytes, nothing more.

Prints a line per measurement as it goes and its run time (stderr); writes outputs/bench_spec_decode.json and prints
both tables (docs/spec_decode.md).
"""

from __future__ import annotations

import statistics
import sys
import time
from functools import partial
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import ROOT, in_turn, parse_args, print_table, random_prompts, timed_generate, write_json

BATCHES = (1, 4, 16)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SELF_DRAFT = {"method": "draft_model", "model": "article03", "num_speculative_tokens": 4}  # the upper bound


def speed(tp: int, repeats: int, max_tokens: int) -> list[dict]:
    from serve import LLM, SamplingParams

    prompts = random_prompts([16] * max(BATCHES), seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engines = {"plain": LLM("article03", tensor_parallel_size=tp),
               "ngram": LLM("article03", tensor_parallel_size=tp, speculative_config=NGRAM),
               "self-draft": LLM("article03", tensor_parallel_size=tp, speculative_config=SELF_DRAFT)}
    rows, began = [], time.perf_counter()
    try:
        for llm in engines.values():  # warm-up
            llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4))
        for b in BATCHES:
            for method in ("ngram", "self-draft"):
                tokens, before = {}, engines[method].stats()

                def run(name: str) -> float:
                    tokens[name], took = timed_generate(engines[name], prompts[:b], params)
                    return took

                # plain, speculative, speculative, plain in each repeat
                times = in_turn({name: partial(run, name) for name in ("plain", method)}, 2 * repeats)
                print(f"B={b} {method}: median {statistics.median(times['plain']):.2f} s plain, "
                      f"{statistics.median(times[method]):.2f} s speculative ({time.perf_counter() - began:.0f} s so "
                      f"far)", file=sys.stderr, flush=True)
                after = engines[method].stats()
                drafts = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
                proposed = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
                accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
                plain, spec = statistics.median(times["plain"]), statistics.median(times[method])
                rows.append({"B": b, "tp": tp, "method": method, "same_tokens": tokens["plain"] == tokens[method],
                             "plain_tokens_per_s": b * max_tokens / plain, "spec_tokens_per_s": b * max_tokens / spec,
                             "speedup": plain / spec, "acceptance_rate": accepted / proposed if proposed else None,
                             "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
                             "drafts": drafts, "proposed": proposed, "accepted": accepted})
    finally:
        for llm in engines.values():
            llm.shutdown()
    return rows


def row_bytes() -> list[dict]:
    from tp.traffic_model import predict_sampler

    out = []
    for vocab in (50257, 128256):
        for p in (2, 4, 8):
            race = sum(t.bytes_per_rank for t in predict_sampler(p, 1, None))
            logits = sum(t.bytes_per_rank for t in predict_sampler(p, 1, ((0,), False, False), vocab))
            out.append({"vocab": vocab, "p": p, "race_bytes": race, "logits_bytes": logits, "ratio": logits / race})
    return out


def main() -> None:
    args = parse_args(__doc__, {"--repeats": 2, "--max-tokens": 96, "--tp": 1})
    began = time.perf_counter()
    result = {"bytes": row_bytes(), "speed": speed(args.tp, args.repeats, args.max_tokens)}
    print(f"ran {time.perf_counter() - began:.0f} s", file=sys.stderr)
    write_json(ROOT / "outputs" / "bench_spec_decode.json", result)
    print_table(["vocab", "p", "race bytes per row per rank", "logits all-gather", "ratio"],
                [[r["vocab"], r["p"], f"{r['race_bytes']:.0f}", f"{r['logits_bytes']:.0f}",
                  f"{r['ratio']:.0f}x"] for r in result["bytes"]])
    print_table(["method", "B", "tp", "tokens/s plain", "tokens/s speculative", "speed-up",
                 "acceptance rate", "mean acceptance length", "same tokens"],
                [[r["method"], r["B"], r["tp"], f"{r['plain_tokens_per_s']:.0f}",
                  f"{r['spec_tokens_per_s']:.0f}", f"{r['speedup']:.2f}x",
                  "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}",
                  "-" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.2f}",
                  r["same_tokens"]] for r in result["speed"]])


if __name__ == "__main__":
    main()
