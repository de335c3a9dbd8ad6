"""Column- and row-parallel linear layers (Megatron-LM vocabulary).

With Y = X·A and A of shape [in × out] split over p ranks:

  ColumnParallelLinear        A = [A_0 | A_1 | ... ]      rank r holds A_r: [in × out/p]
    full X in -> Y_r = X·A_r: [n × out/p] out             merge = concatenate (all-gather)

  RowParallelLinear           A = [A_0 ; A_1 ; ... ]      rank r holds A_r: [in/p × out]
    X_r: [n × in/p] in -> X_r·A_r: [n × out] partial sum  merge = sum (all-reduce)

A column-parallel output is exactly a row-parallel input: column -> row needs
no communication in between. (nn.Linear stores Aᵀ, so `weight` is [out/p, in]
for a column shard and [out, in/p] for a row shard.)

Megatron's versions also take gather_output= and input_is_parallel=; here the
block does any gather itself, on a line of its forward marked ★, so that every
collective of a block can be counted by reading one function (layers/models/tp_block.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from layers.parallel.shard import per_rank
from layers.parallel.weight_format import linear
from tp.comm import copy_to_region, reduce_from_region


class _ShardedLinear(nn.Module):
    """A linear layer's slice: weight [out', in'] and bias [bias_features] (uninitialised; load a shard into it)."""

    fused = False  # decode's compiled kernels may run its product (layers/parallel/weight_format.prepare sets it)
    tile_rows = None  # batch_invariant: its product in tiles of this many rows (weight_format.prepare sets it)

    def __init__(self, weight_shape: tuple[int, int], bias_features: int, group: dist.ProcessGroup,
                 bias: bool, site: str | None, dtype, device):
        super().__init__()
        self.group = group
        self.site = site  # names this layer's collectives in the traffic ledger
        self.weight = nn.Parameter(torch.empty(weight_shape, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(bias_features, dtype=dtype, device=device)) if bias else None
        # weight-only int8 (layers/parallel/weight_format.py): `weight` then holds the codes, these their scales [out']
        self.register_buffer("scales", None)


class ColumnParallelLinear(_ShardedLinear):
    """Y = X·A + b with A's output columns split over ranks.

    forward: copy_to_region(X) (backward all-reduces dX) -> X·A_r + b_r: [n, out/p]
    """

    def __init__(self, in_features: int, out_features: int, group: dist.ProcessGroup, *,
                 bias: bool = True, site: str | None = None, dtype=None, device=None):
        local_out = per_rank(out_features, dist.get_world_size(group), "out_features")
        super().__init__((local_out, in_features), local_out, group, bias, site, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_region(x, self.group, self.site)
        return linear(x, self.weight, self.scales, self.bias, self.fused, self.tile_rows)  # [n, out/p]


class RowParallelLinear(_ShardedLinear):
    """Y = X·A + b with A's input rows split over ranks.

    forward: X_r (a column-parallel output) -> X_r·A_r: [n, out] partial sum
             -> all-reduce -> + b, added once after the reduction (not p times).
    """

    def __init__(self, in_features: int, out_features: int, group: dist.ProcessGroup, *,
                 bias: bool = True, site: str | None = None, dtype=None, device=None):
        local_in = per_rank(in_features, dist.get_world_size(group), "in_features")
        super().__init__((out_features, local_in), out_features, group, bias, site, dtype, device)  # bias: whole

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [n, in/p]
        partial = linear(x, self.weight, self.scales, fused=self.fused, tile=self.tile_rows)  # [n, out] (int8: own scales)
        y = reduce_from_region(partial, self.group, self.site)  # all-reduce: [n, out], identical on every rank
        return y if self.bias is None else y + self.bias
