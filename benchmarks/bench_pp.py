"""Pipeline bubbles: a forward-only GPipe schedule's idle time per stage against (pp − 1)/(m + pp − 1).

    torchrun --nproc_per_node=P benchmarks/bench_pp.py [--pp 2] [--rows 512] [--repeats 3]

The article03 stack, pp stages × tp = P/pp ranks (layers/models/pipeline.py); --rows rows split into m = 1, 2, 4, 8
micro-batches. The formula assumes equal stages and free messages; on a CPU the ranks share cores (two stages
computing at once each run slower), so read the measured column beside it, not as a check. Writes
outputs/bench_pp_pp{pp}.json and prints its section of docs/benchmarks.md (section(), which says how the bubble is
measured).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from benchmarks.common import parse_args, refuse, table, write_json
from layers.models.config import ARTICLE03
from layers.models.dense import DenseStack, init_weights
from layers.models.pipeline import check_layout, new_pp_groups, shard_stage
from tp.dist import env_world, init_from_env, shutdown

MICROBATCHES = (1, 2, 4, 8)


def main() -> int:
    args = parse_args(__doc__, {"--pp": 2, "--rows": 512, "--repeats": 3})
    torch.set_num_threads(1)
    try:  # before joining the group: every rank refuses on its own
        layout = check_layout(env_world()[2], args.pp, ARTICLE03.n_layers, "v2")
        if args.rows % max(MICROBATCHES) or args.repeats < 1:
            raise ValueError(f"--rows {args.rows} must split into {max(MICROBATCHES)} micro-batches; --repeats >= 1")
    except ValueError as exc:
        return refuse(str(exc))
    ctx = init_from_env()
    stages = new_pp_groups(layout)
    rank = dist.get_rank()
    dense = init_weights(DenseStack(ARTICLE03), seed=0)
    stage = shard_stage(dense, "v2", layout, rank, stages[layout.stage_of(rank)])
    x = torch.randn(args.rows, ARTICLE03.d_model, generator=torch.Generator().manual_seed(1))
    rows_out = []
    with torch.no_grad():
        stage.run([x[:8]] if stage.first else None, [8])  # warm-up
        for m in MICROBATCHES:
            n = args.rows // m
            runs = []
            for _ in range(args.repeats):
                dist.barrier()
                _, timeline = stage.run(list(x.split(n)) if stage.first else None, [n] * m)
                span = [None] * ctx.world_size
                dist.all_gather_object(span, timeline)
                runs.append(span)
            if ctx.is_main:
                per_stage = []
                for s in range(layout.pp):
                    lines = [run[layout.rank(s, 0)] for run in runs]
                    ends = [max(t["end_s"] for t in run[layout.rank(layout.pp - 1, 0)]["microbatches"]) for run in runs]
                    busy = [sum(t["end_s"] - t["begin_s"] for t in line["microbatches"]) for line in lines]
                    per_stage.append(statistics.median(1 - b / e for b, e in zip(busy, ends)))
                rows_out.append({"microbatches": m, "rows_per_microbatch": n, "bubble_per_stage": per_stage,
                                 "bubble": statistics.mean(per_stage),
                                 "formula": (layout.pp - 1) / (m + layout.pp - 1)})
    shutdown()
    if ctx.is_main:
        out = {"pp": layout.pp, "tp": layout.tp, "rows": args.rows, "repeats": args.repeats, "results": rows_out}
        print("\n".join(section([out])))
        write_json(f"outputs/bench_pp_pp{layout.pp}.json", out)
    return 0


def section(runs: list[dict]) -> list[str]:
    """docs/benchmarks.md's pipeline section from outputs/bench_pp_pp*.json (benchmarks/report.py)."""
    if not runs:
        return []
    first = runs[0]
    lines = ["## Pipeline stages: the GPipe bubble", "",
             "`.venv/bin/torchrun --nproc_per_node=P benchmarks/bench_pp.py --pp P`: the article03 stack (L=8), "
             f"float32, v2, pp stages × tp = {first['tp']}, {first['rows']} rows split into m equal micro-batches, "
             "a forward-only "
             "GPipe schedule (layers/models/pipeline.py); per stage, busy = its micro-batches' compute (sends and "
             "waits are idle), bubble = 1 − busy / the schedule's span; the mean over stages, median of "
             f"{first['repeats']} runs.", ""]
    lines += table(["pp", "m", "rows per micro-batch", "bubble measured", "(pp − 1)/(m + pp − 1)", "per stage"],
                   [[run["pp"], r["microbatches"], r["rows_per_microbatch"], f"{r['bubble']:.3f}",
                     f"{r['formula']:.3f}", " ".join(f"{b:.3f}" for b in r["bubble_per_stage"])]
                    for run in runs for r in run["results"]])
    return lines + ["", "The formula takes messages to be free and overlapping stages to run at full speed; here each "
                        "boundary message is a gloo send between processes and the ranks share the machine's cores, "
                        "so with more, smaller micro-batches the measured bubble rises above it.", ""]


if __name__ == "__main__":
    sys.exit(main())
