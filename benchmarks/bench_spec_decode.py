"""Speculative decoding on the trained model (`make model`: models/stdlib and its draft models/stdlib-draft):
tokens/s with and without it, the peer's on the same weights, where a step's time goes, and the bytes a verified row
moves.

    python benchmarks/bench_spec_decode.py [--model models/stdlib] [--draft models/stdlib-draft] [--repeats 3]
                                           [--max-tokens 64] [--batches 1 4 16]
                                           [--parts speed,peer,steps,coupling,bytes]

  workload  code editing: held-out standard-library functions (train/data.py's split: never trained on), each
            whole in the prompt, then its `def` line again, so the model rewrites it and its continuation repeats
            the function's names (what prompt lookup finds). Prompts of 60 to 140 tokens before the `def` line.
  speed     B = --batches requests at once through LLM at tensor_parallel_size 1, greedy and sampled (temperature
            0.8, a seed per request): plain decoding, twice (a second engine, "plain again": its speed-up is this
            machine's noise); n-gram (K = 4, prompt_lookup 1..3) and the trained draft
            (K = 4), each with the Tuner choosing k per step (adaptive, the default) and with k fixed at K; the
            draft's rejection sampler (k fixed) beside its default shared noise. generate()'s time, the runs of a
            row interleaved (the order reversed every other round), medians of --repeats; every engine warmed on
            the row first. Tokens checked equal to plain decoding's (every method but the rejection sampler keeps
            plain sampling's tokens, greedy and seeded). Acceptance: vLLM's counters over the timed runs, and per
            position (accepted at position j / drafts) for k fixed at K.
  peer      transformers' generate on the same checkpoints and prompts at B = 1, greedy (HF assisted generation
            takes one request at a time): plain, assistant_model=the draft, prompt_lookup_num_tokens=4; their
            speed-up against ours, and whether their tokens equal ours.
  steps     where a step's time goes at B = 1, greedy, in this process (one rank, the engine built as LLM's rank
            builds it): per step, the draft's forwards (its fill), the target's forward and pick (ModelRunner.run),
            and the rest (control, scheduling, the update, the host's input building); plain, n-gram and the draft
            at k = 1, 2, 4 fixed.
  coupling  the first proposal's acceptance under each rule from the same contexts (every position of the prompts,
            teacher forced through transformers' models): the rejection sampler's 1 - TV(p, q), the most any rule
            can accept, against shared noise's chance that both Gumbel races pick the same id (64 noise draws per
            position); temperature 0.8 and 1.0.
  bytes     per verified row per rank (predict_sampler, which the ledger equals in the tests): the greedy race's
            all-gather of (value, id) against all-gathering the float32 logits.

Prints a line per measurement as it goes and its run time (stderr); writes outputs/bench_spec_decode.json and prints
the tables (docs/spec_decode.md).
"""

from __future__ import annotations

import ast
import statistics
import sys
import time
from functools import partial
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import ROOT, in_turn, parse_args, print_table, refuse, write_json

K = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
TEMPERATURE = 0.8


def code_edit_prompts(model: str, n: int) -> tuple[list[list[int]], list[str]]:
    """n prompts: a held-out function whole, a blank line, its def line again (token ids of the model's tokenizer),
    and the functions' qualified names."""
    from tokenizers import Tokenizer

    from train.data import corpus_files, read, split

    tok = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    _, held = split(corpus_files("stdlib"), 0.05)
    prompts, names = [], []
    for path, text in zip(held, read(held)):
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines(keepends=True)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                src = "".join(lines[node.lineno - 1:node.end_lineno])
                if 60 <= len(tok.encode(src).ids) <= 140:
                    prompts.append(tok.encode(src + "\n" + lines[node.lineno - 1]).ids)
                    names.append(f"{path.stem}.{node.name}")
                    if len(prompts) == n:
                        return prompts, names
    return prompts, names


def engines(model: str, draft: str) -> dict:
    from serve import LLM

    drafted = {"method": "draft_model", "model": draft, "num_speculative_tokens": K}
    configs = {"plain": None, "plain again": None, "ngram": NGRAM, "ngram fixed": {**NGRAM, "adaptive": False},
               "draft": drafted, "draft fixed": {**drafted, "adaptive": False},
               "draft rejection": {**drafted, "adaptive": False, "draft_acceptance": "rejection_sampler"}}
    return {name: LLM(model, speculative_config=config) for name, config in configs.items()}


def counters(llm) -> dict:
    s = llm.stats()
    return {key: s.get(f"spec_decode_{key}") for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens",
                                                         "num_accepted_tokens_per_pos", "steps_by_num_proposals")}


