"""The four autograd-aware collectives of the Megatron-LM paper.

Each is an identity, an all-reduce, an all-gather or a split in the forward
pass, and its adjoint in the backward pass:

    name                  forward                     backward
    copy_to_region        identity         ("f")      all-reduce
    reduce_from_region    all-reduce       ("g")      identity
    gather_from_region    all-gather, last dim        split, last dim
    scatter_to_region     split, last dim             all-gather, last dim

Sequence parallelism adds their row-wise counterparts, named as in Megatron-core:

    name                          forward                     backward
    scatter_rows_to_region        split, first dim            all-gather, first dim
    gather_rows_from_region       all-gather, first dim       split, first dim        (a replicated consumer)
    gather_rows_to_parallel       all-gather, first dim       reduce-scatter, first dim (a column-parallel consumer)
    reduce_scatter_rows           reduce-scatter, first dim   all-gather, first dim

On one rank every one of them is the identity and issues no collective.
The group is always passed in; nothing here reads a global process group.
`site` ("attn/all-reduce #1") names the call site for the traffic ledger
(tp/ledger.py), which records each collective when one is switched on.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from einops import rearrange

from tp.ledger import TrafficLedger, active

# torch >= 2.13 names the tensor all-gather `all_gather_single` (reduce-scatter: `reduce_scatter_single`); older
# releases `all_gather_into_tensor` (`reduce_scatter_tensor`).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _Where:
    """Who to tell about a collective: the ledger active when the forward ran, and its layer then."""

    __slots__ = ("ledger", "layer", "site")

    def __init__(self, site: str | None):
        self.ledger: TrafficLedger | None = active()
        self.layer = self.ledger.layer if self.ledger is not None else None
        self.site = site

    def run(self, fn, kind: str, phase: str, shape, dtype, group: dist.ProcessGroup, sent_bytes: float | None = None):
        """group: the collective's group, whose size sets the ring bytes (a pipeline stage's TP group is smaller than
        the world the engine's control messages go over)."""
        if self.ledger is None:
            return fn()
        extra = {} if sent_bytes is None else {"sent_bytes": sent_bytes}  # an all-to-all's bytes follow its splits
        return self.ledger.measure(fn, kind=kind, site=self.site, phase=phase, layer=self.layer,
                                   shape=tuple(shape), dtype=dtype, p=dist.get_world_size(group), **extra)


# ---- raw (non-autograd) operations on p > 1 ranks, each taking (x, group, where, phase); the splits send nothing ----


def _identity(x: torch.Tensor, group: dist.ProcessGroup, where: _Where, phase: str) -> torch.Tensor:
    return x


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup, where: _Where, phase: str) -> torch.Tensor:
    """Sum `x` over the group, into a copy: the same tensor may feed another branch (e.g. a residual add), so it is
    never reduced in place."""
    x = x.clone().contiguous()
    where.run(lambda: dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group), "all_reduce", phase, x.shape, x.dtype,
              group)
    return x


def _all_gather_last(x: torch.Tensor, group: dist.ProcessGroup, where: _Where, phase: str) -> torch.Tensor:
    """[..., c] on each rank -> [..., p*c], rank r's block at columns [r*c, (r+1)*c)."""
    p = dist.get_world_size(group)
    x = x.contiguous()
    out = x.new_empty((p * x.shape[0], *x.shape[1:]))  # ranks stacked on the first dim
    logical = (*x.shape[:-1], p * x.shape[-1])
    where.run(lambda: _all_gather_single(out, x, group=group), "all_gather", phase, logical, x.dtype, group)
    return rearrange(out, "(p n) ... c -> n ... (p c)", p=p)


def _split_last(x: torch.Tensor, group: dist.ProcessGroup, where: _Where, phase: str) -> torch.Tensor:
    """[..., p*c] -> this rank's [..., c]."""
    p = dist.get_world_size(group)
    if x.shape[-1] % p:
        raise ValueError(f"last dim {x.shape[-1]} is not divisible by {p} ranks")
    return x.chunk(p, dim=-1)[dist.get_rank(group)].contiguous()


def _all_gather_rows(x: torch.Tensor, group: dist.ProcessGroup, where: _Where, phase: str) -> torch.Tensor:
    """[n, ...] on each rank -> [p*n, ...], rank r's rows at [r*n, (r+1)*n)."""
    p = dist.get_world_size(group)
    x = x.contiguous()
    out = x.new_empty((p * x.shape[0], *x.shape[1:]))
    where.run(lambda: _all_gather_single(out, x, group=group), "all_gather", phase, out.shape, x.dtype, group)
    return out


