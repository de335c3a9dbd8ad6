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
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from einops import rearrange


# ---- raw (non-autograd) operations -------------------------------------------------

# torch >= 2.13 names the tensor all-gather `all_gather_single`; older releases `all_gather_into_tensor`.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum `x` over the group, in place on a contiguous copy when needed."""
    if dist.get_world_size(group) == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def _all_gather_last(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[..., c] on each rank -> [..., p*c], rank r's block at columns [r*c, (r+1)*c)."""
    p = dist.get_world_size(group)
    if p == 1:
        return x
    out = x.new_empty((p * x.shape[0], *x.shape[1:]))  # ranks stacked on the first dim
    _all_gather_single(out, x.contiguous(), group=group)
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
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        # The same grad tensor may feed another branch (e.g. a residual add): never reduce it in place.
        return _all_reduce(grad.clone(), ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """forward: all-reduce; backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromRegion(torch.autograd.Function):
    """forward: all-gather on the last dim; backward: split on the last dim."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


class _ScatterToRegion(torch.autograd.Function):
    """forward: split on the last dim; backward: all-gather on the last dim."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_last(grad, ctx.group), None


def copy_to_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Enter a parallel region with a replicated input ("f"): forward identity, backward all-reduce."""
    return _CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Leave a parallel region by summing partial results ("g"): forward all-reduce, backward identity."""
    return _ReduceFromRegion.apply(x, group)


def gather_from_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Leave a parallel region by concatenating column shards: forward all-gather, backward split."""
    return _GatherFromRegion.apply(x, group)


def scatter_to_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Enter a parallel region by keeping this rank's columns: forward split, backward all-gather."""
    return _ScatterToRegion.apply(x, group)