def speed(model: str, draft: str, prompts: list[list[int]], batches: list[int], repeats: int, max_tokens: int,
          began: float) -> list[dict]:
    from benchmarks.common import timed_generate
    from serve import SamplingParams

    llms, rows = engines(model, draft), []
    try:
        for b in batches:
            for mode in ("greedy", "sampled"):
                params = [SamplingParams(temperature=0.0 if mode == "greedy" else TEMPERATURE, seed=i,
                                         max_tokens=max_tokens, ignore_eos=True) for i in range(b)]
                tokens, before = {}, {}

                def run(name: str) -> float:
                    tokens[name], took = timed_generate(llms[name], prompts[:b], params)
                    return took

                for name, llm in llms.items():  # warm: the Tuner measures this batch size first
                    run(name)
                    before[name] = counters(llm)
                times = in_turn({name: partial(run, name) for name in llms}, repeats)
                plain = statistics.median(times["plain"])
                for name, llm in llms.items():
                    took, after = statistics.median(times[name]), counters(llm)
                    row = {"B": b, "mode": mode, "method": name, "tokens_per_s": b * max_tokens / took,
                           "speedup": plain / took, "same_tokens": tokens[name] == tokens["plain"]}
                    if not name.startswith("plain"):
                        d = {key: after[key] - before[name][key] for key in ("num_drafts", "num_draft_tokens",
                                                                               "num_accepted_tokens")}
                        per_pos = [a - c for a, c in zip(after["num_accepted_tokens_per_pos"],
                                                         before[name]["num_accepted_tokens_per_pos"])]
                        row.update(d, acceptance_rate=d["num_accepted_tokens"] / d["num_draft_tokens"]
                                   if d["num_draft_tokens"] else None,
                                   mean_acceptance_length=1 + d["num_accepted_tokens"] / d["num_drafts"]
                                   if d["num_drafts"] else None,
                                   acceptance_per_position=[a / d["num_drafts"] for a in per_pos]
                                   if d["num_drafts"] else None)
                        if after["steps_by_num_proposals"] is not None:
                            row["steps_by_k"] = [a - c for a, c in zip(after["steps_by_num_proposals"],
                                                                       before[name]["steps_by_num_proposals"])]
                    if "spec_decode_acceptance_estimate" in llm.stats():
                        row["tuner"] = {key: llm.stats()[f"spec_decode_{key}"]
                                        for key in ("acceptance_estimate", "step_ms_per_request")}
                    rows.append(row)
                print(f"B={b} {mode}: " + ", ".join(f"{r['method']} {r['speedup']:.2f}x" for r in rows[-len(llms):])
                      + f" ({time.perf_counter() - began:.0f} s so far)", file=sys.stderr, flush=True)
    finally:
        for llm in llms.values():
            llm.shutdown()
    return rows


def peer(model: str, draft: str, prompts: list[list[int]], repeats: int, max_tokens: int, began: float) -> list[dict]:
    """transformers' generate at B = 1, greedy: plain, assisted by the draft, prompt lookup; and ours, in turn."""
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.common import timed_generate
    from serve import LLM, SamplingParams

    target = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    assistant = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
    for m in (target, assistant):  # as ignore_eos: the end-of-text id neither stops nor is masked (min_new_tokens
        m.generation_config.eos_token_id = None  # would mask it, and a request may pick it greedily)
    hf_ways = {"hf plain": {}, "hf assisted": {"assistant_model": assistant},
               "hf prompt lookup": {"prompt_lookup_num_tokens": K}}
    ours = {"plain": None, "ngram": NGRAM,
            "draft": {"method": "draft_model", "model": draft, "num_speculative_tokens": K}}
    llms = {name: LLM(model, speculative_config=config) for name, config in ours.items()}
    torch.set_num_threads(llms["plain"].threads_per_rank)  # as many threads as our rank has
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = {name: [] for name in [*hf_ways, *llms]}
    tokens: dict[str, dict] = {name: {} for name in out}  # each prompt's tokens (greedy: the same every run)

    def hf(name: str, i: int) -> float:
        prompt = prompts[i]
        ids = torch.tensor([prompt])
        start = time.perf_counter()
        with torch.no_grad():
            got = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                                  pad_token_id=0, **hf_ways[name])
        took = time.perf_counter() - start
        tokens[name][i] = got[0, len(prompt):].tolist()
        return took

    def ours_run(name: str, i: int) -> float:
        got, took = timed_generate(llms[name], [prompts[i]], params)
        tokens[name][i] = got[0]
        return took

    try:
        for i in range(len(prompts)):
            runs = {name: partial(hf if name in hf_ways else ours_run, name, i) for name in out}
            for run in runs.values():  # warm
                run()
            for name, times in in_turn(runs, repeats).items():
                out[name].append(statistics.median(times))
        print(f"peer: {len(prompts)} prompts ({time.perf_counter() - began:.0f} s so far)", file=sys.stderr,
              flush=True)
    finally:
        for llm in llms.values():
            llm.shutdown()
    total = {name: sum(times) for name, times in out.items()}
    rows = []
    for name in out:
        base = "hf plain" if name in hf_ways else "plain"
        rows.append({"engine": "transformers" if name in hf_ways else "tpref", "method": name.removeprefix("hf "),
                     "tokens_per_s": len(prompts) * max_tokens / total[name], "speedup": total[base] / total[name],
                     "same_tokens_as_ours": tokens[name] == tokens["plain"],
                     "requests_equal": sum(tokens[name][i] == tokens["plain"][i] for i in tokens["plain"])})
    return rows


