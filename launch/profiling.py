"""run_block's third job: one forward under torch.profiler, its trace parsed back and compared with the ledger."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist

from layers.models.tp_block import TPStack
from tp.dist import TPContext
from tp.ledger import TrafficLedger
from tp.trace import backend_witness, collectives_by_layer, layer_scopes


def profile_variant(stack: TPStack, x: torch.Tensor, cu_seqlens, variant: str, ctx: TPContext,
                    out_dir: Path) -> dict:
    """One forward under torch.profiler; the trace, parsed back, must list what the ledger saw."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if ctx.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    ledger = TrafficLedger(ctx.world_size, ctx.device)
    with torch.no_grad(), layer_scopes(stack), ledger.attach(stack), \
            torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        stack.output(stack(x, cu_seqlens), x.shape[0])
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{variant}-rank{ctx.rank}.json"
    prof.export_chrome_trace(str(path))
    # A trace records a gather's input and output dims, not which dim it concatenated (v1 gathers columns, v2sp
    # rows): layer by layer, in order, each collective's kind and element count. Outside any block: layer -1.
    parsed = {layer: [(kind, math.prod(shape)) for kind, shape in hits]
              for layer, hits in collectives_by_layer(path).items()}
    seen: dict[int, list] = {}
    for r in ledger.records:
        seen.setdefault(-1 if r.layer is None else r.layer, []).append((r.kind, math.prod(r.shape)))
    witness, per_op = backend_witness(path, len(ledger.records))
    agree = torch.tensor([float(parsed == seen and witness)], device=ctx.device)
    dist.all_reduce(agree, op=dist.ReduceOp.MIN, group=ctx.group)
    return {"trace": str(path), "trace_matches_ledger": bool(agree.item()),
            "collectives_in_trace": sum(len(v) for v in parsed.values()), "backend_events_per_collective": per_op}
