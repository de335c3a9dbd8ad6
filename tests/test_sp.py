"""v2sp (sequence parallelism) against the dense stack, forward and backward, and its traffic against the
model: GPT-2 and Llama blocks, one sequence and varlen requests, T divisible by p and not."""

from collections import Counter

import pytest
import torch
import torch.distributed as dist

from layers.models.config import ModelConfig
from layers.models.llama import LlamaConfig, kv_heads_of_rank
from layers.models.tp_block import shard_stack
from tests.common import SMALL, dense_and_input, rel_err
from tests.harness import run_ranks
from tests.test_equivalence import full_grads
from tp.cost_model import tp_sp_elems_per_gpu
from tp.ledger import TrafficLedger
from tp.traffic_model import predict, predict_sp_stack

GPT2_6 = ModelConfig(d_model=48, n_heads=6, d_head=8, d_ffn=96, n_layers=2)  # 6 heads: p = 3 splits them
LLAMA = LlamaConfig(d_model=64, n_heads=8, n_kv_heads=2, d_head=8, d_ffn=96, n_layers=2, norm_eps=1e-6)
LLAMA_6 = LlamaConfig(d_model=48, n_heads=6, n_kv_heads=3, d_head=8, d_ffn=96, n_layers=2, norm_eps=1e-6)
CONFIGS = {"gpt2": SMALL, "gpt2_6": GPT2_6, "llama": LLAMA, "llama_6": LLAMA_6}


def _gather(t: torch.Tensor, ctx) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(ctx.world_size)]
    dist.all_gather(parts, t.contiguous(), group=ctx.group)
    return parts


def llama_grads(block, ctx, cfg) -> dict[str, torch.Tensor]:
    """Dense-shaped gradients of a TP Llama block: every rank's query heads placed, its K,V heads added (a head
    replicated on p/h_kv ranks gets the sum of its replicas' partial gradients), columns and rows concatenated."""
    p, dh, f = ctx.world_size, cfg.d_head, cfg.d_ffn // ctx.world_size
    q_heads, kv_heads = cfg.n_heads // p, len(kv_heads_of_rank(cfg, 0, p))
    g = {name: torch.zeros(shape, dtype=block.qkv.weight.dtype) for name, shape in
         (("q.weight", (cfg.k, cfg.d_model)), ("k.weight", (cfg.k_kv, cfg.d_model)), ("v.weight", (cfg.k_kv, cfg.d_model)))}
    for r, grad in enumerate(_gather(block.qkv.weight.grad, ctx)):
        q, k, v = grad.split([q_heads * dh, kv_heads * dh, kv_heads * dh])
        g["q.weight"][r * q_heads * dh:(r + 1) * q_heads * dh] += q
        heads = kv_heads_of_rank(cfg, r, p)
        g["k.weight"][heads.start * dh:heads.stop * dh] += k
        g["v.weight"][heads.start * dh:heads.stop * dh] += v
    g["o.weight"] = torch.cat(_gather(block.o.weight.grad, ctx), dim=1)
    gate_up = [t.split(f) for t in _gather(block.gate_up.weight.grad, ctx)]
    g["gate_up.weight"] = torch.cat([gu[0] for gu in gate_up] + [gu[1] for gu in gate_up])
    g["down.weight"] = torch.cat(_gather(block.down.weight.grad, ctx), dim=1)
    g["attn_norm.weight"], g["mlp_norm.weight"] = block.attn_norm.weight.grad, block.mlp_norm.weight.grad
    return g


