"""The four autograd-aware collectives of the Megatron-LM paper.

Each is an identity, an all-reduce, an all-gather or a split in the forward
pass, and its adjoint in the backward pass:

    name                  forward                     backward
    copy_to_region        identity         ("f")      all-reduce
    reduce_from_region    all-reduce       ("g")      identity
    gather_from_region    all-gather, last dim        split, last dim
    scatter_to_region     split, last dim             all-gather, last dim

On one rank every one of them is the identity and issues no collective.
The group is always passed in; nothing here reads a global process group.
`site` ("attn/all-reduce #1") names the call site for the traffic ledger
(tp/ledger.py), which records each collective when one is switched on.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from einops import rearrange

from tp.ledger import TrafficLedger, active

# torch >= 2.13 names the tensor all-gather `all_gather_single`; older releases `all_gather_into_tensor`.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Where:
    """Who to tell about a collective: the ledger active when the forward ran, and its layer then."""

    __slots__ = ("ledger", "layer", "site")

    def __init__(self, site: str | None):
        self.ledger: TrafficLedger | None = active()
        self.layer = self.ledger.layer if self.ledger is not None else None
        self.site = site

    def run(self, fn, kind: str, phase: str, shape, dtype):
        if self.ledger is None:
            return fn()
        return self.ledger.measure(fn, kind=kind, site=self.site, phase=phase, layer=self.layer,
                                   shape=tuple(shape), dtype=dtype)


# ---- raw (non-autograd) operations -------------------------------------------------


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup, where: _Where, phase: str) -> torch.Tensor:
    """Sum `x` over the group, in place (x must be a fresh tensor the caller owns)."""
    if dist.get_world_size(group) == 1:
        return x
    x = x.contiguous()
    where.run(lambda: dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group), "all_reduce", phase, x.shape, x.dtype)
    return x


def _all_gather_last(x: torch.Tensor, group: dist.ProcessGroup, where: _Where, phase: str) -> torch.Tensor:
    """[..., c] on each rank -> [..., p*c], rank r's block at columns [r*c, (r+1)*c)."""
    p = dist.get_world_size(group)
    if p == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((p * x.shape[0], *x.shape[1:]))  # ranks stacked on the first dim
    logical = (*x.shape[:-1], p * x.shape[-1])
    where.run(lambda: _all_gather_single(out, x, group=group), "all_gather", phase, logical, x.dtype)
    return rearrange(out, "(p n) ... c -> n ... (p c)", p=p)


def _split_last(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[..., p*c] -> this rank's [..., c]. No communication."""
    p = dist.get_world_size(group)
    if p == 1:
        return x
    if x.shape[-1] % p:
        raise ValueError(f"last dim {x.shape[-1]} is not divisible by {p} ranks")
    return x.chunk(p, dim=-1)[dist.get_rank(group)].contiguous()


# ---- autograd functions --------------------------------------------------------------


class _CopyToRegion(torch.autograd.Function):
    """forward: identity; backward: all-reduce."""

    @staticmethod
    def forward(ctx, x, group, site):
        ctx.group, ctx.where = group, _Where(site)
        return x

    @staticmethod
    def backward(ctx, grad):
        # The same grad tensor may feed another branch (e.g. a residual add): never reduce it in place.
        return _all_reduce(grad.clone(), ctx.group, ctx.where, "backward"), None, None


class _ReduceFromRegion(torch.autograd.Function):
    """forward: all-reduce; backward: identity."""

    @staticmethod
    def forward(ctx, x, group, site):
        return _all_reduce(x.clone(), group, _Where(site), "forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _GatherFromRegion(torch.autograd.Function):
    """forward: all-gather on the last dim; backward: split on the last dim."""

    @staticmethod
    def forward(ctx, x, group, site):
        ctx.group = group
        return _all_gather_last(x, group, _Where(site), "forward")

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None, None


class _ScatterToRegion(torch.autograd.Function):
    """forward: split on the last dim; backward: all-gather on the last dim."""

    @staticmethod
    def forward(ctx, x, group, site):
        ctx.group, ctx.where = group, _Where(site)
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_last(grad, ctx.group, ctx.where, "backward"), None, None


def copy_to_region(x: torch.Tensor, group: dist.ProcessGroup, site: str | None = None) -> torch.Tensor:
    """Enter a parallel region with a replicated input ("f"): forward identity, backward all-reduce."""
    return _CopyToRegion.apply(x, group, site)


def reduce_from_region(x: torch.Tensor, group: dist.ProcessGroup, site: str | None = None) -> torch.Tensor:
    """Leave a parallel region by summing partial results ("g"): forward all-reduce, backward identity."""
    return _ReduceFromRegion.apply(x, group, site)


def gather_from_region(x: torch.Tensor, group: dist.ProcessGroup, site: str | None = None) -> torch.Tensor:
    """Leave a parallel region by concatenating column shards: forward all-gather, backward split."""
    return _GatherFromRegion.apply(x, group, site)


def scatter_to_region(x: torch.Tensor, group: dist.ProcessGroup, site: str | None = None) -> torch.Tensor:
    """Enter a parallel region by keeping this rank's columns: forward split, backward all-gather."""
    return _ScatterToRegion.apply(x, group, site)