def steps(model: str, draft: str, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """Per-step time at B = 1, greedy, split into the draft's forwards, the target's forward and pick, and the rest;
    an engine built in this process as LLM's rank builds it."""
    import os
    import tempfile

    import torch

    from serve.config import EngineConfig
    from serve.draft import DraftRunner
    from serve.llm import resolve_model
    from serve.model_runner import ModelRunner
    from serve.offline import drive
    from serve.sampling_params import SamplingParams
    from serve.worker import RankSpec, build_engine
    from tp.dist import init_from_env, shutdown

    torch.set_num_threads(1)
    os.environ.update(RANK="0", WORLD_SIZE="1")
    ctx = init_from_env("gloo", init_method=f"file://{tempfile.mkdtemp()}/store", device="cpu")
    cfg, checkpoint = resolve_model(model, 1, "tp")
    spent: dict[str, float] = {}

    def timed(cls, name: str, part: str):
        original = getattr(cls, name)

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent[part] = spent.get(part, 0.0) + time.perf_counter() - start
        setattr(cls, name, wrapper)
        return original

    kept = [(DraftRunner, "fill", timed(DraftRunner, "fill", "draft")),
            (ModelRunner, "run", timed(ModelRunner, "run", "target"))]
    drafted = {"method": "draft_model", "model": draft, "adaptive": False}
    configs = {"plain": None, "ngram k=4": {**NGRAM, "adaptive": False},
               **{f"draft k={k}": {**drafted, "num_speculative_tokens": k} for k in (1, 2, 4)}}
    params, rows = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), []
    try:
        for name, config in configs.items():
            spec = RankSpec(cfg, checkpoint, torch.float32, 0, "gloo", "cpu", EngineConfig(speculative_config=config),
                            draft=None if config is None or config["method"] != "draft_model"
                            else resolve_model(draft, 1, "tp"))
            engine = build_engine(ctx, spec)
            run = {"next": 0, "steps": 0, "start": 0.0, "end": 0.0}

            def feed(engine) -> bool:  # the prompts one at a time, twice: a warm pass, then the timed one
                if engine.has_unfinished_requests():
                    return True
                i = run["next"]
                if i == len(prompts):
                    spent.clear()
                    run["steps"], run["start"] = 0, time.perf_counter()
                if i == 2 * len(prompts):
                    run["end"] = time.perf_counter()
                    return False
                engine.add_request(f"{name}-{i}", prompts[i % len(prompts)], params)
                run["next"] += 1
                return True

            drive(engine, feed, lambda outputs: run.update(steps=run["steps"] + 1))
            count, total = run["steps"], run["end"] - run["start"]
            tokens = len(prompts) * max_tokens
            row = {"method": name, "steps": count, "step_ms": 1e3 * total / count,
                   "draft_ms": 1e3 * spent.get("draft", 0.0) / count, "target_ms": 1e3 * spent["target"] / count,
                   "tokens_per_step": tokens / count, "tokens_per_s": tokens / total}
            row["rest_ms"] = row["step_ms"] - row["draft_ms"] - row["target_ms"]
            rows.append(row)
    finally:
        for cls, name, original in kept:
            setattr(cls, name, original)
        shutdown()
    return rows


