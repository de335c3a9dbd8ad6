"""Speculative decoding with n-gram proposals: tokens/s with and without it, and the bytes a verified row moves.

    python benchmarks/bench_spec_decode.py [--repeats 2] [--max-tokens 96] [--tp 1]

  speed  the article03 GPT-2 LM (float32, random weights) through LLM at tensor_parallel_size --tp, B requests at
         once (B = 1, 4, 16), greedy, --max-tokens new tokens each (ignore_eos), K = 4 proposals: n-gram
         (prompt_lookup_max 3), and a self-draft (the draft model is article03 itself: every proposal accepted,
         the upper bound of any draft, at the cost of a draft as large as the target): generate()'s time with
         speculation against without, alternating A B B A within each repeat (--repeats 2: 4 runs of each, the
         median taken); tokens are checked equal (greedy). The workload: random 16-token prompts whose continuations, under
         random weights, fall into runs of repeated tokens and phrases after a few steps (what prompt lookup finds:
         the copying case). Acceptance: vLLM's rate (accepted / proposed) and mean acceptance length
         (1 + accepted / drafts).
  bytes  per verified row per rank (tp/traffic_model.predict_sampler, which the ledger equals in the tests): the
         greedy race's all-gather of (value, id) against all-gathering the float32 logits, vocab 50257 and 128256,
         p = 2, 4, 8. A verified chunk of K + 1 rows moves K + 1 times a row's bytes, nothing more.

Prints a line per measurement as it goes (to stderr) and its run time at the end; writes
outputs/bench_spec_decode.json and prints both tables (markdown).
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

BATCHES = (1, 4, 16)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SELF_DRAFT = {"method": "draft_model", "model": "article03", "num_speculative_tokens": 4}  # the upper bound


def speed(tp: int, repeats: int, max_tokens: int) -> list[dict]:
    import torch

    from serve import LLM, SamplingParams

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 50257, (16,), generator=g).tolist() for _ in range(max(BATCHES))]
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
                times = {name: [] for name in ("plain", method)}
                tokens, before = {}, engines[method].stats()
                for _ in range(repeats):
                    for name in ("plain", method, method, "plain"):
                        start = time.perf_counter()
                        outs = engines[name].generate(prompts[:b], params)
                        times[name].append(time.perf_counter() - start)
                        tokens[name] = [o.outputs[0].token_ids for o in outs]
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
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--tp", type=int, default=1)
    args = ap.parse_args()
    began = time.perf_counter()
    result = {"bytes": row_bytes(), "speed": speed(args.tp, args.repeats, args.max_tokens)}
    print(f"ran {time.perf_counter() - began:.0f} s", file=sys.stderr)
    out = ROOT / "outputs" / "bench_spec_decode.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print("| vocab | p | race bytes per row per rank | logits all-gather | ratio |\n|---|---|---|---|---|")
    for r in result["bytes"]:
        print(f"| {r['vocab']} | {r['p']} | {r['race_bytes']:.0f} | {r['logits_bytes']:.0f} | {r['ratio']:.0f}x |")
    print("\n| method | B | tp | tokens/s plain | tokens/s speculative | speed-up | acceptance rate "
          "| mean acceptance length | same tokens |\n|---|---|---|---|---|---|---|---|---|")
    for r in result["speed"]:
        rate = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        length = "-" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.2f}"
        print(f"| {r['method']} | {r['B']} | {r['tp']} | {r['plain_tokens_per_s']:.0f} | {r['spec_tokens_per_s']:.0f} | "
              f"{r['speedup']:.2f}x | {rate} | {length} | {r['same_tokens']} |")


if __name__ == "__main__":
    main()
