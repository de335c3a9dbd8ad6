"""The tensor-parallel stacks compute what the single-device stack computes, forward and backward."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from einops import rearrange

from layers.models.config import DTYPES, VARIANTS
from layers.models.tp_block import shard_stack
from tests.common import ARTICLE03, REL_TOL, SMALL, dense_and_input, rel_err
from tests.harness import run_ranks



def check_forward(ctx, variants, dtype_name, n):
    """Each variant's stack against the dense stack, from the same weights (built once per task): worst per-layer
    relative error of each variant. article03's 8 layers at p <= 2; its first 3 at p = 4, 8, where 4-8 ranks
    share two cores (every layer is cut alike; the 8-layer accumulation is checked at p = 1, 2)."""
    dtype = DTYPES[dtype_name]
    cfg = ARTICLE03 if ctx.world_size <= 2 else dataclasses.replace(ARTICLE03, n_layers=3)
    dense, x = dense_and_input(cfg, dtype, n)
    dense, x = dense.to(ctx.device), x.to(ctx.device)
    with torch.no_grad():
        ref = dense(x)
    worst = {}
    for variant in variants:
        stack = shard_stack(dense, variant, ctx.group)
        with torch.no_grad():
            out = stack(x)
        errs = [rel_err(o, r) for o, r in zip(out, ref)]
        assert len(out) == cfg.n_layers
        assert max(errs) <= REL_TOL[dtype], f"{variant}, rank {ctx.rank}: per-layer relative errors {errs}"
        worst[variant] = max(errs)
    return worst


FORWARD_CASES = [(p, "float64") for p in (1, 2, 4, 8)] + [(p, "float32") for p in (2, 8)]


@pytest.mark.nccl
@pytest.mark.parametrize("p,dtype_name", FORWARD_CASES)
def test_stack_forward_matches_dense(p, dtype_name):
    """v1, v2 and intra_head (every variant) at every p to 1e-12 in float64, and within float32's tolerance at the
    smallest and largest p > 1 (p = 1 communicates nothing: its float32 run is the dense stack's own rounding)."""
    worst = run_ranks(p, check_forward, VARIANTS, dtype_name, 24)
    assert set(worst[0]) == set(VARIANTS)
    if dtype_name == "float64":
        assert max(max(w.values()) for w in worst) < 1e-12


@pytest.mark.nccl
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
@pytest.mark.parametrize("p", [2, 8])
def test_half_precision_within_default_tolerance(p, dtype_name):
    # gloo reduces bfloat16 and float16 on the CPU; the default tolerance is about twice the error measured there
    worst = run_ranks(p, check_forward, ["v2"], dtype_name, 24)
    assert 0 < max(w["v2"] for w in worst) <= REL_TOL[DTYPES[dtype_name]]


# ---- backward -----------------------------------------------------------------------------------


def _all_gather(t: torch.Tensor, ctx) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(ctx.world_size)]
    dist.all_gather(parts, t.contiguous(), group=ctx.group)
    return parts


def full_grads(block, variant, ctx, cfg):
    """Rebuild dense-shaped gradients from every rank's shard gradients."""
    g = {}
    qkv_w, qkv_b = (torch.stack(_all_gather(t.grad, ctx)) for t in (block.qkv.weight, block.qkv.bias))
    if variant == "intra_head":  # rank r: dims r of every head
        g["qkv.weight"] = rearrange(qkv_w, "p (three h dh) i -> (three h p dh) i", three=3, h=cfg.n_heads)
        g["qkv.bias"] = rearrange(qkv_b, "p (three h dh) -> (three h p dh)", three=3, h=cfg.n_heads)
    else:  # rank r: heads r
        g["qkv.weight"] = rearrange(qkv_w, "p (three h dh) i -> (three p h dh) i", three=3, dh=cfg.d_head)
        g["qkv.bias"] = rearrange(qkv_b, "p (three h dh) -> (three p h dh)", three=3, dh=cfg.d_head)
    g["mlp_up.weight"] = torch.cat(_all_gather(block.mlp_up.weight.grad, ctx), dim=0)
    g["mlp_up.bias"] = torch.cat(_all_gather(block.mlp_up.bias.grad, ctx), dim=0)
    for name in ("attn_out", "mlp_down"):
        lin = getattr(block, name)
        if variant == "intra_head" and name == "attn_out":  # rows: dims r of every head
            parts = torch.stack(_all_gather(lin.weight.grad, ctx))
            g[f"{name}.weight"] = rearrange(parts, "p o (h dh) -> o (h p dh)", h=cfg.n_heads)
            g[f"{name}.bias"] = lin.bias.grad
        elif variant in ("v2", "intra_head"):  # row-parallel: input columns split, bias whole
            g[f"{name}.weight"] = torch.cat(_all_gather(lin.weight.grad, ctx), dim=1)
            g[f"{name}.bias"] = lin.bias.grad
        else:
            g[f"{name}.weight"] = torch.cat(_all_gather(lin.weight.grad, ctx), dim=0)
            g[f"{name}.bias"] = torch.cat(_all_gather(lin.bias.grad, ctx), dim=0)
    for name in ("ln_1", "ln_2"):  # replicated: each rank's gradient must already be complete
        for pname in ("weight", "bias"):
            g[f"{name}.{pname}"] = getattr(getattr(block, name), pname).grad
    return g