def coupling(model: str, draft: str, prompts: list[list[int]], draws: int = 64) -> list[dict]:
    """The first proposal's acceptance under each rule, from the same contexts (each prompt's positions, teacher
    forced through transformers' models): the rejection sampler accepts with probability sum_i min(p_i, q_i) =
    1 - TV(p, q), the most any coupling can; shared noise when the draft's and the target's Gumbel races over the same
    noise pick the same id (Monte Carlo, `draws` noise draws per position). Temperatures 0.8 and 1.0, no filter."""
    import torch
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    assistant = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
    gen, rows = torch.Generator().manual_seed(0), []
    with torch.no_grad():
        pairs = [(target(torch.tensor([ids])).logits[0].double(), assistant(torch.tensor([ids])).logits[0].double())
                 for ids in prompts]
    for T in (0.8, 1.0):
        rejection = shared = positions = 0.0
        for zt, zd in pairs:
            lp, lq = torch.log_softmax(zt / T, -1), torch.log_softmax(zd / T, -1)
            rejection += torch.minimum(lp.exp(), lq.exp()).sum().item()
            g = -torch.log(-torch.log(torch.rand(draws, *lp.shape, generator=gen, dtype=torch.float64)))
            shared += ((lp + g).argmax(-1) == (lq + g).argmax(-1)).double().mean(0).sum().item()
            positions += lp.shape[0]
        rows.append({"temperature": T, "positions": int(positions), "rejection_sampler": rejection / positions,
                     "shared_noise": shared / positions})
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


def fmt(v, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def main() -> int:
    args = parse_args(__doc__, {"--model": "models/stdlib", "--draft": "models/stdlib-draft", "--repeats": 3,
                                "--max-tokens": 64, "--batches": [1, 4, 16],
                                "--parts": "speed,peer,steps,coupling,bytes"})
    parts = args.parts.split(",")
    for path in (args.model, args.draft):
        if not (Path(path) / "config.json").is_file():
            return refuse(f"{path} is not a checkpoint: `make model` trains models/stdlib and its draft")
    began = time.perf_counter()
    prompts, names = code_edit_prompts(args.model, max(args.batches))
    result = {"model": args.model, "draft": args.draft, "k": K, "max_tokens": args.max_tokens,
              "temperature": TEMPERATURE, "prompts": names}
    if "bytes" in parts:
        result["bytes"] = row_bytes()
    if "steps" in parts:
        result["steps"] = steps(args.model, args.draft, prompts[:4], args.max_tokens)
    if "speed" in parts:
        result["speed"] = speed(args.model, args.draft, prompts, args.batches, args.repeats, args.max_tokens, began)
    if "coupling" in parts:
        result["coupling"] = coupling(args.model, args.draft, prompts)
    if "peer" in parts:
        result["peer"] = peer(args.model, args.draft, prompts[:4], args.repeats, args.max_tokens, began)
    print(f"ran {time.perf_counter() - began:.0f} s", file=sys.stderr)
    write_json(ROOT / "outputs" / "bench_spec_decode.json", result)
    if "bytes" in result:
        print_table(["vocab", "p", "race bytes per row per rank", "logits all-gather", "ratio"],
                    [[r["vocab"], r["p"], f"{r['race_bytes']:.0f}", f"{r['logits_bytes']:.0f}",
                      f"{r['ratio']:.0f}x"] for r in result["bytes"]])
    if "steps" in result:
        print_table(["method", "ms per step", "draft's forwards", "target's forward and pick", "the rest",
                     "tokens per step", "tokens/s"],
                    [[r["method"], f"{r['step_ms']:.2f}", f"{r['draft_ms']:.2f}", f"{r['target_ms']:.2f}",
                      f"{r['rest_ms']:.2f}", f"{r['tokens_per_step']:.2f}", f"{r['tokens_per_s']:.0f}"]
                     for r in result["steps"]])
    if "speed" in result:
        print_table(["B", "mode", "method", "tokens/s", "speed-up", "acceptance rate", "mean acceptance length",
                     "accepted per position", "steps by k", "same tokens"],
                    [[r["B"], r["mode"], r["method"], f"{r['tokens_per_s']:.0f}", f"{r['speedup']:.2f}x",
                      fmt(r.get("acceptance_rate")), fmt(r.get("mean_acceptance_length")),
                      "-" if r.get("acceptance_per_position") is None or "fixed" not in r["method"]
                      and "rejection" not in r["method"]
                      else " ".join(f"{a:.2f}" for a in r["acceptance_per_position"]),
                      " ".join(map(str, r.get("steps_by_k") or [])) or "-", r["same_tokens"]]
                     for r in result["speed"]])
    if "coupling" in result:
        print_table(["temperature", "positions", "first proposal accepted: rejection sampler", "shared noise"],
                    [[r["temperature"], r["positions"], f"{r['rejection_sampler']:.3f}", f"{r['shared_noise']:.3f}"]
                     for r in result["coupling"]])
    if "peer" in result:
        print_table(["engine", "method", "tokens/s", "speed-up", "tokens equal ours (requests)"],
                    [[r["engine"], r["method"], f"{r['tokens_per_s']:.0f}", f"{r['speedup']:.2f}x",
                      f"{r['requests_equal']} of {len(prompts[:4])}"] for r in result["peer"]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