def _reduce_scatter_rows(x: torch.Tensor, group: dist.ProcessGroup, where: _Where, phase: str) -> torch.Tensor:
    """[p*n, ...] partial sums on each rank -> this rank's rows [r*n, (r+1)*n) of the sum: [n, ...]."""
    p = dist.get_world_size(group)
    if x.shape[0] % p:
        raise ValueError(f"first dim {x.shape[0]} is not divisible by {p} ranks")
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // p, *x.shape[1:]))
    where.run(lambda: _reduce_scatter_single(out, x, op=dist.ReduceOp.SUM, group=group), "reduce_scatter", phase,
              x.shape, x.dtype, group)
    return out


def _split_rows(x: torch.Tensor, group: dist.ProcessGroup, where: _Where, phase: str) -> torch.Tensor:
    """[p*n, ...] -> this rank's [n, ...], a copy (not a view that keeps all p·n rows alive)."""
    p = dist.get_world_size(group)
    if x.shape[0] % p:
        raise ValueError(f"first dim {x.shape[0]} is not divisible by {p} ranks")
    return x.chunk(p, dim=0)[dist.get_rank(group)].clone()


# ---- autograd functions: a collective in the forward pass, its adjoint in the backward pass -----------------------


def _autograd(name: str, forward_op, backward_op) -> type[torch.autograd.Function]:
    """The autograd Function `name` (profiles show that name): forward runs forward_op on x, backward runs
    backward_op on the gradient, both recorded at the forward's call site; on one rank both are the identity."""

    def forward(ctx, x, group, site):
        ctx.group, ctx.where, ctx.one = group, _Where(site), dist.get_world_size(group) == 1
        return x if ctx.one else forward_op(x, group, ctx.where, "forward")

    def backward(ctx, grad):
        return (grad if ctx.one else backward_op(grad, ctx.group, ctx.where, "backward")), None, None

    methods = {"forward": staticmethod(forward), "backward": staticmethod(backward)}
    return type(name, (torch.autograd.Function,), methods)


# (name, forward, backward): the module docstring's tables
_CopyToRegion = _autograd("_CopyToRegion", _identity, _all_reduce)
_ReduceFromRegion = _autograd("_ReduceFromRegion", _all_reduce, _identity)
_GatherFromRegion = _autograd("_GatherFromRegion", _all_gather_last, _split_last)
_ScatterToRegion = _autograd("_ScatterToRegion", _split_last, _all_gather_last)
_ScatterRowsToRegion = _autograd("_ScatterRowsToRegion", _split_rows, _all_gather_rows)
_GatherRowsFromRegion = _autograd("_GatherRowsFromRegion", _all_gather_rows, _split_rows)  # a replicated consumer
_GatherRowsToParallel = _autograd("_GatherRowsToParallel", _all_gather_rows, _reduce_scatter_rows)  # column-parallel
_ReduceScatterRows = _autograd("_ReduceScatterRows", _reduce_scatter_rows, _all_gather_rows)


def scatter_rows_to_region(x: torch.Tensor, group: dist.ProcessGroup, site: str | None = None) -> torch.Tensor:
    """Enter a sequence-parallel region from a replicated [T, ...]: keep this rank's T/p rows; backward all-gather."""
    return _ScatterRowsToRegion.apply(x, group, site)


def gather_rows_from_region(x: torch.Tensor, group: dist.ProcessGroup, site: str | None = None) -> torch.Tensor:
    """Leave a sequence-parallel region to a replicated consumer: forward all-gather rows, backward split."""
    return _GatherRowsFromRegion.apply(x, group, site)


def gather_rows_to_parallel(x: torch.Tensor, group: dist.ProcessGroup, site: str | None = None) -> torch.Tensor:
    """Rows -> a column-parallel linear's full input: forward all-gather rows, backward reduce-scatter the partial
    input gradients (Megatron's gather_from_sequence_parallel_region with tensor_parallel_output_grad)."""
    return _GatherRowsToParallel.apply(x, group, site)


def reduce_scatter_rows(x: torch.Tensor, group: dist.ProcessGroup, site: str | None = None) -> torch.Tensor:
    """A row-parallel linear's partial [T, d] -> this rank's T/p rows of the sum: forward reduce-scatter, backward
    all-gather (Megatron's reduce_scatter_to_sequence_parallel_region)."""
    return _ReduceScatterRows.apply(x, group, site)


def copy_to_region(x: torch.Tensor, group: dist.ProcessGroup, site: str | None = None) -> torch.Tensor:
    """Enter a parallel region with a replicated input ("f"): forward identity, backward all-reduce."""
    if not torch.is_grad_enabled() or dist.get_world_size(group) == 1:  # no backward to prepare
        return x
    return _CopyToRegion.apply(x, group, site)


