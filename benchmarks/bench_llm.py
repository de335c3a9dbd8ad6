"""The library path against the torchrun path: the same requests, the same engine settings, the same tokens.

    python benchmarks/bench_llm.py [--p 1 2] [--repeats 2]

The article03 GPT-2 LM (random weights, float32, greedy), 32 prompts with lognormal lengths (drawn by launch/serve.py's
own rule) and 16 new tokens each, all at once, engine SETTINGS (LLM's defaults, block_size 16):

  torchrun   `torchrun --nproc_per_node=P launch/serve.py prompts=[[...]] ... check=false`: its report.json's
             tokens/s (the serving loop's time) and output ids; start-up = the command's wall time less the loop's
  LLM        start-up = LLM(...) until the first token of a one-token warm-up request; tokens/s of the first
             generate() (cold, as the torchrun run is) and the median of the next two (warm)

Each repeat runs both, one after the other; the ratio is taken within a repeat (the machine is noisy), and the
median over repeats reported. Writes outputs/bench_llm.json (docs/library.md).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import ROOT, parse_args, timed_generate, write_json

SETTINGS = dict(long_prefill_token_threshold=256, max_num_batched_tokens=512, max_num_seqs=16, block_size=16)
COUNT, MEAN, NEW = 32, 32, 16


def prompts() -> list[list[int]]:
    from omegaconf import OmegaConf

    from launch.serve_settings import parse_requests
    from layers.models.config import ARTICLE03

    cfg = OmegaConf.create({"prompts": None, "prompt_count": COUNT, "prompt_mean": MEAN, "prompt_dist": "lognormal",
                            "max_new_tokens": NEW, "arrivals": 0})
    return [r.prompt for r in parse_requests(cfg, ARTICLE03, seed=0)]


def torchrun(p: int, ids: list[list[int]]) -> dict:
    with tempfile.TemporaryDirectory() as out:
        overrides = [f"prompts=[{','.join('[' + ','.join(map(str, x)) + ']' for x in ids)}]",
                     f"max_new_tokens={NEW}", "arrivals=0", "check=false", f"hydra.run.dir={out}"] + \
                    [f"{k}={v}" for k, v in SETTINGS.items()]
        start = time.perf_counter()
        subprocess.run([str(Path(sys.executable).parent / "torchrun"), "--standalone", f"--nproc_per_node={p}",
                        str(ROOT / "launch/serve.py"), *overrides], check=True, cwd=ROOT, capture_output=True)
        wall = time.perf_counter() - start
        report = json.loads((Path(out) / "report.json").read_text())
    t = report["totals"]
    return {"tokens_per_s": t["tokens_per_s"], "startup_s": wall - t["time_s"],
            "ids": [r["output_ids"] for r in report["requests"]],
            "ledger_matches_model": report["ledger_matches_model"]}


def library(p: int, ids: list[list[int]]) -> dict:
    from serve import LLM, SamplingParams

    start = time.perf_counter()
    with LLM("article03", tensor_parallel_size=p, **SETTINGS) as llm:
        llm.generate([[1]], SamplingParams(temperature=0.0, max_tokens=1))
        startup = time.perf_counter() - start
        rates = []
        for _ in range(3):  # the first run is cold (as the torchrun run is), the next two warm
            got, took = timed_generate(llm, ids, SamplingParams(temperature=0.0, max_tokens=NEW))
            rates.append(sum(map(len, got)) / took)
        ledger = llm.stats()["last_iteration"]["ledger_matches_model"]
    return {"tokens_per_s": rates[0], "warm_tokens_per_s": statistics.median(rates[1:]), "startup_s": startup,
            "ids": got, "ledger_matches_model": ledger}


def main() -> None:
    args = parse_args(__doc__, {"--p": [1, 2], "--repeats": 2, "--out": str(ROOT / "outputs/bench_llm.json")})
    ids = prompts()
    rows = []
    for p in args.p:
        runs = []
        for _ in range(args.repeats):
            a, b = torchrun(p, ids), library(p, ids)
            runs.append({"torchrun": a, "llm": b, "same_tokens": a["ids"] == b["ids"],
                         "throughput_ratio": b["tokens_per_s"] / a["tokens_per_s"],
                         "warm_ratio": b["warm_tokens_per_s"] / a["tokens_per_s"]})
        row = {"p": p, "same_tokens": all(r["same_tokens"] for r in runs),
               "ledger_matches_model": all(r[k]["ledger_matches_model"] for r in runs for k in ("torchrun", "llm")),
               "throughput_ratio_llm_over_torchrun": statistics.median(r["throughput_ratio"] for r in runs),
               "warm_ratio_llm_over_torchrun": statistics.median(r["warm_ratio"] for r in runs),
               "tokens_per_s": {k: statistics.median(r[k]["tokens_per_s"] for r in runs) for k in ("torchrun", "llm")},
               "startup_s": {k: statistics.median(r[k]["startup_s"] for r in runs) for k in ("torchrun", "llm")}}
        rows.append(row)
        print(f"p={p}: same tokens {row['same_tokens']}, ledger = model {row['ledger_matches_model']}, "
              f"LLM/torchrun tokens/s {row['throughput_ratio_llm_over_torchrun']:.3f} "
              f"({row['tokens_per_s']['llm']:.0f} vs {row['tokens_per_s']['torchrun']:.0f}), warm LLM/torchrun "
              f"{row['warm_ratio_llm_over_torchrun']:.3f}, start-up "
              f"{row['startup_s']['llm']:.1f} s (LLM) vs {row['startup_s']['torchrun']:.1f} s (torchrun)", flush=True)
    write_json(args.out, {"workload": {"model": "article03", "prompts": COUNT, "prompt_mean": MEAN,
                                       "max_new_tokens": NEW, **SETTINGS}, "rows": rows})


if __name__ == "__main__":
    main()
