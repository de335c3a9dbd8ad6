"""run_block's first job: each layer of a TP stack against the single-device stack, with CommDebugMode's counts."""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

from layers.tp_block import TPStack
from layers.varlen import Requests
from tp.dist import TPContext
from tp.ledger import collective_kind


def _errors(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return torch.stack([(out - ref).abs().max(), ref.abs().max()]).to(torch.float64)


def compare_layers(stack: TPStack, x: torch.Tensor, reference: tuple[torch.Tensor, ...], requests: Requests | None,
                   ctx: TPContext, tol: float) -> tuple[list[dict], list[dict]]:
    """Per layer: CommDebugMode's counts and the error against the reference (worst over ranks).
    Per request: the worst error over layers of its own rows, relative to its own reference."""
    layers, per_request = [], []
    spans = requests.spans if requests else [(0, x.shape[0])]
    with torch.no_grad():
        for i, block in enumerate(stack.blocks):
            with CommDebugMode() as comm:
                x = block(x, requests)
            counts = Counter()
            for op, count in comm.get_comm_counts().items():
                counts[collective_kind(op)] += count
            layers.append({"layer": i, "collective_counts": dict(counts), "err": _errors(x, reference[i])})
            per_request.append(torch.stack([_errors(x[s:e], reference[i][s:e]) for s, e in spans]))
    # Worst error over ranks, so that every rank reaches the same verdict.
    errs = torch.stack([layer.pop("err") for layer in layers]).to(ctx.device)
    req = torch.stack(per_request).to(ctx.device)  # [L, R, 2]
    dist.all_reduce(errs, op=dist.ReduceOp.MAX, group=ctx.group)
    dist.all_reduce(req, op=dist.ReduceOp.MAX, group=ctx.group)
    for layer, (abs_err, scale) in zip(layers, errs.tolist()):
        layer["max_abs_err"] = abs_err
        layer["max_rel_err"] = abs_err / scale if scale else abs_err
        layer["equivalent"] = layer["max_rel_err"] <= tol
    rel = req[..., 0] / req[..., 1].clamp_min(torch.finfo(torch.float64).tiny)  # [L, R]
    requests_out = []
    for r, (s, e) in enumerate(spans):
        worst = rel[:, r].max().item()
        requests_out.append({"request": r, "tokens": e - s, "max_abs_err": req[:, r, 0].max().item(),
                             "max_rel_err": worst, "equivalent": worst <= tol})
    return layers, requests_out
