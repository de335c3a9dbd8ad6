"""Where one v2 forward spends its time: torch.profiler's operator table, rank 0.

    torchrun --nproc_per_node=2 benchmarks/profile_forward.py [--tokens 1024] [--variant v2]

Prints the top operators by self CPU time (a share of the whole, not absolute
times) and writes outputs/profile_forward.txt for docs/benchmarks.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import parse_args
from layers.models.config import ARTICLE03
from layers.models.dense import DenseStack, init_weights
from layers.models.tp_block import shard_stack
from tp.dist import init_from_env, shutdown


def main() -> int:
    args = parse_args(__doc__, {"--tokens": 1024, "--variant": "v2", "--out": "outputs/profile_forward.txt"})
    ctx = init_from_env("auto")
    stack = shard_stack(init_weights(DenseStack(ARTICLE03, torch.float32, ctx.device), 0), args.variant, ctx.group)
    x = torch.randn(args.tokens, ARTICLE03.d_model, generator=torch.Generator().manual_seed(0)).to(ctx.device)
    with torch.no_grad():
        stack(x)  # warm-up
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                stack(x)
    shutdown()
    if ctx.is_main:
        events = sorted((e for e in prof.key_averages() if e.self_cpu_time_total > 0),
                        key=lambda e: -e.self_cpu_time_total)
        total = sum(e.self_cpu_time_total for e in events)
        lines = [f"{args.variant}, article03, n_tokens={args.tokens}, p={ctx.world_size}, {ctx.backend}: "
                 f"self CPU time by operator, rank 0, 3 forwards", f"{'operator':<40} {'share':>7} {'calls':>6}"]
        lines += [f"{e.key[:40]:<40} {e.self_cpu_time_total / total:>7.1%} {e.count:>6}" for e in events[:12]]
        print("\n".join(lines))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
