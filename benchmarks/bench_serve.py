"""Serving benchmarks (seeds/05 §3-§6): chunked prefill's spread and stalls, the engine
against transformers' generate, the cost model against every measured iteration, the engine's overhead.

    torchrun --nproc_per_node=P benchmarks/bench_serve.py [--parts stall,hf,overhead] [--repeats 3]

The article03 GPT-2 LM (d=512, h=8, L=8, vocab 50257, max_seq_len 1024), float32, greedy, v2,
vocab-parallel, on P ranks:

  stall      8 decoders are running when one long prompt (1000 tokens) arrives; unchunked prefill
             against chunk sizes C (budget C + 8)
  hf         32 requests (lognormal prompts, mixed max_new_tokens): the engine per attention backend against
             transformers' GPT2LMHeadModel.generate on the same weights, one run per static batch size
  overhead   decode batches of 1, 8, 32 requests: one engine iteration against the same rows through the bare
             TP forward (embedding, blocks with varlen attention, no cache, greedy head)
  cost model always: this CPU calibrated at the start and the end; every measured engine iteration of stall
             and hf predicted by tp/cost_model.serving_iteration + a fixed per-iteration cost

What each part measures and how is said beside its table in docs/benchmarks.md (benchmarks/report_serve.py
writes the section; this script prints its own run's). Times are rank 0's clock (the engine's collectives keep
ranks within one collective of each other). Ratios only: this machine is noisy. Writes
outputs/bench_serve_p{P}.json.
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

from benchmarks.common import in_turn, median_each, parse_args, random_prompts, refuse, write_json
from benchmarks.report_serve import tables
from launch.settings import generate_lengths
from launch.timing import medians
from layers.models.config import ARTICLE03
from layers.models.dense import init_weights
from layers.models.hf_gpt2 import load_lm
from layers.models.lm import DenseLM, TPLM, greedy_reference, shard_lm
from layers.sampling.sampler import sample
from serve.config import EngineConfig
from serve.offline import OfflineEngine, ServeResult
from serve.request import Request
from tp.cost_model import Hardware, serving_iteration
from tp.dist import TPContext, init_from_env, shutdown

DTYPE = torch.float32
NEAR_TIE = 1e-4  # float32: a top-1/top-2 margin this small (relative) is a near-tie
STALL_DECODERS, STALL_PROMPT, STALL_NEW = 8, 32, 64  # the running decoders
LONG_PROMPT, LONG_NEW, LONG_ARRIVAL = 1000, 8, 8  # the long prompt: 1000 + 8 - 1 <= max_seq_len 1024
CHUNKS = (32, 64, 128, 256, 512)
HF_REQUESTS, HF_PROMPT_MEAN, HF_NEW = 32, 64, (8, 64)
HF_BATCHES = (1, 4, 8, 16, 32)
HF_CONTENDERS = 2  # transformers' fastest batch sizes in the first round, run again in every round after it
HF_CHUNK, HF_BUDGET = 256, 512
# the engine's runs on the hf workload: (attention backend, max_num_seqs); "default" is EngineConfig's own (16),
# "all" lets every request run at once (the tuned setting)
HF_RUNS = (("cpu", "default"), ("batched", "default"), ("reference", "default"), ("cpu", "all"), ("batched", "all"))
OVERHEAD_BATCHES, OVERHEAD_PROMPT, OVERHEAD_NEW = (1, 8, 32), 16, 16


def serve(lm: TPLM, ctx: TPContext, requests: list[Request], chunk: int, budget: int, backend: str = "auto",
          running: int | None = None) -> ServeResult:
    """running: max_num_seqs (None: every request may run at once, as many as the budget's rows)."""
    # comm_timing: the cost model's table shows each iteration's collective time (comm_time_s); on a CPU the waits
    # for the stream it adds cost nothing
    config = EngineConfig(long_prefill_token_threshold=chunk, max_num_batched_tokens=budget, comm_timing=True,
                          attention=backend, max_num_seqs=running or budget)
    return OfflineEngine(lm, ctx, config).run(requests)


# ---- calibration ------------------------------------------------------------------------------------


def calibrate(ctx: TPContext) -> dict:
    """Matmul FLOP/s and copy bytes/s of this CPU, every rank at once (as they run in the engine), slowest rank."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b  # the first matmul of a process pays for setting up its kernels
    src, dst = torch.randn(32 * 2**20), torch.empty(32 * 2**20)  # 128 MiB each
    t = medians({"matmul": lambda: a @ b, "copy": lambda: dst.copy_(src)}, 7, ctx)
    return {"matmul_flops_per_s": 2 * 1024**3 / t["matmul"], "copy_bytes_per_s": 2 * src.nbytes / t["copy"]}


def iteration_cost(lm: TPLM, ctx: TPContext, record: dict):
    chunks = [(qs, qe) for _, qs, qe, _ in record["triples"]]
    return serving_iteration(lm.cfg, ctx.world_size, chunks, record["sampled"], DTYPE.itemsize, lm.vocab_parallel)


def kind(record: dict) -> str:
    if record["prefill_chunks"] == 0:
        return "decode-only"
    return "mixed" if record["decodes"] else "prefill-only"


# ---- 1. spread and stall ---------------------------------------------------------------------------


def stall_requests() -> list[Request]:
    prompts = random_prompts([STALL_PROMPT] * STALL_DECODERS + [LONG_PROMPT], seed=1)
    reqs = [Request(i, p, STALL_NEW, 0) for i, p in enumerate(prompts[:-1])]
    return reqs + [Request(STALL_DECODERS, prompts[-1], LONG_NEW, LONG_ARRIVAL)]


def stall_stats(res: ServeResult, chunk: int) -> dict:
    times = [it["time_s"] for it in res.iterations]
    gaps = [b - a for r in res.requests[:STALL_DECODERS] for a, b in zip(r["token_times_s"], r["token_times_s"][1:])]
    long = res.requests[STALL_DECODERS]
    reread = sum(qs for it in res.iterations for rid, qs, qe, _ in it["triples"]
                 if rid == STALL_DECODERS and qs < LONG_PROMPT)
    c = min(chunk, LONG_PROMPT)
    return {"iterations": len(times), "max_s": max(times), "median_s": statistics.median(times),
            "max_over_median": max(times) / statistics.median(times),
            "decoder_worst_tbt_s": max(gaps), "decoder_p99_tbt_s": statistics.quantiles(gaps, n=100)[98],
            "long_ttft_s": long["ttft_s"], "tokens": sum(r["generated"] for r in res.requests),
            "tokens_per_s": sum(r["generated"] for r in res.requests) / res.time_s,
            "cache_rows_reread": reread, "reread_formula": LONG_PROMPT**2 / (2 * c)}


def bench_stall(lm: TPLM, ctx: TPContext, repeats: int) -> tuple[dict, list[dict]]:
    configs = [("unchunked", 1024)] + [(f"C={c}", c) for c in CHUNKS]
    serve(lm, ctx, stall_requests(), 64, 64 + STALL_DECODERS)  # warm-up
    timeline: dict[str, list[float]] = {}
    records = []

    def run(name: str, chunk: int) -> dict:
        res = serve(lm, ctx, stall_requests(), chunk, chunk + STALL_DECODERS)
        timeline[name] = [it["time_s"] for it in res.iterations]
        records.extend(dict(it, run=f"stall {name}") for it in res.iterations)
        return stall_stats(res, chunk)

    runs = in_turn({name: partial(run, name, chunk) for name, chunk in configs}, repeats)
    rows = [{"config": name, "chunk_size": chunk, "max_batched_tokens": chunk + STALL_DECODERS,
             **median_each(runs[name])} for name, chunk in configs]
    return {"rows": rows, "timeline": timeline, "repeats": repeats}, records


# ---- 2. against transformers -----------------------------------------------------------------------


def hf_workload() -> tuple[list[list[int]], list[int]]:
    lengths = generate_lengths("lognormal", HF_REQUESTS, HF_PROMPT_MEAN, 512, seed=0)
    gen = torch.Generator().manual_seed(2)
    new = torch.randint(HF_NEW[0], HF_NEW[1] + 1, (HF_REQUESTS,), generator=gen).tolist()
    return random_prompts(lengths, seed=1), new


def hf_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = ARTICLE03
    torch.manual_seed(0)  # every rank builds the same random GPT-2
    model = GPT2LMHeadModel(GPT2Config(n_embd=cfg.d_model, n_head=cfg.n_heads, n_layer=cfg.n_layers, n_inner=cfg.d_ffn,
                                       n_positions=cfg.max_seq_len, vocab_size=cfg.vocab_size, resid_pdrop=0.0,
                                       embd_pdrop=0.0, attn_pdrop=0.0)).eval()
    model.generation_config.eos_token_id = None  # exactly max_new_tokens, like the engine
    model.generation_config.pad_token_id = 0
    return model


def hf_generate(model, prompts: list[list[int]], new: list[int], batch: int) -> tuple[list[list[int]], dict]:
    """Static batches in request order: left-padded to the batch's longest prompt, run to its largest max_new_tokens."""
    out, rows, steps = [], 0, 0
    start = time.perf_counter()
    for s in range(0, len(prompts), batch):
        ps, ms = prompts[s:s + batch], new[s:s + batch]
        width = max(map(len, ps))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in ps])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=mask, max_new_tokens=max(ms), do_sample=False, num_beams=1)
        out += [gen[i, width:width + m].tolist() for i, m in enumerate(ms)]
        rows += len(ps) * (width + max(ms) - 1)  # the prefill square plus one row per request per decode step
        steps += max(ms)
    return out, {"time_s": time.perf_counter() - start, "rows": rows, "forwards": steps}


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def bench_hf(dense: DenseLM, lm: TPLM, ctx: TPContext, model, repeats: int) -> tuple[dict, list[dict]]:
    """`repeats` rounds, each running every engine setting (HF_RUNS) and then transformers (every static batch in the
    first round, its HF_CONTENDERS fastest after it): the ratio to transformers' best is taken within each round and
    its median reported, so that the machine's drift over the run falls on both sides of each ratio."""
    prompts, new = hf_workload()
    requests = lambda: [Request(i, p, m, 0) for i, (p, m) in enumerate(zip(prompts, new))]  # noqa: E731
    useful = sum(new)
    serve(lm, ctx, requests()[:4], HF_CHUNK, HF_BUDGET)  # warm-up
    runs: dict[tuple, list[ServeResult]] = {run: [] for run in HF_RUNS}
    hf: dict[int, list[tuple[list, dict]]] = {batch: [] for batch in HF_BATCHES}  # rank 0: per batch, per round
    best_per_round: list[float] = []
    for round_ in range(repeats):
        for attention, running in HF_RUNS:
            runs[attention, running].append(serve(lm, ctx, requests(), HF_CHUNK, HF_BUDGET, attention,
                                                  EngineConfig.max_num_seqs if running == "default" else HF_REQUESTS))
        if ctx.rank == 0:  # the other ranks wait at the barrier below
            threads = torch.get_num_threads()
            torch.set_num_threads(ctx.world_size * threads)  # the cores the engine used
            if round_ == 0:
                hf_generate(model, prompts[:2], [2, 2], 2)  # warm-up
            # every batch size in the first round; after it, the HF_CONTENDERS fastest of that round
            batches = HF_BATCHES if round_ == 0 else \
                sorted(HF_BATCHES, key=lambda b: hf[b][0][1]["time_s"])[:HF_CONTENDERS]
            for batch in batches:
                hf[batch].append(hf_generate(model, prompts, new, batch))
            best_per_round.append(max(useful / hf[b][-1][1]["time_s"] for b in batches))
            torch.set_num_threads(threads)
        dist.barrier(group=ctx.group)
    engines = []
    for (attention, running), results in runs.items():
        res = sorted(results, key=lambda r: r.time_s)[len(results) // 2]  # the median run
        engines.append({"attention": attention, "max_running": running, "time_s": res.time_s,
                        "tokens_per_s": useful / res.time_s, "forwards": len(res.iterations),
                        "rows": sum(it["rows"] for it in res.iterations), "runs": repeats,
                        "ids": [r["output_ids"] for r in res.requests]})
        if best_per_round:  # rank 0
            engines[-1]["ratio_to_best_hf"] = statistics.median(
                useful / r.time_s / best for r, best in zip(results, best_per_round))
    main = engines[0]  # the defaults: attention auto (cpu here), max_num_seqs 16
    results = runs[HF_RUNS[0]]
    ours = main["ids"]
    for e in engines:
        e["same_ids"] = e.pop("ids") == ours
    engine = {k: main[k] for k in ("time_s", "tokens_per_s", "forwards", "rows", "runs")}
    batches = []
    for batch, got in hf.items():
        if not got:
            continue
        ids, stats = got[0]
        stats = dict(stats, time_s=statistics.median(st["time_s"] for _, st in got))
        diffs = []
        for i, (a, b) in enumerate(zip(ours, ids)):
            at = first_difference(a, b)
            if at is not None:
                ref = greedy_reference(dense, prompts[i], at + 1)
                tie = ref.margins[at] <= NEAR_TIE * max(1.0, abs(ref.logits[at]))
                diffs.append({"request": i, "at": at, "margin": ref.margins[at], "near_tie": tie})
        batches.append(dict(stats, batch=batch, runs=len(got), tokens_per_s=useful / stats["time_s"],
                            same_ids=HF_REQUESTS - len(diffs), differences=diffs))
    records = [dict(it, run="hf workload") for r in results for it in r.iterations]
    return {"requests": HF_REQUESTS, "prompt_lengths": [len(p) for p in prompts], "max_new_tokens": new,
            "useful_tokens": useful, "useful_rows": sum(len(p) + m - 1 for p, m in zip(prompts, new)),
            "chunk_size": HF_CHUNK, "max_batched_tokens": HF_BUDGET, "engine": engine, "engines": engines,
            "max_running": EngineConfig.max_num_seqs, "hf": batches,
            "hf_threads": ctx.world_size * torch.get_num_threads()}, records


# ---- 4. engine overhead ----------------------------------------------------------------------------


def bare_step(lm: TPLM, ids: torch.Tensor, positions: torch.Tensor, cu: list[int]):
    """The same rows through the TP LM without a cache: each row its own one-token request."""
    x = lm.embed(ids) + lm.wpe(positions)
    x = lm.stack(x, cu)[-1]
    head = lm.embed  # the vocab-parallel head's greedy pick, as TPLM.step takes it
    return sample(head.local_logits(lm.ln_f(x)), head.start, head.head_group, None, lm.cfg.vocab_size)


def bench_overhead(lm: TPLM, ctx: TPContext, repeats: int, batches=OVERHEAD_BATCHES,
                   backend: str = "auto") -> list[dict]:
    rows = []
    for batch in batches:
        prompts = random_prompts([OVERHEAD_PROMPT] * batch, seed=3)
        loops, forwards, decode_records = [], [], []
        for _ in range(repeats + 1):  # the first run warms up
            reqs = [Request(i, p, OVERHEAD_NEW, 0) for i, p in enumerate(prompts)]
            res = serve(lm, ctx, reqs, OVERHEAD_PROMPT, OVERHEAD_PROMPT * batch, backend)
            its = res.iterations
            decode = [i for i, it in enumerate(its[:-1]) if kind(it) == "decode-only"]  # the last has no next start
            loops.append([its[i + 1]["start_s"] - its[i]["start_s"] for i in decode])
            forwards.append([its[i]["time_s"] for i in decode])
            decode_records.append([its[i] for i in decode])
        loop = statistics.median(t for run in loops[1:] for t in run)
        in_engine = statistics.median(t for run in forwards[1:] for t in run)
        ids = torch.tensor([p[0] for p in prompts], device=ctx.device)
        positions = torch.full((batch,), OVERHEAD_PROMPT, device=ctx.device)
        cu = list(range(batch + 1))
        bare = medians({"bare": lambda: bare_step(lm, ids, positions, cu)}, 15, ctx)["bare"]
        rows.append({"batch": batch, "engine_loop_s": loop, "engine_iteration_s": in_engine, "bare_forward_s": bare,
                     "loop_over_bare": loop / bare, "iteration_over_bare": in_engine / bare,
                     "records": [r for run in decode_records[1:] for r in run]})
    return rows


# ---- 3. the cost model -----------------------------------------------------------------------------


def predict(lm: TPLM, ctx: TPContext, calibration: dict, one_row: list[dict], records: list[dict]) -> dict:
    hw = Hardware("this CPU", calibration["matmul_flops_per_s"], calibration["copy_bytes_per_s"],
                  "calibrated: 1024³ matmul, 128 MiB copy")
    single = statistics.median(it["time_s"] for it in one_row)
    fixed = single - iteration_cost(lm, ctx, one_row[0]).time(hw)
    out = []
    for it in records:
        cost = iteration_cost(lm, ctx, it)
        t = fixed + cost.time(hw)
        out.append({"run": it["run"], "iteration": it["iteration"], "kind": kind(it), "rows": it["rows"],
                    "flops": cost.flops, "bytes": cost.bytes_loaded, "measured_s": it["time_s"], "predicted_s": t,
                    "collectives_s": it["comm_time_s"],
                    "bound": "compute" if cost.flops / hw.flops >= cost.bytes_loaded / hw.hbm else "bandwidth"})
    return {"fixed_s": fixed, "one_row_s": single, "iterations": out}


def main() -> int:
    parts = dict(default="stall,hf,overhead", help="comma-separated: stall, hf, overhead")
    threads = dict(type=int, default=1, help="torch threads per rank (transformers gets P times this)")
    args = parse_args(__doc__, {"--parts": parts, "--repeats": 3, "--threads": threads,
                                "--out": dict(default=None, help="default outputs/bench_serve_p{P}.json")})
    parts = set(args.parts.split(","))
    if not parts <= {"stall", "hf", "overhead"} or args.repeats < 1 or args.threads < 1:
        return refuse(f"--parts {args.parts!r} must name stall, hf, overhead; --repeats and --threads >= 1")
    torch.set_num_threads(args.threads)  # torchrun sets OMP_NUM_THREADS=1 only for P > 1: the same at every P
    ctx = init_from_env("auto", timeout_s=1800.0)  # rank 0 runs transformers alone while the others wait
    cfg = ARTICLE03
    dense = init_weights(DenseLM(cfg, DTYPE, ctx.device), seed=0)
    lm = shard_lm(dense, "v2", ctx.group)
    out: dict = {"world_size": ctx.world_size, "threads_per_rank": args.threads, "backend": ctx.backend,
                 "model": cfg.asdict(), "dtype": "float32"}
    first = calibrate(ctx)
    records: list[dict] = []
    if "stall" in parts:
        out["stall"], recs = bench_stall(lm, ctx, args.repeats)
        records += recs
    overhead = bench_overhead(lm, ctx, args.repeats) if "overhead" in parts else None
    if "hf" in parts:
        model = hf_model()
        hf_dense = DenseLM(cfg, DTYPE, ctx.device)
        load_lm(hf_dense, model.state_dict())
        out["hf"], recs = bench_hf(hf_dense, shard_lm(hf_dense, "v2", ctx.group), ctx, model, args.repeats)
        records += recs
    last = calibrate(ctx)  # again at the end: the machine's drift over the run, and the mean of both is used
    out["calibration"] = {k: (first[k] + last[k]) / 2 for k in first}
    out["calibration"].update({f"{k}_first": first[k] for k in first} | {f"{k}_last": last[k] for k in last})
    one_row = (overhead or bench_overhead(lm, ctx, 1, batches=(1,)))[0]["records"]  # for the fixed cost
    if overhead:
        out["overhead"] = [{k: v for k, v in r.items() if k != "records"} for r in overhead]
    out["cost_model"] = predict(lm, ctx, out["calibration"], one_row, records)
    shutdown()
    if ctx.is_main:
        print("\n".join(tables({ctx.world_size: out})))
        write_json(args.out or f"outputs/bench_serve_p{ctx.world_size}.json", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
