"""Threads per rank: LLM's default against fixed OpenMP thread counts, on an idle machine and with one core busy.

    python benchmarks/bench_threads.py [--repeats 2] [--prompts 16] [--max-tokens 16]

Each measurement is a fresh process (RUN): `LLM("article03", tensor_parallel_size=tp)`, a warm-up, then generate()
timed; tokens/s = tokens / its wall time. Settings: the default (tp/dist.py threads_per_rank), and OMP_NUM_THREADS=1
and =2 set in the environment (what a user can set; 2 was the default at tp = 1 before). "One core busy": a Python
busy loop in another process for the whole measurement, as when a second job shares the laptop. The runs of one
(load, tp) alternate between the settings; each setting's median and its ratio to the best of its row are reported.
Prints a line per run as it goes; writes outputs/bench_threads.json and prints its section of docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import ROOT, in_turn, parse_args, table, write_json

RUN = r"""
import json, sys, time
from serve import LLM, SamplingParams
tp, count, new = (int(a) for a in sys.argv[1:4])
with LLM("article03", tensor_parallel_size=tp) as llm:
    prompts = [[(7 * i + j) % 1000 + 1 for j in range(8 + i)] for i in range(count)]
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    took = time.perf_counter() - start
    print(json.dumps({"tokens_per_s": count * new / took, "threads": llm.threads_per_rank, "why": llm.threads_why}))
"""

SETTINGS = {"default": {}, "OMP_NUM_THREADS=1": {"OMP_NUM_THREADS": "1"}, "OMP_NUM_THREADS=2": {"OMP_NUM_THREADS": "2"}}


def measure(tp: int, setting: str, count: int, new: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | SETTINGS[setting]
    r = subprocess.run([sys.executable, "-c", RUN, str(tp), str(count), str(new)], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
    if r.returncode:
        sys.exit(f"bench_threads: tp={tp} {setting} failed: {r.stderr.strip()[-600:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def section(rows: list[dict] | None) -> list[str]:
    """Its section of docs/benchmarks.md."""
    if not rows:
        return []
    lines = ["## Threads per rank", "",
             "`.venv/bin/python benchmarks/bench_threads.py`: `LLM(\"article03\")` (GPT-2 sizes, float32, random "
             "weights), 16 prompts x 16 new tokens, greedy, each run a fresh process; the default (tp/dist.py "
             "`threads_per_rank`: the cores this process may use, one left to the driver, shared among the ranks) "
             "against `OMP_NUM_THREADS=1` and `=2` (2: the old default at tp = 1), on the idle machine and with one "
             "core kept busy by another process. Medians of 2 runs per setting, alternated; x: behind the best of "
             "the row.", ""]
    lines += table(["load", "tp", "default: threads per rank", "default tokens/s", "OMP_NUM_THREADS=1",
                    "OMP_NUM_THREADS=2"],
                   [[r["load"], r["tp"], r["default_threads"]]
                    + [f"{r[f'{n} tokens_per_s']:.0f} ({r[f'{n} behind_best']:.2f}x)" for n in SETTINGS] for r in rows])
    worst = max(r["default behind_best"] for r in rows if r["load"] != "idle")
    idle = max(r["default behind_best"] for r in rows if r["load"] == "idle")
    cliff = max(r["OMP_NUM_THREADS=2 behind_best"] for r in rows if r["load"] != "idle")
    lines += ["", f"With a core busy the default is within {worst:.2f}x of the best setting (target 1.3x), where two "
              f"threads per rank fall {cliff:.0f}x behind: OpenMP's threads spin while they wait for each other, "
              f"and one of them shares its core with the other process. The price is on an idle machine at tp = 1, "
              f"where two threads are up to {idle:.2f}x faster: `threads_per_rank=2` (`--threads-per-rank 2`, or "
              f"`OMP_NUM_THREADS=2`) takes it on a machine nothing else uses. (The default and `OMP_NUM_THREADS=1` "
              f"are the same setting: their difference is this machine's noise.)", ""]
    return lines


def main() -> None:
    args = parse_args(__doc__, {"--repeats": 2, "--prompts": 16, "--max-tokens": 16})
    rows, began = [], time.perf_counter()

    def run(load: str, tp: int, name: str) -> dict:
        got = measure(tp, name, args.prompts, args.max_tokens)
        print(f"{load}, tp={tp}, {name}: {got['tokens_per_s']:.0f} tokens/s ({got['threads']} threads per rank: "
              f"{got['why']}; {time.perf_counter() - began:.0f} s so far)", file=sys.stderr, flush=True)
        return got

    for load in ("idle", "one core busy"):
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if load != "idle" else None
        try:
            for tp in (1, 2):
                runs = in_turn({name: partial(run, load, tp, name) for name in SETTINGS}, args.repeats)
                medians = {name: statistics.median(r["tokens_per_s"] for r in rs) for name, rs in runs.items()}
                best = max(medians.values())
                rows.append({"load": load, "tp": tp, "default_threads": runs["default"][0]["threads"],
                             "default_why": runs["default"][0]["why"],
                             **{f"{name} tokens_per_s": medians[name] for name in SETTINGS},
                             **{f"{name} behind_best": best / medians[name] for name in SETTINGS}})
        finally:
            if busy is not None:
                busy.kill()
    print(f"ran {time.perf_counter() - began:.0f} s", file=sys.stderr)
    write_json(ROOT / "outputs" / "bench_threads.json", rows)
    print("\n".join(section(rows)))


if __name__ == "__main__":
    main()
