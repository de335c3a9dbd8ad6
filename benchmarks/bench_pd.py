"""Prefill/decode disaggregation: where the time to token 2 goes, K,V streamed layer by layer or sent after prefill.

    torchrun --nproc_per_node=4 benchmarks/bench_pd.py [--prefill-ranks 2] [--repeats 3]

The article03 GPT-2 LM (L=8), float32, v2: prefill on ranks [0, p_P), decode on the rest (serve/pd/).
Requests with long prompts (whole-prompt prefill) arrive one after another with few new tokens each, so the
decode group is mostly waiting for the next hand-over. Per request: prefill (arrival -> token 1, on the
prefill group), transfer (prefill done -> K,V and token 1 placed on the decode group, including any wait for
the decode group's next iteration boundary) and the first decode iteration (-> token 2). Each mode runs
--repeats times, alternating; medians over requests and runs. Tokens are checked equal across modes.
Writes outputs/bench_pd.json; benchmarks/report.py renders it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from layers.models.config import ARTICLE03
from layers.models.dense import init_weights
from layers.models.lm import DenseLM
from serve.config import EngineConfig
from serve.pd import Layout, new_groups, serve_pd
from serve.request import Request
from tp.dist import init_from_env, shutdown

PROMPTS, PROMPT_LEN, NEW, SPACING = 6, 512, 4, 1


def requests() -> list[Request]:
    gen = torch.Generator().manual_seed(4)
    return [Request(i, torch.randint(0, ARTICLE03.vocab_size, (PROMPT_LEN,), generator=gen).tolist(), NEW, i * SPACING)
            for i in range(PROMPTS)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill-ranks", type=int, default=None, help="default: half the world")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="outputs/bench_pd.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ctx = init_from_env("auto", timeout_s=600.0)
    p_prefill = args.prefill_ranks or ctx.world_size // 2
    layout = Layout(p_prefill, ctx.world_size - p_prefill)
    groups = new_groups(layout)
    dense = init_weights(DenseLM(ARTICLE03, torch.float32, ctx.device), seed=0)
    config = EngineConfig(long_prefill_token_threshold=PROMPT_LEN, max_num_batched_tokens=PROMPT_LEN,
                          max_num_seqs=PROMPT_LEN)
    run = lambda streaming: serve_pd(dense, ctx, layout, requests(), config,  # noqa: E731
                                     streaming=streaming, groups=groups)
    run(True)  # warm-up
    parts: dict[str, list[dict]] = {"streaming": [], "after prefill": []}
    ids: dict[str, list] = {}
    for rep in range(args.repeats):
        for mode in (("streaming", "after prefill") if rep % 2 == 0 else ("after prefill", "streaming")):
            res = run(mode == "streaming")
            parts[mode] += res.requests
            ids[mode] = [r["output_ids"] for r in res.requests]
            assert res.ledger_matches_model
    rows = {}
    for mode, reqs in parts.items():
        med = {k: statistics.median(r[k] for r in reqs) for k in ("prefill_s", "transfer_s", "first_decode_s")}
        med["to_token2_s"] = statistics.median(r["prefill_s"] + r["transfer_s"] + r["first_decode_s"] for r in reqs)
        rows[mode] = med
    out = {"layout": [layout.prefill_ranks, layout.decode_ranks], "prompt_length": PROMPT_LEN, "requests": PROMPTS,
           "max_new_tokens": NEW, "repeats": args.repeats, "kv_bytes_per_request": res.requests[0]["kv_bytes"],
           "same_tokens": ids["streaming"] == ids["after prefill"], "modes": rows}
    shutdown()
    if ctx.is_main:
        print(f"P/D, article03 (L=8), float32, prefill ranks {layout.prefill_ranks}, decode ranks "
              f"{layout.decode_ranks}, {PROMPTS} prompts of {PROMPT_LEN}: medians (ms)")
        print(f"{'mode':<14} {'prefill':>8} {'transfer':>9} {'1st decode':>10} {'to token 2':>10}")
        for mode, m in rows.items():
            print(f"{mode:<14} {m['prefill_s'] * 1e3:>8.1f} {m['transfer_s'] * 1e3:>9.1f} "
                  f"{m['first_decode_s'] * 1e3:>10.1f} {m['to_token2_s'] * 1e3:>10.1f}")
        s, a = rows["streaming"], rows["after prefill"]
        print(f"streaming / after prefill, time to token 2: {s['to_token2_s'] / a['to_token2_s']:.2f}; "
              f"same tokens: {out['same_tokens']}")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        print(f"data: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
