"""Serving through pipeline stages: chunked prefill against one long prompt at pp = 1, 2, 4 on the same ranks.

    torchrun --nproc_per_node=4 benchmarks/bench_pp_serve.py [--layouts 1x4,2x2,4x1] [--chunk 64] [--repeats 2]

The article03 GPT-2 LM, float32, greedy, v2, vocab-parallel, boundary whole, on bench_serve's stall workload. Each
layout (pp stages x tp ranks) serves it unchunked and chunked (at pp > 1 also with chunk_pipelining), through
serve/pipeline.py's engine (pp > 1: up to pp micro-batches in flight) or serve/engine.py's (pp = 1); for pp > 1 also
the bubble and each stage's timeline (serve/pipeline.stage_report: when its blocks ran which micro-batch).

The runs alternate their order from one repeat to the next. Times are rank 0's clock; every rank's timeline is on the
machine's monotonic clock, from rank 0's start. On a CPU the ranks share the cores, so a pipeline's stages do not
overlap as they would on one GPU each. Writes outputs/bench_pp_serve.json and prints its section of
docs/benchmarks.md; benchmarks/report.py also draws docs/pp_timeline.png.
"""

from __future__ import annotations

import statistics
import sys
import time
from functools import partial
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from benchmarks.bench_serve import (LONG_ARRIVAL, LONG_NEW, LONG_PROMPT, STALL_DECODERS as DECODERS,
                                    STALL_NEW as DECODER_NEW, STALL_PROMPT as DECODER_PROMPT, stall_requests)
from benchmarks.common import in_turn, median_each, parse_args, refuse, table, write_json
from layers.models.config import ARTICLE03
from layers.models.dense import init_weights
from layers.models.lm import DenseLM, shard_lm
from layers.models.pipeline import check_layout, new_pp_groups, shard_pp_lm
from serve.config import EngineConfig
from serve.offline import OfflineEngine
from serve.pipeline import stage_report
from serve.request import Request
from tp.dist import env_world, init_from_env, shutdown

UNCHUNKED = 1024  # long_prefill_token_threshold that takes the long prompt in one micro-batch
OUT = Path("outputs/bench_pp_serve.json")
TIMELINE = Path("docs/pp_timeline.png")


def parse_layouts(text: str, world: int) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        try:
            pp, tp = (int(v) for v in item.split("x"))
        except ValueError:
            raise ValueError(f"--layouts {text!r}: give PPxTP pairs, e.g. 1x4,2x2,4x1") from None
        if pp * tp != world:
            raise ValueError(f"--layouts: {pp}x{tp} is {pp * tp} ranks, not the world's {world}")
        check_layout(world, pp, ARTICLE03.n_layers, "v2")
        out.append((pp, tp))
    return out


def stats(res, stages: dict | None) -> dict:
    gaps = [b - a for r in res.requests[:DECODERS] for a, b in zip(r["token_times_s"], r["token_times_s"][1:])]
    generated = sum(r["generated"] for r in res.requests)
    out = {"tokens_per_s": generated / res.time_s, "time_s": res.time_s,
           "long_ttft_s": res.requests[DECODERS]["ttft_s"], "decoder_p99_tbt_s": statistics.quantiles(gaps, n=100)[98],
           "decoder_worst_tbt_s": max(gaps), "decoder_median_tbt_s": statistics.median(gaps),
           "microbatches": len(res.iterations)}
    if stages is not None:
        out["bubble"] = stages["bubble"]
    return out


def timelines(stages: dict, result) -> list[dict]:
    """Each stage's steps (serve/pipeline.stage_report) from rank 0's start, marking the micro-batches that carry
    rows of the long prompt."""
    long_microbatches = {it["iteration"] for it in result.iterations
                         if any(rid == DECODERS and qs < LONG_PROMPT for rid, qs, *_ in it["triples"])}
    return [{"stage": st["stage"], "steps": [
        {"microbatch": t["microbatch"], "begin_s": t["start_s"] - result.started_at, "busy_s": t["busy_s"],
         "step_s": t["step_s"], "rows": t["rows"], "long": t["microbatch"] in long_microbatches}
        for t in st["timeline"]]} for st in stages["stages"]]


