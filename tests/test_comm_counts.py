"""Exact collective counts per layer, counted by PyTorch's CommDebugMode (an independent counter).

v2: 2 all-reduces per block forward; v1: 4 all-gathers. Backward follows from the
conjugates: every column-parallel input is a copy_to_region whose backward is an
all-reduce (v2: qkv, mlp_up -> 2; v1: all four linears -> 4); gathers split and
row-parallel reductions pass gradients through without communicating.
None of it depends on the number of tokens; one rank communicates nothing.
"""

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode

from layers.models.tp_block import shard_stack
from tests.common import SMALL, collective_counts, dense_and_input
from tests.harness import run_ranks

EXPECTED = {
    "v2": {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 2}},
    "v1": {"forward": {"all_gather": 4}, "backward": {"all_reduce": 4}},
}


def count_per_layer(ctx, variant, n):
    dense, x = dense_and_input(SMALL, torch.float32, n)
    stack = shard_stack(dense, variant, ctx.group)
    x.requires_grad_()
    with CommDebugMode() as comm:
        out = stack(x)
        out[-1].sum().backward()
    per_module = comm.comm_module_counts
    layers = []
    for i in range(SMALL.n_layers):
        counts = per_module.get(f"TPStack.blocks.{i}", {"forward": {}, "backward": {}})
        layers.append({phase: collective_counts(counts[phase]) for phase in ("forward", "backward")})
    total = {phase: collective_counts(per_module["Global"][phase]) for phase in ("forward", "backward")}
    return layers, total


@pytest.mark.parametrize("variant", ["v1", "v2"])
@pytest.mark.parametrize("p", [2, 4, 8])
def test_counts_per_layer(p, variant):
    by_n = {}
    for n in (1, 13, 40):
        layers, total = run_ranks(p, count_per_layer, variant, n)[0]
        assert layers == [EXPECTED[variant]] * SMALL.n_layers, f"n={n}: {layers}"
        # Nothing communicates outside the blocks.
        assert total == {ph: {k: c * SMALL.n_layers for k, c in EXPECTED[variant][ph].items()}
                         for ph in ("forward", "backward")}
        by_n[n] = layers
    assert by_n[1] == by_n[13] == by_n[40]  # independent of the number of tokens


@pytest.mark.parametrize("variant", ["v1", "v2"])
def test_one_rank_communicates_nothing(variant):
    layers, total = run_ranks(1, count_per_layer, variant, 5)[0]
    assert total == {"forward": {}, "backward": {}}