def reduce_from_region(x: torch.Tensor, group: dist.ProcessGroup, site: str | None = None) -> torch.Tensor:
    """Leave a parallel region by summing partial results ("g"): forward all-reduce, backward identity."""
    if dist.get_world_size(group) == 1:  # the identity, both ways
        return x
    if not torch.is_grad_enabled():  # inference: the raw all-reduce, no autograd node
        return _all_reduce(x, group, _Where(site), "forward")
    return _ReduceFromRegion.apply(x, group, site)


def gather_from_region(x: torch.Tensor, group: dist.ProcessGroup, site: str | None = None) -> torch.Tensor:
    """Leave a parallel region by concatenating column shards: forward all-gather, backward split."""
    if dist.get_world_size(group) == 1:
        return x
    if not torch.is_grad_enabled():
        return _all_gather_last(x, group, _Where(site), "forward")
    return _GatherFromRegion.apply(x, group, site)


def scatter_to_region(x: torch.Tensor, group: dist.ProcessGroup, site: str | None = None) -> torch.Tensor:
    """Enter a parallel region by keeping this rank's columns: forward split, backward all-gather."""
    if dist.get_world_size(group) == 1:
        return x
    return _ScatterToRegion.apply(x, group, site)


def all_reduce_values(x: torch.Tensor, group: dist.ProcessGroup, op: str = "sum", site: str | None = None
                      ) -> torch.Tensor:
    """★ all-reduce (op "sum" or "max") into a copy, outside autograd: per-row statistics whose backward is written
    by hand (train/loss.py's cross-entropy). The ledger records it as any all-reduce (a max moves the same bytes)."""
    if dist.get_world_size(group) == 1:
        return x
    x = x.detach().clone().contiguous()
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
    _Where(site).run(lambda: dist.all_reduce(x, op=reduce_op, group=group), "all_reduce", "forward", x.shape,
                     x.dtype, group)
    return x


def reduce_scatter_values(x: torch.Tensor, group: dist.ProcessGroup, site: str | None = None) -> torch.Tensor:
    """★ reduce-scatter (sum) of a flat [p·n] into this rank's [n] of the sum, outside autograd (the distributed
    optimizer's gradients: train/optimizer.py)."""
    if dist.get_world_size(group) == 1:
        return x.detach().clone()
    return _reduce_scatter_rows(x.detach(), group, _Where(site), "forward")


def all_gather_values(x: torch.Tensor, group: dist.ProcessGroup, site: str | None = None) -> torch.Tensor:
    """★ all-gather of every rank's flat [n] into [p·n], rank r's at [r·n, (r+1)·n), outside autograd (the
    distributed optimizer's updated parameters)."""
    if dist.get_world_size(group) == 1:
        return x.detach().clone()
    return _all_gather_rows(x.detach(), group, _Where(site), "forward")


def broadcast_from_main(x: torch.Tensor, group: dist.ProcessGroup, site: str | None = None) -> torch.Tensor:
    """★ broadcast from the group's first rank: every rank returns rank 0's x (the others pass a tensor of the same
    shape and dtype to receive into). Control traffic, not autograd: the serving engine's per-step message."""
    return broadcast_from(x, group, 0, site)


def broadcast_from(x: torch.Tensor, group: dist.ProcessGroup, src: int, site: str | None = None) -> torch.Tensor:
    """★ broadcast from the group's rank `src`: every rank returns that rank's x (the pipeline's last stage hands its
    tokens to every rank this way)."""
    if dist.get_world_size(group) == 1:
        return x
    x = x.contiguous()
    root = dist.get_global_rank(group, src)
    _Where(site).run(lambda: dist.broadcast(x, src=root, group=group), "broadcast", "forward", x.shape, x.dtype, group)
    return x


# ---- all-to-all (expert parallelism: forward only) ---------------------------------------------


def all_to_all_rows(x: torch.Tensor, send_counts: list[int], recv_counts: list[int], group: dist.ProcessGroup,
                    site: str | None = None) -> torch.Tensor:
    """★ all-to-all of rows: rank r sends x's next send_counts[j] rows to rank j and receives recv_counts[j] rows from
    each rank j, in rank order: [sum(recv_counts), ...]. The ledger counts the rows bound for other ranks (a rank's
    rows to itself do not leave it). Forward only: the MoE placements here serve and check, they do not train."""
    if dist.get_world_size(group) == 1:
        return x
    rank = dist.get_rank(group)
    out = x.new_empty((sum(recv_counts),) + tuple(x.shape[1:]))
    row_bytes = math.prod(x.shape[1:]) * x.element_size()

    def fn():
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=list(recv_counts),
                               input_split_sizes=list(send_counts), group=group)
        return out

    return _Where(site).run(fn, "all_to_all", "forward", x.shape, x.dtype, group,
                            sent_bytes=(sum(send_counts) - send_counts[rank]) * row_bytes)
