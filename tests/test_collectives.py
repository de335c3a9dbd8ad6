"""The four Megatron collectives: forward values and backward gradients on 1, 2 and 4 ranks.

Each rank draws its own tensors from a seed that includes its rank, so every
rank can rebuild every other rank's tensors and compute the expected result
itself, without communication.
"""

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode

from tests.harness import run_ranks
from tp.comm import copy_to_region, gather_from_region, reduce_from_region, scatter_to_region

N, C = 3, 5


def _draw(seed: int, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _counts(mode: CommDebugMode) -> int:
    return sum(mode.get_comm_counts().values())


def _check(op, x, want, upstream, want_grad, forward_comms: int, backward_comms: int, tol: float = 0.0):
    """y = op(x): the collectives issued forward and backward, y, and the gradient reaching x."""
    with CommDebugMode() as fwd:
        y = op(x)
    assert _counts(fwd) == forward_comms
    torch.testing.assert_close(y, want, rtol=tol, atol=tol)
    with CommDebugMode() as bwd:
        y.backward(upstream)
    assert _counts(bwd) == backward_comms
    torch.testing.assert_close(x.grad, want_grad, rtol=tol, atol=tol)


def check_copy_to_region(ctx):
    p, r = ctx.world_size, ctx.rank
    x = _draw(100, N, C).requires_grad_()
    upstream = [_draw(200 + q, N, C) for q in range(p)]
    _check(lambda t: copy_to_region(t, ctx.group), x, x, upstream[r], sum(upstream), 0, 1 if p > 1 else 0, 1e-14)


def check_copy_to_region_leaves_shared_grad_alone(ctx):
    # y = x + copy(x): the residual branch and the copy branch get the same grad tensor.
    p, r = ctx.world_size, ctx.rank
    x = _draw(100, N, C).requires_grad_()
    g = [_draw(300 + q, N, C) for q in range(p)]
    (x + copy_to_region(x, ctx.group)).backward(g[r])
    torch.testing.assert_close(x.grad, g[r] + sum(g), rtol=1e-14, atol=1e-14)


def check_reduce_from_region(ctx):
    p, r = ctx.world_size, ctx.rank
    xs = [_draw(400 + q, N, C) for q in range(p)]
    x, upstream = xs[r].clone().requires_grad_(), _draw(500 + r, N, C)
    _check(lambda t: reduce_from_region(t, ctx.group), x, sum(xs), upstream, upstream, 1 if p > 1 else 0, 0, 1e-14)
    torch.testing.assert_close(x.detach(), xs[r], rtol=0, atol=0)  # input left untouched


def check_gather_from_region(ctx):
    p, r = ctx.world_size, ctx.rank
    xs = [_draw(600 + q, N, C) for q in range(p)]
    x, upstream = xs[r].clone().requires_grad_(), _draw(700 + r, N, p * C)
    _check(lambda t: gather_from_region(t, ctx.group), x, torch.cat(xs, dim=-1), upstream,
           upstream[:, r * C:(r + 1) * C], 1 if p > 1 else 0, 0)


def check_scatter_to_region(ctx):
    p, r = ctx.world_size, ctx.rank
    full = _draw(800, N, p * C).requires_grad_()
    upstream = [_draw(900 + q, N, C) for q in range(p)]
    _check(lambda t: scatter_to_region(t, ctx.group), full, full.detach()[:, r * C:(r + 1) * C], upstream[r],
           torch.cat(upstream, dim=-1), 0, 1 if p > 1 else 0)


def check_gather_3d(ctx):
    # Leading dims other than tokens (e.g. [heads, n, c]) keep their order.
    p, r = ctx.world_size, ctx.rank
    xs = [_draw(1000 + q, 2, N, C) for q in range(p)]
    torch.testing.assert_close(gather_from_region(xs[r], ctx.group), torch.cat(xs, dim=-1), rtol=0, atol=0)


CHECKS = [check_copy_to_region, check_copy_to_region_leaves_shared_grad_alone, check_reduce_from_region,
          check_gather_from_region, check_scatter_to_region, check_gather_3d]


@pytest.mark.parametrize("p", [1, 2, 4])
@pytest.mark.parametrize("check", CHECKS, ids=lambda f: f.__name__.removeprefix("check_"))
def test_collective(p, check):
    run_ranks(p, check)


def _rank(ctx):
    return ctx.rank


def _fails_on_rank_1(ctx):
    if ctx.rank == 1:
        raise ValueError("boom on rank 1")
    return ctx.rank


def test_harness_reports_the_failing_rank():
    with pytest.raises(AssertionError, match=r"rank 1 failed:[\s\S]*boom on rank 1"):
        run_ranks(2, _fails_on_rank_1)
    assert run_ranks(2, _rank) == [0, 1]  # a fresh pool replaces the torn-down one


def describe_existing_group(ctx):
    from tp.dist import group_device, init_from_env

    again = init_from_env("nccl")  # a group exists: describe it, do not resolve (or refuse) the request
    return again.backend, str(again.device), str(group_device(ctx.group)), again.world_size


def test_init_from_env_reports_an_existing_group():
    from tests.harness import default_backend

    for backend, device, group_dev, p in run_ranks(2, describe_existing_group):
        assert (backend, p) == (default_backend(), 2)  # the harness's gloo group, not the "nccl" asked for
        assert device == group_dev and (backend != "gloo" or device == "cpu")
