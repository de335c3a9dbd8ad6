"""Where the engine spends its time on bench_serve's transformers workload, per attention backend: torch.profiler.

    torchrun --nproc_per_node=1 benchmarks/profile_serve.py [--attention cpu,batched,reference]

One profiled run of bench_serve.py's `hf` workload at the engine's default settings per backend, rank 0: the share of
the run inside attention (the layers' paged_attention calls, inclusive), inside the matmuls (the linears and the
head) and the rest (norms, GELU, embedding, sampling, the host's scheduling and input building). Shares, not times:
the profiler's cost falls unevenly on backends with more operations, so bench_serve.py's hf part compares speeds.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.bench_serve import HF_BUDGET, HF_CHUNK, hf_workload
from benchmarks.common import attention_labelled, parse_args, print_table, refuse
from layers.attention.backends import BACKENDS
from layers.models.config import ARTICLE03
from layers.models.dense import init_weights
from layers.models.lm import DenseLM, shard_lm
from serve.config import EngineConfig
from serve.offline import OfflineEngine
from serve.request import Request
from tp.dist import init_from_env, shutdown

MATMULS = ("aten::mm", "aten::addmm")


def main() -> int:
    args = parse_args(__doc__, {"--attention": "cpu,batched,reference"})
    names = args.attention.split(",")
    if not set(names) <= set(BACKENDS):
        return refuse(f"--attention {args.attention!r}: name backends among {', '.join(BACKENDS)}")
    torch.set_num_threads(1)
    ctx = init_from_env()
    lm = shard_lm(init_weights(DenseLM(ARTICLE03), seed=0).to(ctx.device), "v2", ctx.group)
    prompts, new = hf_workload()
    requests = lambda: [Request(i, p, m, 0) for i, (p, m) in enumerate(zip(prompts, new))]  # noqa: E731
    rows = []
    try:
        with attention_labelled():
            for name in names:
                config = EngineConfig(long_prefill_token_threshold=HF_CHUNK, max_num_batched_tokens=HF_BUDGET,
                                      attention=name)
                OfflineEngine(lm, ctx, config).run(requests()[:4])  # warm-up
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    with torch.profiler.record_function("run"):
                        OfflineEngine(lm, ctx, config).run(requests())
                events = prof.key_averages()
                total = next(e.cpu_time_total for e in events if e.key == "run")
                attention = sum(e.cpu_time_total for e in events if e.key == "paged_attention")
                matmul = sum(e.self_cpu_time_total for e in events if e.key in MATMULS)
                rows.append([name, f"{attention / total:.0%}", f"{matmul / total:.0%}",
                             f"{1 - (attention + matmul) / total:.0%}"])
    finally:
        shutdown()
    if ctx.is_main:
        print(f"the engine on bench_serve's workload ({len(prompts)} requests, {sum(new)} new tokens), "
              f"long_prefill_token_threshold {HF_CHUNK}, max_num_batched_tokens {HF_BUDGET}, max_num_seqs "
              f"{EngineConfig.max_num_seqs}, p={ctx.world_size}, profiled; shares of the run")
        print_table(["backend", "attention", "matmuls", "the rest"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