def check_sp(ctx, cfg_name, lengths, drop_param_all_reduce=False):
    """v2sp's per-layer rows, gathered output, input gradient and every parameter gradient against the dense stack
    (float64). Returns the worst relative error of each, and of the replicated parameters' gradients alone."""
    cfg = CONFIGS[cfg_name]
    n = sum(lengths)
    dense, x = dense_and_input(cfg, torch.float64, n)
    cu = None if len(lengths) == 1 else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    if drop_param_all_reduce:  # the counterfactual: the norms' (and row biases') gradients left partial
        import layers.models.llama
        import layers.models.tp_block

        for module in (layers.models.llama, layers.models.tp_block):
            module.copy_to_region, module._real_copy = (lambda t, g, site=None: t), module.copy_to_region
    try:
        stack = shard_stack(dense, "v2sp", ctx.group)
        gen = torch.Generator().manual_seed(7)
        weights = [torch.randn(n, cfg.d_model, generator=gen, dtype=torch.float64) for _ in range(cfg.n_layers)]
        x_dense, x_sp = x.clone().requires_grad_(), x.clone().requires_grad_()
        ref = dense(x_dense, cu)
        sum((o * w).sum() for o, w in zip(ref, weights)).backward()
        outs = stack(x_sp, cu)
        lo, hi = stack.rows_held(n)
        # each rank's loss covers its own real rows; the sum over ranks is the dense loss
        sum((o[:hi - lo] * w[lo:hi]).sum() for o, w in zip(outs, weights)).backward()
    finally:
        if drop_param_all_reduce:
            for module in (layers.models.llama, layers.models.tp_block):
                module.copy_to_region = module._real_copy
    errs = {"rows": max(rel_err(o[:hi - lo], r[lo:hi]) if hi > lo else 0.0 for o, r in zip(outs, ref)),
            "dx": rel_err(x_sp.grad, x_dense.grad)}
    with torch.no_grad():
        errs["gathered"] = rel_err(stack.gather(outs[-1], n), ref[-1])
    assert outs[0].shape == (-(-n // ctx.world_size), cfg.d_model)  # [n'/p, d] between layers
    params, replicated = 0.0, 0.0
    for blk, dblk in zip(stack.blocks, dense.blocks):
        grads = llama_grads(blk, ctx, cfg) if cfg.family == "llama" else full_grads(blk, "v2", ctx, cfg)
        for name, grad in grads.items():
            err = rel_err(grad, dblk.get_parameter(name).grad)
            params = max(params, err)
            if "norm" in name or "ln_" in name or name in ("attn_out.bias", "mlp_down.bias"):
                replicated = max(replicated, err)
    errs["params"], errs["replicated params"] = params, replicated
    return errs


CASES = [("gpt2", 1, [13]), ("gpt2", 1, [5, 9, 3])] + \
        [("gpt2", p, lengths) for p in (2, 4, 8) for lengths in ([16], [13], [5, 9, 3])] + \
        [("gpt2_6", 3, [12]), ("gpt2_6", 3, [7, 4])] + \
        [("llama", p, lengths) for p in (1, 2, 4, 8) for lengths in ([16], [5, 9, 3])] + \
        [("llama_6", 3, [11])]


@pytest.mark.parametrize("cfg_name,p,lengths", CASES, ids=[f"{c}-p{p}-{'+'.join(map(str, ls))}" for c, p, ls in CASES])
def test_v2sp_equals_the_dense_stack_forward_and_backward(cfg_name, p, lengths):
    """T = 16 divides every p; 13, 17 (5+9+3), 11 and 7+4 do not (padding); Llama at p = 4, 8 > h_kv = 2."""
    for errs in run_ranks(p, check_sp, cfg_name, lengths):
        assert max(errs.values()) < 1e-12, errs


@pytest.mark.parametrize("cfg_name", ["gpt2", "llama"])
def test_without_the_parameter_all_reduce_the_norm_gradients_are_wrong(cfg_name):
    """The all-reduce of the norms' (and GPT-2's row biases') gradients is what makes them right: without it each
    rank keeps the partial sum over its own rows. Everything else stays exact."""
    for errs in run_ranks(2, check_sp, cfg_name, [16], drop_param_all_reduce=True):
        assert errs["replicated params"] > 1e-2, errs
        assert max(errs["rows"], errs["dx"], errs["gathered"]) < 1e-12, errs


def sp_ledger(ctx, cfg_name, n, variant):
    cfg = CONFIGS[cfg_name]
    dense, x = dense_and_input(cfg, torch.float32, n)
    stack = shard_stack(dense, variant, ctx.group)
    ledger = TrafficLedger(ctx.world_size)
    x.requires_grad_()
    with ledger.attach(stack):
        outs = stack(x)
        last = stack.gather(outs[-1], n) if variant == "v2sp" else outs[-1]
        forward = [r.traffic() for r in ledger.records]
        last.sum().backward()
    backward = [r.traffic() for r in ledger.records[len(forward):]]
    return forward, backward


@pytest.mark.parametrize("cfg_name,p,n", [("gpt2", 2, 16), ("gpt2", 4, 13), ("gpt2", 8, 40), ("gpt2_6", 3, 7),
                                          ("llama", 2, 9), ("llama", 8, 16)])
def test_ledger_equals_the_model(cfg_name, p, n):
    cfg = CONFIGS[cfg_name]
    for forward, backward in run_ranks(p, sp_ledger, cfg_name, n, "v2sp"):
        model_f = predict(cfg, p, n, torch.float32, "v2sp", "forward") + predict_sp_stack(cfg, p, n, torch.float32)
        model_b = predict(cfg, p, n, torch.float32, "v2sp", "backward") + \
            predict_sp_stack(cfg, p, n, torch.float32, "backward")
        assert Counter(forward) == Counter(model_f)
        assert Counter(backward) == Counter(model_b)
        assert len(forward) == 4 * cfg.n_layers + 1 and len(backward) == 6 * cfg.n_layers + 1


@pytest.mark.parametrize("cfg_name", ["gpt2", "llama"])
def test_forward_bytes_per_layer_equal_v2s_in_twice_the_collectives(cfg_name):
    cfg, p, n = CONFIGS[cfg_name], 4, 16
    sp, v2 = (run_ranks(p, sp_ledger, cfg_name, n, v)[0][0] for v in ("v2sp", "v2"))
    in_blocks = [t for t in sp if t.layer is not None]
    for layer in range(cfg.n_layers):
        mine, theirs = ([t for t in ts if t.layer == layer] for ts in (in_blocks, v2))
        assert sum(t.bytes_per_rank for t in mine) == sum(t.bytes_per_rank for t in theirs) == 2 * 2 * 3 / 4 * n * cfg.d_model * 4
        assert len(mine) == 2 * len(theirs) == 4
        assert sum(t.bytes_per_rank for t in mine) == 2 * tp_sp_elems_per_gpu(n, cfg.d_model, p) * 4  # cost model


def check_too_few_rows(ctx):
    dense, x = dense_and_input(SMALL, torch.float64, ctx.world_size - 1)
    with pytest.raises(ValueError, match=r"v2sp needs at least one row per rank: T=3 tokens over p=4 ranks"):
        shard_stack(dense, "v2sp", ctx.group)(x)
    return True


def test_fewer_rows_than_ranks_is_refused():
    assert all(run_ranks(4, check_too_few_rows))


# ---- activation memory: measured == tp/memory_model.py --------------------------------------------------------------


def saved_bytes(ctx, cfg_name, n, dtype_name):
    from launch.memory import saved_bytes_per_layer

    cfg = CONFIGS[cfg_name]
    dense, x = dense_and_input(cfg, getattr(torch, dtype_name), n)
    return {v: saved_bytes_per_layer(shard_stack(dense, v, ctx.group), x) for v in ("v2", "v2sp")}


MEMORY_CASES = [("gpt2", 1, 16, "float64"), ("gpt2", 2, 16, "float32"), ("gpt2", 4, 13, "float64"),
                ("gpt2", 8, 16, "bfloat16"), ("gpt2", 8, 21, "float32"), ("llama", 1, 16, "float64"),
                ("llama", 2, 13, "bfloat16"), ("llama", 4, 16, "float32"), ("llama", 8, 16, "float64"),
                ("llama_6", 3, 11, "float32")]


@pytest.mark.parametrize("cfg_name,p,n,dtype_name", MEMORY_CASES)
def test_saved_activation_bytes_equal_the_formula(cfg_name, p, n, dtype_name):
    """Every rank, every layer, v2 and v2sp, T divisible by p and not, full and half precision (the log-sum-exp
    and RMSNorm's statistics stay float32), Llama with replicated K,V heads (p = 4, 8 > h_kv = 2) and at p = 3
    (6 query heads over 3 K,V heads); and GPT-2's v2sp saves less than v2 once p > 1, by the replicated LayerNorm
    inputs and statistics."""
    from tp.memory_model import activation_bytes_per_layer

    cfg, dtype = CONFIGS[cfg_name], getattr(torch, dtype_name)
    for rank in run_ranks(p, saved_bytes, cfg_name, n, dtype_name):
        for v, per_layer in rank.items():
            assert per_layer == [activation_bytes_per_layer(cfg, p, n, dtype, v)] * cfg.n_layers, (v, per_layer)
        if cfg_name == "gpt2" and p > 1 and n % p == 0:
            e = dtype.itemsize
            saved = (2 * n * cfg.d_model + 4 * n) * (1 - 1 / p) * e - 6 * cfg.d_model * e
            assert rank["v2"][0] - rank["v2sp"][0] == saved