def check_backward(ctx, variant, dtype_name):
    dtype = DTYPES[dtype_name]
    cfg = SMALL
    dense, x = dense_and_input(cfg, dtype, 11)
    dense, x = dense.to(ctx.device), x.to(ctx.device)
    stack = shard_stack(dense, variant, ctx.group)
    # The same loss on every rank: a fixed random projection of every layer's output.
    gen = torch.Generator().manual_seed(7)
    weights = [torch.randn(11, cfg.d_model, generator=gen, dtype=torch.float64).to(ctx.device, dtype)
               for _ in range(cfg.n_layers)]
    x_dense, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    sum((o * w).sum() for o, w in zip(dense(x_dense), weights)).backward()
    sum((o * w).sum() for o, w in zip(stack(x_tp), weights)).backward()
    tol = {torch.float32: 1e-5, torch.float64: 1e-11}[dtype]
    assert rel_err(x_tp.grad, x_dense.grad) <= tol, "input gradient"
    worst = rel_err(x_tp.grad, x_dense.grad)
    for i, (blk, dblk) in enumerate(zip(stack.blocks, dense.blocks)):
        for name, grad in full_grads(blk, variant, ctx, cfg).items():
            ref = dblk.get_parameter(name).grad
            assert grad.shape == ref.shape, (i, name)
            err = rel_err(grad, ref)
            assert err <= tol, f"layer {i} {name}: relative error {err:.2e}"
            worst = max(worst, err)
    return worst


@pytest.mark.nccl
@pytest.mark.parametrize("dtype_name", ["float32", "float64"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("p", [1, 2, 4])
def test_backward_matches_dense(p, variant, dtype_name):
    run_ranks(p, check_backward, variant, dtype_name)


# ---- the head-aligned split is what makes it correct ---------------------------------------------


def check_misaligned(ctx):
    dense, x = dense_and_input(ARTICLE03, torch.float64, 16)
    stack = shard_stack(dense, "v2", ctx.group)
    with torch.no_grad():
        aligned = rel_err(stack(x)[-1], dense(x)[-1])
        p, r = ctx.world_size, ctx.rank
        for blk, dblk in zip(stack.blocks, dense.blocks):  # contiguous 1/p slice of the fused [Q|K|V] rows
            blk.qkv.weight.copy_(dblk.qkv.weight.chunk(p, dim=0)[r])
            blk.qkv.bias.copy_(dblk.qkv.bias.chunk(p, dim=0)[r])
        first = rel_err(stack.blocks[0](x), dense.blocks[0](x))
        last = rel_err(stack(x)[-1], dense(x)[-1])
    return aligned, first, last


@pytest.mark.parametrize("p", [2, 4])
def test_head_misaligned_split_gives_a_wrong_answer(p):
    aligned, first, last = run_ranks(p, check_misaligned)[0]
    assert aligned < 1e-12
    # Same weights, same shapes, same collectives: only the cut through [Q|K|V] moved. The error
    # is of the order of the signal, not of rounding.
    assert first > 1e-2 and last > 1e-2, (first, last)
