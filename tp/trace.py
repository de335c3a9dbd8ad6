"""Profiler traces: per-layer scopes while profiling, and a parser that reads collectives back out.

    with layer_scopes(stack), torch.profiler.profile(record_shapes=True) as prof:
        stack(x)
    prof.export_chrome_trace("trace.json")        # opens in Perfetto / chrome://tracing
    collectives_by_layer("trace.json")            # {layer: [("all_reduce", (40, 512)), ...]}

The parser reads what the profiler itself recorded, not the traffic ledger: the
`c10d::*` operator events (present for gloo and NCCL, with `Input Dims` when
shapes are recorded), placed in a layer by the `layer <i>` scope enclosing them
in time. The backend's own events (`gloo:*` on gloo, `record_param_comms` on
NCCL) are counted beside them as a second witness.

Only CPU-side events count: with CUDA activity recorded, the profiler also copies each
`layer <i>` annotation onto the GPU timeline (category `gpu_user_annotation`) and adds
kernels for the collectives; counting those would place or count a collective twice.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import torch
from torch.autograd.profiler import record_function

_LAYER = re.compile(r"^layer (\d+)$")


@contextlib.contextmanager
def layer_scopes(stack: torch.nn.Module):
    """A `layer <i>` record_function scope around each block's forward."""
    open_scopes: list = []

    def enter(i):
        def hook(module, args):
            scope = record_function(f"layer {i}")
            scope.__enter__()
            open_scopes.append(scope)
        return hook

    def leave(module, args, output):
        open_scopes.pop().__exit__(None, None, None)

    handles = []
    for i, block in enumerate(stack.blocks):
        handles += [block.register_forward_pre_hook(enter(i)), block.register_forward_hook(leave)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _c10d_collective(name: str, dims) -> tuple[str, tuple[int, ...]] | None:
    """(kind, logical shape) of a c10d operator event, or None if it is not one we issue."""
    if name == "c10d::allreduce_":
        return "all_reduce", tuple(dims[0][0])  # TensorList of one tensor, reduced in place
    if name in ("c10d::_allgather_base_", "c10d::allgather_into_tensor_coalesced_"):
        out, inp = dims[0], dims[1]  # out [p·n, ...], in [n, ..., c] -> logical [n, ..., p·c]
        p = out[0] // inp[0]
        return "all_gather", (*inp[:-1], p * inp[-1])
    if name == "c10d::_reduce_scatter_base_":  # out [n/p, ...], in [n, ...] -> logical: the input, reduced
        return "reduce_scatter", tuple(dims[1])
    return None


def _cpu_events(trace: str | Path) -> list[dict]:
    """Complete events recorded on the host: operators and user annotations, not GPU copies or kernels."""
    return [e for e in json.loads(Path(trace).read_text())["traceEvents"]
            if e.get("ph") == "X" and e.get("cat", "cpu_op") in ("cpu_op", "user_annotation")]


def collectives_by_layer(trace: str | Path) -> dict[int, list[tuple[str, tuple[int, ...]]]]:
    events = _cpu_events(trace)
    layers = []
    for e in events:
        m = _LAYER.match(e.get("name", ""))
        if m and e.get("cat", "user_annotation") == "user_annotation":
            layers.append((float(e["ts"]), float(e["ts"]) + float(e["dur"]), int(m.group(1))))
    found: dict[int, list[tuple[str, tuple[int, ...]]]] = {}
    for e in sorted(events, key=lambda e: float(e["ts"])):
        hit = _c10d_collective(e.get("name", ""), e.get("args", {}).get("Input Dims"))
        if hit is None:
            continue
        ts = float(e["ts"])
        inside = [i for start, end, i in layers if start <= ts <= end]
        found.setdefault(inside[0] if inside else -1, []).append(hit)
    return found


def backend_events(trace: str | Path) -> int:
    """How many host-side collective events the backend itself logged (gloo:* or NCCL's record_param_comms).

    One per collective on gloo here; NCCL may log more than one per op, so callers check for a
    whole multiple of the collectives they issued (see `backend_witness`), not equality."""
    return sum(1 for e in _cpu_events(trace)
               if e.get("name", "").startswith("gloo:") or e.get("name") == "record_param_comms")


def backend_witness(trace: str | Path, n_collectives: int) -> tuple[bool, float]:
    """(agrees, events per collective): the backend logged a positive whole number of events per collective."""
    n = backend_events(trace)
    if n_collectives == 0:
        return n == 0, 0.0
    return n > 0 and n % n_collectives == 0, n / n_collectives
