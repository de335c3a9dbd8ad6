"""Prefill/decode disaggregation: where the time to token 2 goes, K,V streamed layer by layer or sent after prefill.

    torchrun --nproc_per_node=4 benchmarks/bench_pd.py [--prefill-ranks 2] [--repeats 3]

The article03 GPT-2 LM, float32, v2: prefill on ranks [0, p_P), decode on the rest (serve/pd/). Requests with long
prompts arrive one after another with few new tokens each, so the decode group is mostly waiting for the next
hand-over. Each mode runs --repeats times, alternating; tokens are checked equal across modes. Writes
outputs/bench_pd.json and prints its section of docs/benchmarks.md (benchmarks/report_serve.pd_section, which says
what prefill, transfer and first decode count).

--trace N: instead, the first N requests of Mooncake's conversation trace scaled down (benchmarks/bench_kv_tiers.py:
each 512-token block as 32 tokens seeded by its hash id, at most 24 blocks a prompt), one arriving each iteration;
written to --out (give another file, e.g. outputs/bench_pd_trace.json) and printed as one line.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import in_turn, parse_args, random_prompts, write_json
from benchmarks.report_serve import pd_section
from layers.models.config import ARTICLE03
from layers.models.dense import init_weights
from layers.models.lm import DenseLM
from serve.config import EngineConfig
from serve.pd import Layout, new_groups, serve_pd
from serve.request import Request
from tp.dist import init_from_env, shutdown

PROMPTS, PROMPT_LEN, NEW, SPACING = 6, 512, 4, 1


def requests(trace: int = 0) -> list[Request]:
    if trace:
        from benchmarks.bench_kv_tiers import load_trace, scaled_requests

        prompts = [ids for _, ids in scaled_requests(load_trace(limit=trace), trace, ARTICLE03.vocab_size, 32, 24)]
        return [Request(i, p, NEW, i * SPACING) for i, p in enumerate(prompts)]
    return [Request(i, p, NEW, i * SPACING) for i, p in enumerate(random_prompts([PROMPT_LEN] * PROMPTS, seed=4))]


def main() -> int:
    args = parse_args(__doc__, {"--prefill-ranks": dict(type=int, default=None, help="default: half the world"),
                                "--repeats": 3, "--out": "outputs/bench_pd.json", "--trace": 0})
    torch.set_num_threads(1)
    ctx = init_from_env("auto", timeout_s=600.0)
    p_prefill = args.prefill_ranks or ctx.world_size // 2
    layout = Layout(p_prefill, ctx.world_size - p_prefill)
    groups = new_groups(layout)
    dense = init_weights(DenseLM(ARTICLE03, torch.float32, ctx.device), seed=0)
    config = EngineConfig(long_prefill_token_threshold=PROMPT_LEN, max_num_batched_tokens=PROMPT_LEN,
                          max_num_seqs=PROMPT_LEN)

    def run(streaming: bool):
        res = serve_pd(dense, ctx, layout, requests(args.trace), config, streaming=streaming, groups=groups)
        assert res.ledger_matches_model
        return res

    run(True)  # warm-up
    results = in_turn({"streaming": lambda: run(True), "after prefill": lambda: run(False)}, args.repeats)
    rows = {}
    for mode, runs in results.items():
        reqs = [r for res in runs for r in res.requests]
        rows[mode] = {k: statistics.median(r[k] for r in reqs) for k in ("prefill_s", "transfer_s", "first_decode_s")}
        rows[mode]["to_token2_s"] = statistics.median(r["prefill_s"] + r["transfer_s"] + r["first_decode_s"]
                                                      for r in reqs)
    ids = {mode: [r["output_ids"] for r in runs[-1].requests] for mode, runs in results.items()}
    if args.trace:
        out = {"trace_requests": args.trace, "repeats": args.repeats, "modes": rows,
               "prompt_lengths": [len(r.prompt) for r in requests(args.trace)],
               "same_tokens": ids["streaming"] == ids["after prefill"]}
        shutdown()
        if ctx.is_main:
            s_, a = rows["streaming"], rows["after prefill"]
            print(f"trace, {args.trace} requests: streaming / send-after-prefill, time to token 2 "
                  f"{s_['to_token2_s'] / a['to_token2_s']:.2f} (transfer part {s_['transfer_s'] / a['transfer_s']:.2f});"
                  f" same tokens: {out['same_tokens']}")
            write_json(args.out, out)
        return 0
    out = {"layout": [layout.prefill_ranks, layout.decode_ranks], "prompt_length": PROMPT_LEN, "requests": PROMPTS,
           "max_new_tokens": NEW, "repeats": args.repeats,
           "kv_bytes_per_request": results["streaming"][-1].requests[0]["kv_bytes"],
           "same_tokens": ids["streaming"] == ids["after prefill"], "modes": rows}
    shutdown()
    if ctx.is_main:
        print("\n".join(pd_section(out)))
        write_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
