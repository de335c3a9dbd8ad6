"""The serving iterations on CUDA, every synchronizing call caught by CUDA's sync debugger (make gpu-check runs it).

    torchrun --nproc_per_node=P launch/sync_check.py      (P ranks on NCCL, one GPU each; P = 1 works too)

The iterations whose host waits tests/test_device_path.py counts on the CPU (decodes, prompt chunks, prefix hits,
preemption; GPT-2, Llama, Mixtral with tp and ep) run on GPUs under torch.cuda.set_sync_debug_mode("warn") after a
warm-up, each step's warnings counted against the waits the engine means: one per step, plus one per MoE layer
(docs/gpus.md). Exit 1 if any step differs; without CUDA it says so and exits 0.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from layers.models.config import ModelConfig  # noqa: E402
from layers.models.dense import init_weights  # noqa: E402
from layers.models.llama import LlamaConfig  # noqa: E402
from layers.models.lm import dense_lm, shard_lm  # noqa: E402
from layers.models.moe import MoEConfig  # noqa: E402
from serve.config import EngineConfig  # noqa: E402
from serve.hooks import StepHook  # noqa: E402
from serve.engine import LLMEngine  # noqa: E402
from serve.offline import drive  # noqa: E402
from serve.sampling_params import SamplingParams  # noqa: E402
from tp.dist import init_from_env, shutdown  # noqa: E402

V = 1001
MODELS = {
    "gpt2": (ModelConfig(d_model=64, n_heads=8, d_head=8, d_ffn=256, n_layers=3, max_seq_len=96, vocab_size=V), "tp"),
    "llama": (LlamaConfig(d_model=64, n_heads=8, n_kv_heads=2, d_head=8, d_ffn=96, n_layers=2, max_seq_len=96,
                          vocab_size=V), "tp"),
    "mixtral tp": (MoEConfig(d_model=64, n_heads=8, n_kv_heads=2, d_head=8, d_ffn=48, n_layers=2, max_seq_len=64,
                             vocab_size=V, n_experts=8, top_k=2), "tp"),
}
MODELS["mixtral ep"] = (MODELS["mixtral tp"][0], "ep")


class Syncs(StepHook):
    """Each step's synchronizing calls, as CUDA's sync debugger reports them (warnings recorded since the last)."""

    def __init__(self, caught: list):
        self.caught, self.steps = caught, []

    def after_step(self, engine, step):
        kind = "idle" if step.plan is None else "+".join(sorted(
            {"decode" if c.decode else "prefill" for c in step.plan.scheduled}
            | ({"preempt"} if step.plan.preempted else set())))
        syncs = [w for w in self.caught if "synchronizing" in str(w.message)]
        self.steps.append((kind, len(syncs)))
        self.caught.clear()


def arrivals_feed(prompts: list[list[int]], arrivals: dict[int, int], max_tokens: int = 8):
    """drive()'s feed for rank 0: arrivals[i] of the prompts, in order, before loop turn i (greedy, max_tokens each,
    eos ignored); a step is due while a request is unfinished or a prompt is still to come."""
    turn, added = [0], [0]

    def feed(engine: LLMEngine) -> bool:
        for _ in range(arrivals.get(turn[0], 0)):
            engine.add_request(str(added[0]), prompts[added[0]],
                               SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
            added[0] += 1
        turn[0] += 1
        return engine.has_unfinished_requests() or added[0] < len(prompts)

    return feed


def run(ctx, name: str, record: bool) -> list[tuple[str, int]]:
    cfg, placement = MODELS[name]
    dense = init_weights(dense_lm(cfg, torch.float32), seed=0)
    lm = shard_lm(dense.to(ctx.device), "v2", ctx.group, moe_parallel=placement)
    hook = Syncs([])
    engine = LLMEngine(lm, ctx, EngineConfig(long_prefill_token_threshold=8, max_num_batched_tokens=16, max_num_seqs=4,
                                             block_size=4, num_gpu_blocks_override=12, check_ledger=False),
                       hooks=[hook])
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(0, V, (12,), generator=gen).tolist()
    prompts = [shared + torch.randint(0, V, (3 + 2 * n,), generator=gen).tolist() for n in range(5)]
    with warnings.catch_warnings(record=True) as log:
        warnings.simplefilter("always")
        hook.caught = log  # the hook reads and clears each step's warnings
        if record:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            drive(engine, arrivals_feed(prompts, {0: 2, 3: 1, 6: 2}))
        finally:
            if record:
                torch.cuda.set_sync_debug_mode("default")
    return hook.steps


def main() -> int:
    if not torch.cuda.is_available():
        print("sync_check: no CUDA device visible; skipping (run it on a GPU node)")
        return 0
    ctx = init_from_env()
    bad = 0
    try:
        for name, (cfg, _) in MODELS.items():
            run(ctx, name, record=False)  # warm-up: allocator, kernels, communicators
            steps = run(ctx, name, record=True)
            want = 1 + (cfg.n_layers if name.startswith("mixtral") else 0)
            wrong = [(k, n) for k, n in steps if n != (0 if k == "idle" else want)]
            bad += bool(wrong)
            if ctx.is_main:
                kinds = sorted({k for k, _ in steps})
                print(f"{name}: {len(steps)} steps ({', '.join(kinds)}), {want} wait(s) per step expected: "
                      f"{'PASS' if not wrong else f'FAIL {wrong[:5]}'}")
    finally:
        del ctx  # the last reference to the group, so shutdown() ends its threads (tp.dist.shutdown)
        left = shutdown()
    if left:
        print(f"sync_check: the process group's threads outlived shutdown ({', '.join(left)})", file=sys.stderr)
    return 1 if bad or left else 0


if __name__ == "__main__":
    sys.exit(main())
