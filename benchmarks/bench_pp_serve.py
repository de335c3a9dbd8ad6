"""Serving through pipeline stages: chunked prefill against one long prompt at pp = 1, 2, 4 on the same ranks.

    torchrun --nproc_per_node=4 benchmarks/bench_pp_serve.py [--layouts 1x4,2x2,4x1] [--chunk 64] [--repeats 2]

The article03 GPT-2 LM (d=512, L=8, vocab 50257), float32, greedy, v2, vocab-parallel, boundary whole. The
workload of bench_serve's stall part: 8 decoders (prompts of 32, 64 new tokens each) run from step 0, and one long
prompt of 1000 tokens (8 new tokens) arrives at step 8. Each layout (pp stages x tp ranks, pp · tp = the world)
serves it unchunked (long_prefill_token_threshold 1024: the long prompt in one micro-batch) and chunked (long_prefill_token_threshold C, budget C + 8;
at pp > 1 also with chunk_pipelining, the prompt's next chunk entering while its previous one is in flight),
through serve/pipeline.py's engine (pp > 1: up to pp micro-batches in flight, each at most 1/pp of the requests) or
serve/engine.py's (pp = 1). Per run: tokens/s, the long prompt's time to first token, the decoders' time between
tokens (P99 and worst, every gap of every decoder), and for pp > 1 the bubble (the share of stage-steps a stage
spent outside its blocks, serve/pipeline.stage_report) and each stage's timeline (when its blocks ran which micro-batch: a picture).

The runs alternate their order from one repeat to the next; the table takes each run's median over the repeats.
Times are rank 0's clock; every rank's timeline is on the machine's monotonic clock, from rank 0's start. On a CPU
the ranks share the cores (two stages computing at once each run slower), so a pipeline's stages do not overlap as
they would on one GPU each. Writes outputs/bench_pp_serve.json; benchmarks/report.py renders it into
docs/benchmarks.md and draws docs/pp_timeline.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from layers.models.config import ARTICLE03
from layers.models.dense import init_weights
from layers.models.lm import DenseLM, shard_lm
from layers.models.pipeline import check_layout, new_pp_groups, shard_pp_lm
from serve.offline import OfflineEngine
from serve.config import EngineConfig
from serve.pipeline import stage_report
from serve.request import Request
from tp.dist import env_world, init_from_env, shutdown

DECODERS, DECODER_PROMPT, DECODER_NEW = 8, 32, 64
LONG_PROMPT, LONG_NEW, LONG_ARRIVAL = 1000, 8, 8  # 1000 + 8 - 1 <= max_seq_len 1024
UNCHUNKED = 1024
OUT = Path("outputs/bench_pp_serve.json")
TIMELINE = Path("docs/pp_timeline.png")


def requests() -> list[Request]:
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, ARTICLE03.vocab_size, (n,), generator=gen).tolist()
               for n in [DECODER_PROMPT] * DECODERS + [LONG_PROMPT]]
    return [Request(i, p, DECODER_NEW, 0) for i, p in enumerate(prompts[:-1])] + \
        [Request(DECODERS, prompts[-1], LONG_NEW, LONG_ARRIVAL)]


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
    out = {"tokens_per_s": generated / res.time_s, "time_s": res.time_s, "long_ttft_s": res.requests[DECODERS]["ttft_s"],
           "decoder_p99_tbt_s": statistics.quantiles(gaps, n=100)[98], "decoder_worst_tbt_s": max(gaps),
           "decoder_median_tbt_s": statistics.median(gaps), "microbatches": len(res.iterations)}
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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default="1x4,2x2,4x1")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    world = env_world()[2]
    try:  # before joining the group: every rank refuses on its own
        layouts = parse_layouts(args.layouts, world)
        if not 1 <= args.chunk < LONG_PROMPT or args.repeats < 1:
            raise ValueError(f"--chunk {args.chunk} must be in [1, {LONG_PROMPT}); --repeats >= 1")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
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
    runs = [(pp, tp, name, chunk) for pp, tp in layouts for name, chunk in
            (("unchunked", UNCHUNKED), (f"C={args.chunk}", args.chunk))
            + (((f"C={args.chunk} pipelined", args.chunk),) if pp > 1 else ())]
    for pp, tp in layouts:  # warm-up: each layout once, a short workload
        OfflineEngine(models[(pp, tp)], ctx, EngineConfig(long_prefill_token_threshold=64, max_num_batched_tokens=72, max_num_seqs=72)).run(
            [Request(i, list(range(1, 17)), 4, 0) for i in range(4)])
    results: dict[str, list[dict]] = {}
    drawn: dict[str, list[dict]] = {}  # each pipelined run's stage timelines (the last repeat's)
    start = time.perf_counter()
    for rep in range(args.repeats):
        for pp, tp, name, chunk in (runs if rep % 2 == 0 else runs[::-1]):
            engine = OfflineEngine(models[(pp, tp)], ctx, EngineConfig(long_prefill_token_threshold=chunk, max_num_batched_tokens=chunk + DECODERS, chunk_pipelining=name.endswith("pipelined"), max_num_seqs=chunk + DECODERS))
            res = engine.run(requests())
            key = f"{pp}x{tp} {name}"
            stages = stage_report(engine.engine) if pp > 1 else None  # every rank joins
            if ctx.is_main:
                if stages is not None:
                    drawn[key] = timelines(stages, res)
                results.setdefault(key, []).append(stats(res, stages))
                print(f"repeat {rep}: {key}: {results[key][-1]}", flush=True)
    if ctx.is_main:
        table = {key: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for key, rs in results.items()}
        out = {"world_size": world, "layouts": layouts, "chunk": args.chunk, "repeats": args.repeats,
               "workload": {"decoders": DECODERS, "decoder_prompt": DECODER_PROMPT, "decoder_new": DECODER_NEW,
                            "long_prompt": LONG_PROMPT, "long_new": LONG_NEW, "long_arrival": LONG_ARRIVAL},
               "runs": table, "every_run": results, "timelines": drawn,
               "bench_s": time.perf_counter() - start}
        OUT.parent.mkdir(exist_ok=True)
        OUT.write_text(json.dumps(out, indent=1))
        print("\n".join(section(out)))
    shutdown()
    return 0


def section(data: dict | None) -> list[str]:
    """docs/benchmarks.md's table of the run (benchmarks/report.py)."""
    if not data:
        return []
    w = data["workload"]
    rows = ["| layout (pp × tp) | prefill | tokens/s | long prompt TTFT ms | decoders' P99 TBT ms | worst TBT ms | "
            "bubble |", "|---|---|---|---|---|---|---|"]
    for key, r in data["runs"].items():
        layout, name = key.split(" ", 1)
        bubble = f"{r['bubble']:.0%}" if "bubble" in r else "–"
        rows.append(f"| {layout.replace('x', ' × ')} | {name} | {r['tokens_per_s']:.1f} | {r['long_ttft_s'] * 1e3:.0f} | "
                    f"{r['decoder_p99_tbt_s'] * 1e3:.0f} | {r['decoder_worst_tbt_s'] * 1e3:.0f} | {bubble} |")
    return [
        "", "## Pipeline stages serving: chunked prefill against one long prompt", "",
        f"`.venv/bin/torchrun --nproc_per_node={data['world_size']} benchmarks/bench_pp_serve.py`: "
        f"{w['decoders']} decoders ({w['decoder_prompt']}-token prompts, {w['decoder_new']} new tokens) run when a "
        f"{w['long_prompt']}-token prompt arrives at step {w['long_arrival']}; the article03 LM, float32, greedy, on "
        f"{data['world_size']} ranks as pp stages × tp ranks; unchunked (long_prefill_token_threshold {UNCHUNKED}) and chunked "
        f"(long_prefill_token_threshold {data['chunk']}, budget {data['chunk']} + {w['decoders']}; *pipelined*: `chunk_pipelining`, a "
        f"prompt's next chunk entering while its previous one is in flight). Medians of {data['repeats']} runs "
        f"per row, run orders alternating. Bubble: the share of the stage-steps a stage spent outside its blocks.",
        "", *rows, "",
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
