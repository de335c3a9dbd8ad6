"""What each rank holds: shapes per rank, and exactly which dense rows/columns end up where."""

import pytest
import torch

from layers.models.tp_block import shard_stack
from layers.parallel.shard import column_shard, qkv_head_aligned_shard, row_shard
from tests.common import SMALL, dense_and_input
from tests.harness import run_ranks


def expected_qkv_rows(n_heads: int, d_head: int, rank: int, p: int) -> list[int]:
    """Dense row indices of rank's heads in Q, then K, then V (written out, not sliced)."""
    k = n_heads * d_head
    heads = range(rank * n_heads // p, (rank + 1) * n_heads // p)
    return [part * k + h * d_head + j for part in range(3) for h in heads for j in range(d_head)]


@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_qkv_shard_takes_each_ranks_heads_of_q_k_and_v(p):
    n_heads, d_head, d = 8, 4, 3
    weight = torch.arange(3 * n_heads * d_head, dtype=torch.float64)[:, None].repeat(1, d)  # row i holds i
    bias = torch.arange(3 * n_heads * d_head, dtype=torch.float64)
    for rank in range(p):
        w, b = qkv_head_aligned_shard(weight, bias, n_heads, rank, p)
        rows = expected_qkv_rows(n_heads, d_head, rank, p)
        assert w.shape == (3 * n_heads * d_head // p, d)
        assert w[:, 0].long().tolist() == rows
        assert b.long().tolist() == rows


def test_qkv_shard_is_not_the_contiguous_slice():
    weight = torch.randn(3 * 8 * 4, 3)
    w, _ = qkv_head_aligned_shard(weight, None, 8, 0, 2)
    assert not torch.equal(w, weight.chunk(2, dim=0)[0])


def test_column_and_row_shards():
    weight = torch.arange(24.0).reshape(4, 6)  # nn.Linear [out=4, in=6]
    bias = torch.arange(4.0)
    w, b = column_shard(weight, bias, rank=1, p=2)
    assert torch.equal(w, weight[2:4]) and torch.equal(b, bias[2:4])
    w, b = row_shard(weight, bias, rank=2, p=3)
    assert torch.equal(w, weight[:, 4:6]) and torch.equal(b, bias)


def check_module_shards(ctx, variant):
    cfg, p, r = SMALL, ctx.world_size, ctx.rank
    dense, _ = dense_and_input(cfg, torch.float64, 1)
    stack = shard_stack(dense, variant, ctx.group)
    d, k, f = cfg.d_model, cfg.k, cfg.d_ffn
    expected = {  # nn.Linear weight shapes [out, in] held by one rank
        "v2": {"qkv": (3 * k // p, d), "attn_out": (d, k // p), "mlp_up": (f // p, d), "mlp_down": (d, f // p)},
        "v1": {"qkv": (3 * k // p, d), "attn_out": (d // p, k), "mlp_up": (f // p, d), "mlp_down": (d // p, f)},
    }[variant]
    for i, (blk, dblk) in enumerate(zip(stack.blocks, dense.blocks)):
        for name, shape in expected.items():
            assert tuple(getattr(blk, name).weight.shape) == shape, (i, name)
        rows = expected_qkv_rows(cfg.n_heads, cfg.d_head, r, p)
        assert torch.equal(blk.qkv.weight, dblk.qkv.weight[rows])
        assert torch.equal(blk.qkv.bias, dblk.qkv.bias[rows])
        f_cols = slice(r * f // p, (r + 1) * f // p)
        assert torch.equal(blk.mlp_up.weight, dblk.mlp_up.weight[f_cols])
        if variant == "v2":  # row-parallel: input columns, the whole bias
            assert torch.equal(blk.attn_out.weight, dblk.attn_out.weight[:, r * k // p:(r + 1) * k // p])
            assert torch.equal(blk.mlp_down.weight, dblk.mlp_down.weight[:, f_cols])
            assert torch.equal(blk.mlp_down.bias, dblk.mlp_down.bias)
        else:  # column-parallel: output rows and their bias
            d_rows = slice(r * d // p, (r + 1) * d // p)
            assert torch.equal(blk.attn_out.weight, dblk.attn_out.weight[d_rows])
            assert torch.equal(blk.mlp_down.bias, dblk.mlp_down.bias[d_rows])
    return [tuple(getattr(stack.blocks[0], n).weight.shape) for n in expected]


@pytest.mark.parametrize("variant", ["v1", "v2"])
@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_module_shards_per_rank(p, variant):
    shapes = run_ranks(p, check_module_shards, variant)
    assert len(set(map(tuple, shapes))) == 1  # every rank holds pieces of the same shape


def test_a_plan_must_cover_every_row_exactly_once():
    """load_plan refuses a plan that writes rows twice or leaves rows of torch.empty behind."""
    from layers.parallel.shard import DenseSource, Part, load_plan, rows

    module = torch.nn.Linear(2, 4, bias=False)  # weight [4, 2]
    dense = DenseSource({"w": torch.arange(8.0).reshape(4, 2)})
    load_plan(module, [Part("weight", "w", rows((0, 2))), Part("weight", "w", rows((2, 4)), row=2)], dense)
    assert torch.equal(module.weight.detach(), torch.arange(8.0).reshape(4, 2))
    with pytest.raises(ValueError, match="writes rows of weight twice"):
        load_plan(module, [Part("weight", "w", rows((0, 3))), Part("weight", "w", rows((2, 3)), row=2)], dense)
    with pytest.raises(ValueError, match="leaves 2 of 4 rows of weight unset"):
        load_plan(module, [Part("weight", "w", rows((0, 2)))], dense)
