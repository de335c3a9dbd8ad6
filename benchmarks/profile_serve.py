"""Where the engine spends its time on bench_serve's transformers workload, per attention backend: torch.profiler.

    torchrun --nproc_per_node=1 benchmarks/profile_serve.py [--attention cpu,batched,reference]

One run of the 32-request workload (benchmarks/bench_serve.py's `hf` part) at the engine's default settings per
backend, rank 0, profiled: the share of the run inside attention (the layers' paged_attention calls, a
record_function around each, inclusive), inside the matmuls (aten::mm and aten::addmm: the linears and the head),
and the rest (norms, GELU, embedding, sampling, the host's scheduling and input building). Shares, not times: the
profiler's cost per operation falls unevenly on backends with more operations, so the backends' speeds are compared
by bench_serve.py's hf part, unprofiled.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import layers.attention.attention as attention_module
from benchmarks.bench_serve import HF_BUDGET, HF_CHUNK, hf_workload
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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--attention", default="cpu,batched,reference")
    args = ap.parse_args()
    names = args.attention.split(",")
    if not set(names) <= set(BACKENDS):
        print(f"error: --attention {args.attention!r}: name backends among {', '.join(BACKENDS)}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    ctx = init_from_env()
    lm = shard_lm(init_weights(DenseLM(ARTICLE03), seed=0).to(ctx.device), "v2", ctx.group)
    prompts, new = hf_workload()
    requests = lambda: [Request(i, p, m, 0) for i, (p, m) in enumerate(zip(prompts, new))]  # noqa: E731
    inner = attention_module.paged_attention

    def labelled(q, kv, layer):
        with torch.profiler.record_function("paged_attention"):
            return inner(q, kv, layer)

    attention_module.paged_attention = labelled
    rows = []
    try:
        for name in names:
            engine = lambda: OfflineEngine(lm, ctx, EngineConfig(  # noqa: E731
                long_prefill_token_threshold=HF_CHUNK, max_num_batched_tokens=HF_BUDGET, attention=name))
            engine().run(requests()[:4])  # warm-up
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                with torch.profiler.record_function("run"):
                    engine().run(requests())
            events = prof.key_averages()
            total = next(e.cpu_time_total for e in events if e.key == "run")
            attention = sum(e.cpu_time_total for e in events if e.key == "paged_attention")
            matmul = sum(e.self_cpu_time_total for e in events if e.key in MATMULS)
            rows.append((name, attention / total, matmul / total))
    finally:
        attention_module.paged_attention = inner
        shutdown()
    if ctx.is_main:
        print(f"the engine on bench_serve's workload ({len(prompts)} requests, {sum(new)} new tokens), long_prefill_token_threshold "
              f"{HF_CHUNK}, max_num_batched_tokens {HF_BUDGET}, max_num_seqs {EngineConfig.max_num_seqs}, p={ctx.world_size}, profiled; shares of "
              f"the run")
        print(f"{'backend':<10} {'attention':>9} {'matmuls':>8} {'the rest':>9}")
        for name, att, mm in rows:
            print(f"{name:<10} {att:>9.0%} {mm:>8.0%} {1 - att - mm:>9.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
