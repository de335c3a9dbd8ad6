import sys, time, torch
sys.path.insert(0, '.')
from tests.harness import run_ranks
from benchmarks.bench_serve import hf_workload, HF_CHUNK, HF_BUDGET
from layers.config import ARTICLE03
from layers.dense import init_weights
from layers.lm import DenseLM, shard_lm
from serve.engine import Engine
from serve.scheduler import Request

def go(ctx):
    torch.set_num_threads(1)
    lm = shard_lm(init_weights(DenseLM(ARTICLE03), seed=0), "v2", ctx.group)
    prompts, new = hf_workload()
    out = {}
    for mode in ("batched", "reference", "batched", "reference"):
        reqs = [Request(i, p, m, 0) for i, (p, m) in enumerate(zip(prompts, new))]
        res = Engine(lm, ctx, chunk_size=HF_CHUNK, max_batched_tokens=HF_BUDGET, attention=mode).run(reqs)
        out[mode] = (res.time_s, [round(it["time_s"], 3) for it in res.iterations[:4]])
    return out
if __name__ == "__main__":
    print(run_ranks(1, go)[0])
