"""KV eviction on the trained model (`make model`: models/stdlib, GPT-2, 4 layers, 256 positions): what can be dropped
and what cannot (docs/eviction.md).

    python benchmarks/bench_eviction.py [--model models/stdlib] [--sequences 64] [--repeats 3]
                                        [--parts perplexity,sinks,pareto,memory,speed]

  perplexity  held-out text (train/data.py's split, never trained on) cut into --sequences sequences of the model's
              whole context (256 tokens), scored through LLM with prompt logprobs in chunks of 16 rows (the window
              slides inside a prompt; h2o decides after each chunk): the mean negative log-likelihood of every
              token, and of the tokens at positions past the budget (those eviction touches), at KV budgets of 12.5,
              25, 50 and 100 % of the sequence, for sinks (4) + window, the window alone (no sinks), one sink +
              window, and h2o (half the budget recent, half heavy hitters). For streaming, the same figure from the
              dense model recomputed under the same mask (layers/attention/eviction.streaming_reference) beside it.
  sinks       the attention each layer's heads give to the first 4 positions, averaged over the queries at positions
              >= 64 (the dense model's attention probabilities), against a uniform share; plotted.
  pareto      kv_cache_dtype auto | fp8_e4m3 | int8 (calculated scales) crossed with the policies and budgets: KV
              bytes a sequence of 256 holds (budget x bytes per token) against perplexity; plotted, the Pareto front
              marked.
  memory      host only (the scheduler and block manager, no model): a fixed pool of 64 blocks of 16 positions,
              32 requests of 200-token prompts generating 56 tokens, max_num_seqs 32: the most requests running at
              once, iterations to finish, and preemptions, without eviction, with sinks + window 64 and h2o 64.
  speed       decode at long context through LLM (tp 1): 16 requests of 192-token prompts generating 64 tokens,
              greedy, without eviction, with sinks 4 + window 32 and with h2o at 32, no prefix cache (each repeat
              computes its prompts again); generate()'s time interleaved, medians of --repeats; ratios and whether
              the tokens differ (they may: eviction changes what is attended).

Writes outputs/bench_eviction.json, outputs/eviction_sinks.png, outputs/eviction_pareto.png (copied to docs/) and
prints the tables.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import ROOT, parse_args, print_table, refuse, save_figure, write_json

CONTEXT = 256
CHUNK = 16  # prompt rows per request and step: h2o decides once a step, so its queries read at most budget + 15 keys
FRACTIONS = (0.125, 0.25, 0.5, 1.0)
SINKS = 4


def policies(budget: int) -> dict[str, dict | None]:
    """Name -> kv_eviction at a budget of `budget` positions a query reads (None: the whole cache)."""
    if budget >= CONTEXT:
        return {"full cache": None}
    return {"sinks + window": {"policy": "streaming", "sink_tokens": SINKS, "window_tokens": budget - SINKS},
            "window only": {"policy": "streaming", "sink_tokens": 0, "window_tokens": budget},
            "1 sink + window": {"policy": "streaming", "sink_tokens": 1, "window_tokens": budget - 1},
            "h2o": {"policy": "h2o", "budget_tokens": budget, "recent_tokens": budget // 2}}


def held_out_sequences(model: str, n: int):
    import torch

    held = torch.load(Path(model) / "tokens.pt")["held_out"]
    if len(held) < n * CONTEXT:
        raise ValueError(f"{model}: {len(held)} held-out tokens, fewer than {n} x {CONTEXT}")
    return [held[i * CONTEXT:(i + 1) * CONTEXT].tolist() for i in range(n)]


def served_nll(model: str, seqs, eviction, budget: int, **engine) -> dict:
    """Mean NLL (nats) of every scored token and of those at positions >= budget, through LLM."""
    from serve import LLM
    from serve.sampling_params import SamplingParams

    with LLM(model, kv_eviction=eviction, long_prefill_token_threshold=CHUNK, max_num_batched_tokens=512,
             max_num_seqs=32, **engine) as llm:
        outs = llm.generate(seqs, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, ignore_eos=True))
        evicted = llm.stats().get("kv_evicted_blocks", 0)
    every, late = [], []
    for ids, o in zip(seqs, outs):
        for pos in range(1, len(ids)):
            nll = -o.prompt_logprobs[pos][ids[pos]]
            every.append(nll)
            if pos >= budget:
                late.append(nll)
    return {"nll": statistics.fmean(every), "nll_past_budget": statistics.fmean(late) if late else None,
            "evicted_blocks": evicted}


def dense_nll(dense, seqs, eviction) -> float | None:
    """The same under StreamingLLM's mask without a cache (None for h2o, whose mask is the engine's own log)."""
    import torch

    from layers.attention.eviction import streaming_reference

    if eviction is not None and eviction["policy"] != "streaming":
        return None
    window = None if eviction is None else (eviction["sink_tokens"], eviction["window_tokens"])
    total, count = 0.0, 0
    with torch.no_grad(), streaming_reference(window):
        for ids in seqs:
            t = torch.tensor(ids)
            logp = torch.log_softmax(dense.logits(t).double(), dim=-1)
            total -= float(logp[:-1].gather(1, t[1:, None]).sum())
            count += len(ids) - 1
    return total / count


def load_dense(model: str):
    import torch

    from layers.models.hf import read_config, read_state, load_lm
    from layers.models.lm import dense_lm

    lm = dense_lm(read_config(model), torch.float32)
    load_lm(lm, read_state(model))
    return lm.eval()


def part_perplexity(args, seqs, out):
    dense = load_dense(args.model)
    rows = []
    for fraction in FRACTIONS:
        budget = int(CONTEXT * fraction)
        for name, eviction in policies(budget).items():
            got = served_nll(args.model, seqs, eviction, budget)
            ref = dense_nll(dense, seqs, eviction)
            row = {"budget": budget, "fraction": fraction, "policy": name, **got, "dense_nll": ref}
            out["perplexity"].append(row)
            rows.append([f"{fraction:.1%} ({budget})", name, f"{math.exp(got['nll']):.3f}",
                         "-" if got["nll_past_budget"] is None else f"{math.exp(got['nll_past_budget']):.3f}",
                         "-" if ref is None else f"{math.exp(ref):.3f}", got["evicted_blocks"]])
            print(f"perplexity {budget} {name}: {math.exp(got['nll']):.3f}", file=sys.stderr)
    print_table(["KV budget", "policy", "perplexity (served)", "past the budget", "dense, same mask",
                 "blocks evicted"], rows)


def part_sinks(args, seqs, out):
    import torch
    import torch.nn.functional as F

    import layers.attention.attention as attention_module

    dense = load_dense(args.model)
    cfg = dense.cfg
    probs, original = [], F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, is_causal=False, scale=None, **kw):
        n = q.shape[-2]
        s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        probs.append(s.softmax(-1)[0])  # [h, n, n]
        return original(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)

    mass = torch.zeros(cfg.n_layers, cfg.n_heads)
    attention_module.F.scaled_dot_product_attention = recording
    try:
        with torch.no_grad():
            for ids in seqs:
                probs.clear()
                dense.logits(torch.tensor(ids))
                for layer, p in enumerate(probs):
                    mass[layer] += p[:, 64:, :SINKS].sum(-1).mean(-1)
    finally:
        attention_module.F.scaled_dot_product_attention = original
    mass /= len(seqs)
    uniform = statistics.fmean(SINKS / (q + 1) for q in range(64, CONTEXT))  # each query's share if uniform
    out["sinks"] = {"mass_first_4": mass.tolist(), "uniform_share": uniform}
    print_table(["layer"] + [f"head {h}" for h in range(cfg.n_heads)] + ["uniform"],
                [[layer] + [f"{float(x):.4f}" for x in mass[layer]] + [f"{uniform:.4f}"]
                 for layer in range(cfg.n_layers)])
    plot_sinks(mass, uniform)


def plot_sinks(mass, uniform):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers, heads = mass.shape
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    width = 0.8 / heads
    for h in range(heads):
        ax.bar([layer + h * width for layer in range(layers)], mass[:, h].tolist(), width, label=f"head {h}")
    ax.axhline(uniform, color="black", linestyle="--", label="uniform share")
    ax.set_xticks([layer + 0.4 - width / 2 for layer in range(layers)], [f"layer {i}" for i in range(layers)])
    ax.set_ylabel(f"attention on positions 0..{SINKS - 1}")
    ax.set_title("models/stdlib: attention to the first 4 tokens (queries at >= 64)")
    ax.legend(fontsize=7, ncol=3)
    save_figure(fig, "eviction_sinks.png")


def part_pareto(args, seqs, out):
    from layers.models.hf import read_config
    from serve.kv_cache import cache_layout_of, layout_block_bytes
    import torch

    cfg = read_config(args.model)
    rows = []
    for dtype in ("auto", "fp8_e4m3", "int8"):
        per_token = layout_block_bytes(cfg.n_layers, cache_layout_of(cfg, 1), 1, torch.float32, dtype)
        for fraction in FRACTIONS:
            budget = int(CONTEXT * fraction)
            for name, eviction in policies(budget).items():
                if name == "1 sink + window":
                    continue
                known = next((r for r in out["perplexity"] if dtype == "auto" and r["budget"] == budget
                              and r["policy"] == name), None)
                got = known or served_nll(args.model, seqs, eviction, budget, kv_cache_dtype=dtype,
                                          calculate_kv_scales=dtype != "auto")
                row = {"cache_dtype": dtype, "policy": name, "budget": budget, "kv_bytes": budget * per_token,
                       "nll": got["nll"]}
                out["pareto"].append(row)
                rows.append([dtype, name, budget, budget * per_token, f"{math.exp(got['nll']):.3f}"])
                print(f"pareto {dtype} {name} {budget}: {math.exp(got['nll']):.3f}", file=sys.stderr)
    front = pareto_front(out["pareto"])
    for row, r in zip(rows, out["pareto"]):
        row.append("yes" if r in front else "")
    print_table(["kv_cache_dtype", "policy", "budget (positions)", "KV bytes held at 256", "perplexity",
                 "on the front"], rows)
    plot_pareto(out["pareto"], front)


def pareto_front(points: list[dict]) -> list[dict]:
    """The points no other point beats on both KV bytes and perplexity."""
    return [p for p in points if not any(q["kv_bytes"] <= p["kv_bytes"] and q["nll"] <= p["nll"]
                                         and (q["kv_bytes"], q["nll"]) != (p["kv_bytes"], p["nll"]) for q in points)]


def plot_pareto(points, front):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.2, 4.4))
    for dtype, color in (("auto", "C0"), ("fp8_e4m3", "C1"), ("int8", "C2")):
        for policy, marker in (("sinks + window", "o"), ("window only", "s"), ("h2o", "^"), ("full cache", "*")):
            mine = sorted((p for p in points if p["cache_dtype"] == dtype and p["policy"] == policy),
                          key=lambda p: p["kv_bytes"])
            if mine:
                ax.plot([p["kv_bytes"] / 1024 for p in mine], [math.exp(p["nll"]) for p in mine], marker=marker,
                        color=color, linestyle="-" if policy != "window only" else "--",
                        label=f"{'float32' if dtype == 'auto' else dtype}, {policy}")
    ordered = sorted(front, key=lambda p: p["kv_bytes"])
    ax.plot([p["kv_bytes"] / 1024 for p in ordered], [math.exp(p["nll"]) for p in ordered], color="black",
            linestyle=":", label="Pareto front")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("KV KiB a 256-token sequence holds (budget x bytes per token)")
    ax.set_ylabel("held-out perplexity")
    ax.set_title("models/stdlib: eviction x quantization")
    ax.legend(fontsize=6, ncol=2)
    save_figure(fig, "eviction_pareto.png")


def part_memory(args, out):
    from serve.block_manager import KVCacheManager
    from serve.config import EngineConfig
    from serve.request import Request
    from serve.scheduler import Scheduler

    rows = []
    for name, eviction in (("no eviction", None),
                           ("sinks 4 + window 64", {"policy": "streaming", "sink_tokens": 4, "window_tokens": 64}),
                           ("h2o, budget 64", {"policy": "h2o", "budget_tokens": 64})):
        config = EngineConfig(max_num_seqs=32, long_prefill_token_threshold=64, max_num_batched_tokens=512,
                              block_size=16, num_gpu_blocks_override=64, kv_eviction=eviction,
                              enable_prefix_caching=False)
        reqs = [Request(i, [1 + (i * 7 + j) % 4000 for j in range(200)], 56) for i in range(32)]
        sched = Scheduler(config, KVCacheManager(64, 16, False), reqs)
        most, index = 0, 0
        while sched.has_work():
            plan = sched.schedule(index)
            if plan is not None:
                most = max(most, len(sched.running))
                sched.update_from_output(plan, {c.request: 5 for c in plan.scheduled if c.sample})
            index += 1
        row = {"setting": name, "most_running": most, "iterations": index, "preemptions": sched.preemptions,
               "evicted_blocks": sched.blocks.evicted}
        out["memory"].append(row)
        rows.append([name, most, index, sched.preemptions, sched.blocks.evicted])
    print_table(["pool: 64 blocks x 16", "most requests running at once", "iterations", "preemptions",
                 "blocks evicted"], rows)


def part_speed(args, seqs, out):
    from serve import LLM
    from serve.sampling_params import SamplingParams

    prompts = [ids[:192] for ids in seqs[:16]]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    settings = {"no eviction": None,
                "sinks 4 + window 32": {"policy": "streaming", "sink_tokens": SINKS, "window_tokens": 32},
                "h2o, budget 32": {"policy": "h2o", "budget_tokens": 32}}
    # no prefix cache: each repeat computes its prompts again (h2o takes no hit, and the others must not either)
    llms = {name: LLM(args.model, kv_eviction=e, max_num_seqs=16, enable_prefix_caching=False)
            for name, e in settings.items()}
    times, tokens = {name: [] for name in llms}, {}
    try:
        for llm in llms.values():
            llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0))  # warm
        for r in range(args.repeats):
            for name in (list(llms) if r % 2 == 0 else list(llms)[::-1]):
                start = time.perf_counter()
                outs = llms[name].generate(prompts, params)
                times[name].append(time.perf_counter() - start)
                tokens[name] = [o.outputs[0].token_ids for o in outs]
    finally:
        for llm in llms.values():
            llm.shutdown()
    base = statistics.median(times["no eviction"])
    rows = []
    for name in llms:
        t = statistics.median(times[name])
        same = sum(a == b for a, b in zip(tokens[name], tokens["no eviction"]))
        out["speed"].append({"setting": name, "median_s": t, "speedup": base / t, "same_tokens": same})
        rows.append([name, f"{16 * 64 / t:.1f}", f"{base / t:.2f}x", f"{same}/16"])
    out["speed_settings"] = settings
    print_table(["16 requests, 192 + 64 tokens", "tokens/s", "vs no eviction", "tokens equal"], rows)


def main(argv=None) -> int:
    args = parse_args(__doc__, {"--model": str(ROOT / "models" / "stdlib"), "--sequences": 64, "--repeats": 3,
                                "--parts": "perplexity,sinks,pareto,memory,speed"}, argv)
    if not (Path(args.model) / "tokens.pt").exists():
        return refuse(f"{args.model}: no trained model with its held-out tokens (run `make model` first)")
    parts = args.parts.split(",")
    seqs = held_out_sequences(args.model, args.sequences)
    out = {"model": args.model, "sequences": args.sequences, "context": CONTEXT, "perplexity": [], "pareto": [],
           "memory": [], "speed": []}
    start = time.perf_counter()
    if "perplexity" in parts:
        part_perplexity(args, seqs, out)
    if "sinks" in parts:
        part_sinks(args, seqs, out)
    if "pareto" in parts:
        part_pareto(args, seqs, out)
    if "memory" in parts:
        part_memory(args, out)
    if "speed" in parts:
        part_speed(args, seqs, out)
    write_json(ROOT / "outputs" / "bench_eviction.json", out)
    print(f"bench_eviction: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