def main() -> int:
    args = parse_args(__doc__, {"--layouts": "1x4,2x2,4x1", "--chunk": 64, "--repeats": 2})
    world = env_world()[2]
    try:  # before joining the group: every rank refuses on its own
        layouts = parse_layouts(args.layouts, world)
        if not 1 <= args.chunk < LONG_PROMPT or args.repeats < 1:
            raise ValueError(f"--chunk {args.chunk} must be in [1, {LONG_PROMPT}); --repeats >= 1")
    except ValueError as exc:
        return refuse(str(exc))
    torch.set_num_threads(1)
    ctx = init_from_env()
    rank = dist.get_rank()
    dense = init_weights(DenseLM(ARTICLE03), seed=0)
    models = {}
    with torch.no_grad():
        for pp, tp in layouts:
            if pp == 1:
                models[(pp, tp)] = shard_lm(dense, "v2", ctx.group)
                continue
            layout = check_layout(world, pp, ARTICLE03.n_layers, "v2")
            stages = new_pp_groups(layout)
            models[(pp, tp)] = shard_pp_lm(dense, "v2", layout, rank, stages[layout.stage_of(rank)])
    del dense
    for pp, tp in layouts:  # warm-up: each layout once, a short workload
        config = EngineConfig(long_prefill_token_threshold=64, max_num_batched_tokens=72, max_num_seqs=72)
        OfflineEngine(models[(pp, tp)], ctx, config).run([Request(i, list(range(1, 17)), 4, 0) for i in range(4)])
    drawn: dict[str, list[dict]] = {}  # each pipelined run's stage timelines (the last repeat's)

    def run(pp: int, tp: int, name: str, chunk: int) -> dict | None:
        config = EngineConfig(long_prefill_token_threshold=chunk, max_num_batched_tokens=chunk + DECODERS,
                              chunk_pipelining=name.endswith("pipelined"), max_num_seqs=chunk + DECODERS)
        engine = OfflineEngine(models[(pp, tp)], ctx, config)
        res = engine.run(stall_requests())
        stages = stage_report(engine.engine) if pp > 1 else None  # every rank joins
        if not ctx.is_main:
            return None
        if stages is not None:
            drawn[f"{pp}x{tp} {name}"] = timelines(stages, res)
        row = stats(res, stages)
        print(f"{pp}x{tp} {name}: {row}", flush=True)
        return row

    runs = [(pp, tp, name, chunk) for pp, tp in layouts for name, chunk in
            (("unchunked", UNCHUNKED), (f"C={args.chunk}", args.chunk))
            + (((f"C={args.chunk} pipelined", args.chunk),) if pp > 1 else ())]
    start = time.perf_counter()
    results = in_turn({f"{pp}x{tp} {name}": partial(run, pp, tp, name, chunk) for pp, tp, name, chunk in runs},
                      args.repeats)
    if ctx.is_main:
        out = {"world_size": world, "layouts": layouts, "chunk": args.chunk, "repeats": args.repeats,
               "workload": {"decoders": DECODERS, "decoder_prompt": DECODER_PROMPT, "decoder_new": DECODER_NEW,
                            "long_prompt": LONG_PROMPT, "long_new": LONG_NEW, "long_arrival": LONG_ARRIVAL},
               "runs": {key: median_each(rs) for key, rs in results.items()}, "every_run": results,
               "timelines": drawn, "bench_s": time.perf_counter() - start}
        print("\n".join(section(out)))
        write_json(OUT, out)
    shutdown()
    return 0


def section(data: dict | None) -> list[str]:
    """docs/benchmarks.md's table of the run (benchmarks/report.py)."""
    if not data:
        return []
    w = data["workload"]
    rows = []
    for key, r in data["runs"].items():
        layout, name = key.split(" ", 1)
        rows.append([layout.replace("x", " × "), name, f"{r['tokens_per_s']:.1f}", f"{r['long_ttft_s'] * 1e3:.0f}",
                     f"{r['decoder_p99_tbt_s'] * 1e3:.0f}", f"{r['decoder_worst_tbt_s'] * 1e3:.0f}",
                     f"{r['bubble']:.0%}" if "bubble" in r else "–"])
    return [
        "", "## Pipeline stages serving: chunked prefill against one long prompt", "",
        f"`.venv/bin/torchrun --nproc_per_node={data['world_size']} benchmarks/bench_pp_serve.py`: "
        f"{w['decoders']} decoders ({w['decoder_prompt']}-token prompts, {w['decoder_new']} new tokens) run when a "
        f"{w['long_prompt']}-token prompt arrives at step {w['long_arrival']}; the article03 LM, float32, greedy, on "
        f"{data['world_size']} ranks as pp stages × tp ranks; unchunked (long_prefill_token_threshold {UNCHUNKED}) "
        f"and chunked (long_prefill_token_threshold {data['chunk']}, budget {data['chunk']} + {w['decoders']}; "
        "*pipelined*: `chunk_pipelining`, a prompt's next chunk entering while its previous one is in flight). "
        f"Medians of {data['repeats']} runs per row, run orders alternating. Bubble: the share of the stage-steps a "
        "stage spent outside its blocks.",
        "", *table(["layout (pp × tp)", "prefill", "tokens/s", "long prompt TTFT ms", "decoders' P99 TBT ms",
                    "worst TBT ms", "bubble"], rows), "",
        "![each stage's blocks over time, one panel per run](pp_timeline.png)",
    ]


def plot(data: dict, path: Path = TIMELINE) -> str:
    """Each stage's busy intervals over time (one panel per pp > 1 run; micro-batches with prompt rows of the long
    request in red)."""
    try:
        import matplotlib
    except ImportError:
        return "pp timeline skipped: matplotlib is not installed (pip install -e .[plot])"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(data["timelines"])
    if not keys:
        return "pp timeline skipped: no pipelined run"
    fig, axes = plt.subplots(len(keys), 1, figsize=(11, 1.1 + 0.55 * sum(len(data["timelines"][k]) for k in keys)),
                             squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        stages = data["timelines"][key]
        for s in stages:
            busy = [(t["begin_s"], t["busy_s"]) for t in s["steps"] if t["microbatch"] is not None and not t["long"]]
            long = [(t["begin_s"], t["busy_s"]) for t in s["steps"] if t["microbatch"] is not None and t["long"]]
            ax.broken_barh(busy, (s["stage"] - 0.4, 0.8), color="tab:blue")
            ax.broken_barh(long, (s["stage"] - 0.4, 0.8), color="tab:red")
        ax.set_yticks(range(len(stages)), [f"stage {s['stage']}" for s in stages])
        ax.invert_yaxis()
        ax.set_title(f"{key}: red, a micro-batch with rows of the long prompt; blue, decodes only", fontsize=9)
        ax.set_xlabel("seconds from the start")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"



if __name__ == "__main__":
    sys.exit(main())
