"""The serving section of docs/benchmarks.md, from outputs/bench_serve_p{1,2}.json (benchmarks/bench_serve.py).

Every target of the serving benchmarks gets one sentence here, met or not, with the figure it rests on.
The timeline PNG (iteration time against iteration index, one line per chunk size) goes to docs/.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from benchmarks.common import load_json, table

TIMELINE = Path("docs/serve_timeline.png")
WITHIN = (0.75, 1.25)  # the cost model's target band, predicted/measured


def load(out: Path) -> dict[int, dict]:
    return {p: run for p in (1, 2) if (run := load_json(f"bench_serve_p{p}.json", out))}


def met(ok: bool) -> str:
    return "**met**" if ok else "**not met**"


def best_chunk(stall: dict) -> dict:
    """The chunked run with the smallest spread (max/median iteration time)."""
    return min((r for r in stall["rows"] if r["config"] != "unchunked"), key=lambda r: r["max_over_median"])


def ratios(its: list[dict]) -> list[float]:
    return [i["predicted_s"] / i["measured_s"] for i in its]


def cost_groups(its: list[dict]) -> list[tuple[str, list[dict]]]:
    kinds = [(k, [i for i in its if i["kind"] == k]) for k in ("decode-only", "mixed", "prefill-only")]
    return kinds + [("≥ 256 rows (any kind)", [i for i in its if i["rows"] >= 256])]


def within(rs: list[float]) -> int:
    return sum(WITHIN[0] <= r <= WITHIN[1] for r in rs)


def section(out: Path) -> list[str]:
    runs = load(out)
    if not runs:
        return []
    lines = ["## Serving: chunked prefill, transformers, the cost model, the engine's overhead", "",
             "`.venv/bin/torchrun --nproc_per_node=P benchmarks/bench_serve.py` (P = 1 and 2): the article03 GPT-2 LM",
             "(d=512, h=8, L=8, vocab 50257), float32, greedy, v2 with the vocab-parallel head. Times are rank 0's;",
             "iteration times are the engine's own (plan, forward, tokens); medians over the repeats.", ""]
    return lines + tables(runs)


def tables(runs: dict[int, dict]) -> list[str]:
    """The section's tables and targets for these runs (bench_serve.py prints its own run's)."""
    return stall_section(runs) + hf_section(runs) + cost_section(runs) + overhead_section(runs) + targets(runs)


def stall_section(runs: dict[int, dict]) -> list[str]:
    if not any("stall" in r for r in runs.values()):
        return []
    any_run = next(r for r in runs.values() if "stall" in r)
    lines = ["### Spread and stall (seeds/05 §3-§6)", "",
             "8 decoders (32-token prompts, 64 new tokens each) are running when a 1000-token prompt arrives at",
             "iteration 8; unchunked (one 1000-row prefill) against chunk sizes C with a budget of C + 8 rows.",
             "Time between tokens (TBT) is over all 8 decoders; the long prompt's TTFT counts from its arrival.",
             "Cache rows re-read: the long prompt's chunks re-reading its own cached prefix, Σ q_start, against",
             f"N²/(2C) with N = 1000. {any_run['stall']['repeats']} repeats per configuration, alternating.", ""]
    rows = []
    for p, run in runs.items():
        if "stall" not in run:
            continue
        base = run["stall"]["rows"][0]
        rows += [[p, r["config"], f"{r['iterations']:.0f}", f"{r['max_over_median']:.1f}",
                  f"{r['decoder_worst_tbt_s'] / base['decoder_worst_tbt_s']:.3f}",
                  f"{r['decoder_p99_tbt_s'] / base['decoder_p99_tbt_s']:.3f}",
                  f"{r['long_ttft_s'] / base['long_ttft_s']:.2f}", f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}",
                  f"{r['cache_rows_reread']:,.0f}",
                  "-" if r["config"] == "unchunked" else f"{r['reread_formula']:,.0f}"] for r in run["stall"]["rows"]]
    lines += table(["p", "config", "iterations", "max / median iteration", "decoders' worst TBT ÷ unchunked",
                    "p99 TBT ÷ unchunked", "long TTFT ÷ unchunked", "tokens/s ÷ unchunked", "cache rows re-read",
                    "N²/(2C)"], rows)
    lines += ["", "The p99 equals the worst: the 8 decoders stall in the same iterations, so the top 1% of their",
              "gaps are the same stall seen 8 times. Chunking trades the stall for the long prompt's TTFT",
              "(more iterations, each re-reading its prefix); throughput barely moves.", ""]
    if TIMELINE.exists():
        lines += [f"![iteration time per iteration, one line per chunk size]({TIMELINE.name})", ""]
    return lines


def hf_section(runs: dict[int, dict]) -> list[str]:
    if not any("hf" in r for r in runs.values()):
        return []
    any_run = next(r for r in runs.values() if "hf" in r)["hf"]
    lines = ["### Against transformers' `generate`", "",
             f"{any_run['requests']} requests, lognormal prompt lengths (mean 64, {min(any_run['prompt_lengths'])} to "
             f"{max(any_run['prompt_lengths'])} tokens), max_new_tokens uniform in "
             f"[{min(any_run['max_new_tokens'])}, {max(any_run['max_new_tokens'])}], all arriving at once; "
             "the same random",
             "GPT-2 weights in both. Ours: the engine, long_prefill_token_threshold "
             f"{any_run['chunk_size']}, max_num_batched_tokens {any_run['max_batched_tokens']}"
             + (f", max_num_seqs {any_run['max_running']} (EngineConfig's default) or all {any_run['requests']} at "
                "once (tuned), per attention backend (layers/attention/backends.py; the settings alternate over the "
                "repeats)" if "engines" in any_run else "") + ". transformers: "
             "`GPT2LMHeadModel.generate` (greedy,",
             "SDPA attention, EOS off) over static batches in request order, left-padded with an attention mask, each",
             "batch run to its largest max_new_tokens; on rank 0 with as many threads as all the engine's ranks",
             f"together (each rank runs {next(r for r in runs.values() if 'hf' in r).get('threads_per_rank', 1)} "
             "thread(s)).",
             "Tokens/s counts the tokens asked for (Σ max_new_tokens); rows computed count every row a forward",
             "pushes through the blocks, padding and finished requests included.", "",
             "The matmul FLOPs count the linears over every row computed and the head over every row it scores (the "
             "engine: each sampled row; transformers: each request of the batch in every forward, prompt and finished "
             "requests alike), attention left out: at equal FLOP/s their ratio is the most the engine can gain.", ""]
    rows = []
    for p, run in runs.items():
        if "hf" not in run:
            continue
        h = run["hf"]
        e, best = h["engine"], max(h["hf"], key=lambda b: b["tokens_per_s"])
        flops = matmul_flops(run["model"], h) if "model" in run else None
        for x in h.get("engines", [dict(e, attention=None)]):
            name = "engine" if x["attention"] is None else (
                f"engine, attention={x['attention']}, max_num_seqs "
                f"{h['max_running'] if x['max_running'] == 'default' else h['requests']}")
            same = "-" if x is h.get("engines", [None])[0] or x["attention"] is None else \
                f"{h['requests'] if x['same_ids'] else 'not all'}/{h['requests']}"
            ratio = x.get("ratio_to_best_hf", x["tokens_per_s"] / best["tokens_per_s"])
            rows.append([p, name, f"{ratio:.2f}", *against_engine(x, None, h, flops), same])
        rows += [[p, f"transformers, batch {b['batch']}{' (best)' if b is best else ''}",
                  f"{b['tokens_per_s'] / best['tokens_per_s']:.2f}", *against_engine(b, b["batch"], h, flops),
                  f"{b['same_ids']}/{h['requests']}"] for b in h["hf"]]
    lines += table(["p", "run", "tokens/s ÷ transformers' best", "forwards", "rows computed ÷ useful rows",
                    "matmul FLOPs ÷ engine's", "time per forward ÷ engine's", "same ids as the engine"], rows)
    diffs = [(p, b["batch"], d) for p, run in runs.items() if "hf" in run
             for b in run["hf"]["hf"] for d in b["differences"]]
    if diffs:
        lines += ["", "Where the ids differ (first differing step, the oracle's top-1 − top-2 margin there):"]
        lines += [f"- p={p}, batch {bs}, request {d['request']}: step {d['at']}, margin {d['margin']:.2e}"
                  f"{' (a float32 near-tie)' if d['near_tie'] else ''}" for p, bs, d in diffs]
    lines += ["", "Where the time goes: a forward costs about the same whatever it carries at these sizes (reading",
              "the weights dominates small batches), so what counts is how many forwards run and how many",
              "rows each wastes. Static batching runs every batch to its longest request and pads every prompt to",
              "the batch's longest; the engine runs one forward per iteration for all requests, each row useful.", ""]
    return lines


def cost_section(runs: dict[int, dict]) -> list[str]:
    lines = ["### The cost model against every measured iteration", "",
             "Calibrated once per run (mean of the start and the end of the run): a 1024³ matmul for FLOP/s, a",
             "128 MiB copy for bytes/s (every rank at once, as in the engine), and a fixed per-iteration cost =",
             "the median 1-row decode iteration less its roofline time. Each iteration of the spread/stall and",
             "transformers workloads is then predicted as fixed + max(FLOPs / FLOP/s, bytes / bytes/s) from its",
             "triples (`tp/cost_model.serving_iteration`: one rank's linear, head and attention FLOPs, weights",
             "and K,V bytes).", ""]
    calibrations = []
    for p, run in runs.items():
        c = run["calibration"]
        flops = f"{c['matmul_flops_per_s_first'] / 1e9:.0f} → {c['matmul_flops_per_s_last'] / 1e9:.0f}"
        calibrations.append([p, flops,
                             f"{c['copy_bytes_per_s_first'] / 1e9:.1f} → {c['copy_bytes_per_s_last'] / 1e9:.1f}",
                             f"{run['cost_model']['fixed_s'] * 1e3:.1f}"])
    lines += table(["p", "matmul GFLOP/s (start → end)", "copy GB/s (start → end)", "fixed ms per iteration"],
                   calibrations)
    rows = []
    for p, run in runs.items():
        for name, its in cost_groups(run["cost_model"]["iterations"]):
            if its:
                rs = ratios(its)
                comm = statistics.median(i["collectives_s"] / i["measured_s"] for i in its)
                rows.append([p, name, len(its), f"{statistics.median(rs):.2f}", f"{min(rs):.2f} – {max(rs):.2f}",
                             f"{within(rs)}/{len(its)}", f"{comm:.0%}"])
    lines += ["", *table(["p", "iterations", "n", "predicted / measured, median", "range", "within ±25%",
                          "in collectives, median"], rows)]
    lines += ["", "Where it fails. Decode-only iterations (8 to 32 rows) run slower than the roofline says: a GEMM of",
              "8 rows reaches well under the big-GEMM rate the calibration measured and is not yet bandwidth-bound,",
              "and each request's attention is its own small SDPA call in every layer (the cpu backend), a cost per",
              "request that a fixed per-iteration constant cannot carry. At p = 2 the large iterations spend "
              "a share of their",
              "time inside collectives (last column: the ledger's time in all-reduces and all-gathers) that grows",
              "with the rows, two processes on two cores waiting for each other; the model has no term for it.", ""]
    return lines


def overhead_section(runs: dict[int, dict]) -> list[str]:
    if not any("overhead" in r for r in runs.values()):
        return []
    lines = ["### Engine overhead", "",
             "B requests with 16-token prompts decode 15 tokens each; the engine's decode iterations (the whole",
             "loop: scheduling, plan check, cache writes, attention over the cached context, bookkeeping, the",
             "ledger's comparison with the model) against the same B rows through the bare TP forward (embedding,",
             "blocks with each row its own request and no cache, greedy head), medians.", ""]
    lines += table(["p", "decode batch", "engine loop ÷ bare forward", "engine forward path ÷ bare forward"],
                   [[p, r["batch"], f"{r['loop_over_bare']:.2f}", f"{r['iteration_over_bare']:.2f}"]
                    for p, run in runs.items() for r in run.get("overhead", [])])
    return lines + ["", "The bare forward is timed call by call behind a barrier (launch/timing.py), "
                        "the engine's iterations",
                    "back to back; at p = 2, two processes on two cores, the ratios scatter by ±0.1 from run to run.",
                    ""]


def pd_section(d: dict | None) -> list[str]:
    """docs/benchmarks.md's P/D section, from benchmarks/bench_pd.py's JSON; the script prints it too."""
    if not d:
        return []
    p_p, p_d = d["layout"]
    lines = ["## Prefill/decode disaggregation: the time to token 2 in parts", "",
             f"`.venv/bin/torchrun --nproc_per_node={p_p + p_d} benchmarks/bench_pd.py`: article03 (L=8), float32, v2; "
             f"prefill on {p_p} ranks, decode on {p_d}; {d['requests']} prompts of {d['prompt_length']} tokens "
             "(whole-prompt prefill), "
             f"{d['max_new_tokens']} new tokens each, {d['kv_bytes_per_request'] / 2**20:.0f} MiB of K,V per request.",
             "The prefill group emits token 1; token 2 needs the hand-over and one decode iteration. Transfer counts",
             "from the prefill's end to the K,V and token 1 placed on the decode ranks, including any wait for the",
             "decode group's next iteration. Medians over requests and "
             f"{d['repeats']} alternating runs per mode; as shares of the send-after-prefill time to token 2:", ""]
    base = d["modes"]["after prefill"]["to_token2_s"]
    lines += table(["K,V", "prefill (= TTFT)", "transfer", "first decode", "time to token 2"],
                   [[mode] + [f"{m[k] / base:.3f}" for k in ("prefill_s", "transfer_s", "first_decode_s",
                                                              "to_token2_s")]
                    for mode, m in d["modes"].items()])
    s_, a = d["modes"]["streaming"], d["modes"]["after prefill"]
    lines += ["", f"Streaming / send-after-prefill, time to token 2: {s_['to_token2_s'] / a['to_token2_s']:.2f} "
                  f"(transfer part {s_['transfer_s'] / a['transfer_s']:.2f}); the same tokens in both modes: "
                  f"{'yes' if d['same_tokens'] else 'NO'}.", ""]
    return lines


def targets(runs: dict[int, dict]) -> list[str]:
    lines = ["### Targets", ""]
    run = runs.get(1) or next(iter(runs.values()))
    p = run["world_size"]
    if "stall" in run:
        base, best = run["stall"]["rows"][0], best_chunk(run["stall"])
        stall_gain = base["decoder_worst_tbt_s"] / best["decoder_worst_tbt_s"]
        lines.append(f"- Spread, p={p}: chunked at the best C ({best['config']}) the longest iteration is "
                     f"{best['max_over_median']:.1f}× the median "
                     f"(target ≤ 3×: {met(best['max_over_median'] <= 3)}); "
                     f"unchunked it is {base['max_over_median']:.1f}× (expected ≥ 10×: "
                     f"{'as expected' if base['max_over_median'] >= 10 else 'below it'}).")
        lines.append(f"- Stall, p={p}: the decoders' worst time between tokens is {stall_gain:.1f}× lower at "
                     f"{best['config']} than unchunked (target ≥ 5×: {met(stall_gain >= 5)}).")
    if "hf" in run:
        e, hf = run["hf"]["engine"], run["hf"]["hf"]
        best = max(hf, key=lambda b: b["tokens_per_s"])
        ratio = paired(run["hf"])
        text = (f"- Throughput, p={p}: the engine makes {ratio:.2f}× the tokens/s of transformers' best static batch "
                f"(batch {best['batch']}) at its default settings (target ≥ 1.5×: {met(ratio >= 1.5)})")
        two = runs.get(2, {}).get("hf")
        if p == 1 and two:
            b2 = max(two["hf"], key=lambda b: b["tokens_per_s"])
            text += (f"; at p=2, {paired(two):.2f}× (transformers on {two.get('hf_threads', 2)} threads, "
                     f"batch {b2['batch']})")
        lines.append(text + ".")
    big = [i for i in run["cost_model"]["iterations"] if i["rows"] >= 256]
    if big:
        rs = ratios(big)
        text = (f"- Cost model, p={p}: {within(rs)} of {len(big)} iterations of ≥ 256 rows are predicted "
                "within ±25% "
                f"(median predicted/measured {statistics.median(rs):.2f}) (target: {met(within(rs) == len(big))}")
        text += ")" if within(rs) == len(big) else f", for {len(big) - within(rs)} of them)"
        two = [i for i in runs.get(2, {}).get("cost_model", {}).get("iterations", []) if i["rows"] >= 256]
        if p == 1 and two:
            text += (f"; at p=2, {within(ratios(two))} of {len(two)} (median {statistics.median(ratios(two)):.2f}): "
                     f"collectives on 2 shared cores are outside the model")
        lines.append(text + ".")
    if "overhead" in run:
        ge8 = [r for r in run["overhead"] if r["batch"] >= 8]
        worst = max(ge8, key=lambda r: r["loop_over_bare"])
        lines.append(f"- Overhead, p={p}: an engine iteration costs " + ", ".join(
            f"{r['loop_over_bare']:.2f}× at batch {r['batch']}" for r in run["overhead"])
            + f" the bare forward (target ≤ 1.10× for batches ≥ 8: {met(worst['loop_over_bare'] <= 1.10)}"
            + ("" if worst["loop_over_bare"] <= 1.10 else
               f", {worst['loop_over_bare']:.2f}× at batch {worst['batch']}: the engine also gathers and scores each "
               f"request's cached context, which the bare forward does not have") + ").")
    return lines + [""]


def plot_timeline(out: Path) -> str:
    """Iteration time against iteration index, one line per configuration, from the p=1 run (else p=2)."""
    runs = load(out)
    run = runs.get(1) or runs.get(2)
    if not run or "stall" not in run:
        return "timeline skipped: no bench_serve JSON with the stall part"
    try:
        import matplotlib
    except ImportError:
        return "timeline skipped: matplotlib is not installed (pip install -e .[plot])"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    for name, times in run["stall"]["timeline"].items():
        ax.plot(range(len(times)), [t * 1e3 for t in times], marker=".", linewidth=1, label=name)
    ax.set_yscale("log")
    ax.set_xlabel("iteration")
    ax.set_ylabel("iteration time (ms)")
    ax.set_title(f"8 decoders + one 1000-token prompt arriving at iteration 8, p={run['world_size']}")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    TIMELINE.parent.mkdir(exist_ok=True)
    fig.savefig(TIMELINE, dpi=110)
    plt.close(fig)
    return f"wrote {TIMELINE}"


def matmul_flops(model: dict, h: dict):
    """FLOPs of the linears and the head of a run of the hf workload: rows through the blocks (2 · the blocks'
    parameters each) plus rows scored by the head (2 · V · d each): the engine scores each token it samples (batch
    None), transformers' static batches every request of the batch in each of the batch's forwards."""
    from layers.models.config import ModelConfig
    from tp.cost_model import shape_of

    cfg = ModelConfig(**{k: v for k, v in model.items() if k in ModelConfig.__dataclass_fields__})
    per_row, per_scored = 2 * shape_of(cfg).n_params, 2 * cfg.vocab_size * cfg.d_model
    new = h["max_new_tokens"]

    def flops(rows: int, batch: int | None) -> float:
        scored = sum(new) if batch is None else sum(
            len(new[s:s + batch]) * max(new[s:s + batch]) for s in range(0, len(new), batch))
        return rows * per_row + scored * per_scored

    return flops


def paired(h: dict) -> float:
    """The engine's (default settings) tokens/s over transformers' best: paired round by round where measured so."""
    best = max(h["hf"], key=lambda b: b["tokens_per_s"])
    return h["engines"][0].get("ratio_to_best_hf", h["engine"]["tokens_per_s"] / best["tokens_per_s"]) \
        if "engines" in h else h["engine"]["tokens_per_s"] / best["tokens_per_s"]


def against_engine(x: dict, batch: int | None, h: dict, flops) -> list[str]:
    """A run's forwards, then its rows computed, matmul FLOPs and time per forward against the engine's."""
    e = h["engine"]
    return [f"{x['forwards']}", f"{x['rows'] / h['useful_rows']:.2f}", _ratio(flops, x["rows"], batch, e["rows"]),
            f"{x['time_s'] / x['forwards'] / (e['time_s'] / e['forwards']):.2f}"]


def _ratio(flops, rows: int, batch: int | None, engine_rows: int) -> str:
    return "-" if flops is None else f"{flops(rows, batch) / flops(engine_rows, None):.2f}"
