"""run_block's first job: each layer of a TP stack against the single-device stack, with CommDebugMode's counts."""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

from layers.attention.varlen import Requests
from layers.models.tp_block import TPStack
from tp.dist import TPContext
from tp.ledger import collective_kind


def _errors(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """[max |out - ref|, max |ref|] (zeros for no rows)."""
    if ref.numel() == 0:
        return torch.zeros(2, dtype=torch.float64, device=ref.device)
    return torch.stack([(out - ref).abs().max(), ref.abs().max()]).to(torch.float64)


def compare_layers(stack: TPStack, x: torch.Tensor, reference: tuple[torch.Tensor, ...], requests: Requests | None,
                   ctx: TPContext, tol: float) -> tuple[list[dict], list[dict]]:
    """Per layer: CommDebugMode's counts and the error against the reference (worst over ranks).
    Per request: the worst error over layers of its own rows, relative to its own reference."""
    layers, per_request = [], []
    n = x.shape[0]
    spans = requests.spans if requests else [(0, n)]
    lo, hi = stack.rows_held(n)  # v2sp: each layer's output is this rank's rows [lo, hi); else all of them
    with torch.no_grad():
        x = stack.enter(x)
        for i, block in enumerate(stack.blocks):
            with CommDebugMode() as comm:
                x = stack.layer(block, x, requests, n)
            counts = Counter()
            for op, count in comm.get_comm_counts().items():
                counts[collective_kind(op)] += count
            mine, ref = x[:hi - lo], reference[i][lo:hi]
            layers.append({"layer": i, "collective_counts": dict(counts), "err": _errors(mine, ref)})
            # each request's rows that this rank holds (none: zeros, the other ranks' maxima win)
            per_request.append(torch.stack([_errors(mine[max(s, lo) - lo:max(min(e, hi), lo) - lo],
                                                    ref[max(s, lo) - lo:max(min(e, hi), lo) - lo])
                                            for s, e in spans]))
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
