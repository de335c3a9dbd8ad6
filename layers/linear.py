"""Column- and row-parallel linear layers (Megatron-LM vocabulary).

With Y = X·A and A of shape [in × out] split over p ranks:

  ColumnParallelLinear        A = [A_0 | A_1 | ... ]      rank r holds A_r: [in × out/p]
    full X in -> Y_r = X·A_r: [n × out/p] out             merge = concatenate (all-gather)

  RowParallelLinear           A = [A_0 ; A_1 ; ... ]      rank r holds A_r: [in/p × out]
    X_r: [n × in/p] in -> X_r·A_r: [n × out] partial sum  merge = sum (all-reduce)

A column-parallel output is exactly a row-parallel input: column -> row needs
no communication in between. (nn.Linear stores Aᵀ, so `weight` is [out/p, in]
for a column shard and [out, in/p] for a row shard.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from layers.shard import per_rank
from tp.comm import copy_to_region, gather_from_region, reduce_from_region, scatter_to_region


class ColumnParallelLinear(nn.Module):
    """Y = X·A + b with A's output columns split over ranks.

    forward: copy_to_region(X) (backward all-reduces dX) -> X·A_r + b_r: [n, out/p]
             -> all-gather to [n, out] only when gather_output=True.
    """

    def __init__(self, in_features: int, out_features: int, group: dist.ProcessGroup, *,
                 bias: bool = True, gather_output: bool = False, site: str | None = None, dtype=None, device=None):
        super().__init__()
        self.group = group
        self.gather_output = gather_output
        self.site = site  # names this layer's collectives in the traffic ledger
        local_out = per_rank(out_features, dist.get_world_size(group), "out_features")
        self.weight = nn.Parameter(torch.empty(local_out, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(local_out, dtype=dtype, device=device)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_region(x, self.group, self.site)
        y = F.linear(x, self.weight, self.bias)  # [n, out/p]
        if self.gather_output:
            y = gather_from_region(y, self.group, self.site)  # [n, out]
        return y


class RowParallelLinear(nn.Module):
    """Y = X·A + b with A's input rows split over ranks.

    forward: (split X to X_r unless input_is_parallel) -> X_r·A_r: [n, out] partial sum
             -> all-reduce -> + b, added once after the reduction (not p times).
    """

    def __init__(self, in_features: int, out_features: int, group: dist.ProcessGroup, *,
                 bias: bool = True, input_is_parallel: bool = True, site: str | None = None, dtype=None, device=None):
        super().__init__()
        self.group = group
        self.input_is_parallel = input_is_parallel
        self.site = site  # names this layer's collectives in the traffic ledger
        local_in = per_rank(in_features, dist.get_world_size(group), "in_features")
        self.weight = nn.Parameter(torch.empty(out_features, local_in, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_region(x, self.group, self.site)  # [n, in/p]
        partial = F.linear(x, self.weight)  # [n, out], this rank's share of the sum
        y = reduce_from_region(partial, self.group, self.site)  # all-reduce: [n, out], identical on every rank
        return y if self.bias is None else y + self.bias
