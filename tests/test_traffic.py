"""The traffic ledger checked three ways: against CommDebugMode, against the analytic model, and
against a torch.profiler trace parsed back. Plus the model against hand-computed numbers."""

import json
from collections import Counter
from fractions import Fraction

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode

from layers.models.config import VARIANTS, ModelConfig
from layers.models.tp_block import shard_stack
from tests.common import ARTICLE03, SMALL, collective_counts, dense_and_input
from tests.harness import run_ranks
from tp.ledger import TrafficLedger, active, ring_bytes_per_rank
from tp.trace import backend_events, backend_witness, collectives_by_layer, layer_scopes
from tp.traffic_model import bytes_per_rank_per_layer, predict

# A second shape: ffn = 1.5d, 8 heads of 16 (d_head divisible by 8 for intra_head).
OTHER = ModelConfig(d_model=128, n_heads=8, d_head=16, d_ffn=192, n_layers=2)


def _run_recorded(ctx, cfg, variant, n, dtype):
    dense, x = dense_and_input(cfg, dtype, n)
    stack = shard_stack(dense, variant, ctx.group)
    ledger = TrafficLedger(ctx.world_size)
    x.requires_grad_()
    with CommDebugMode() as comm, ledger.attach(stack):
        stack(x)[-1].sum().backward()
    return ledger, comm


# ---- (1) ledger counts == CommDebugMode's per-module counts ----------------------------------------


def check_counts_agree(ctx, variant):
    ledger, comm = _run_recorded(ctx, SMALL, variant, 9, torch.float32)
    for i in range(SMALL.n_layers):
        theirs = comm.comm_module_counts.get(f"TPStack.blocks.{i}", {"forward": {}, "backward": {}})
        for phase in ("forward", "backward"):
            ours = dict(Counter(r.kind for r in ledger.records if r.layer == i and r.phase == phase))
            assert ours == collective_counts(theirs[phase]), (i, phase, ours, theirs[phase])
    assert len(ledger.records) == sum(collective_counts(comm.comm_module_counts["Global"][ph]).get(k, 0)
                                      for ph in ("forward", "backward") for k in ("all_reduce", "all_gather"))
    return len(ledger.records)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("p", [2, 4])
def test_ledger_counts_equal_commdebugmode(p, variant):
    assert run_ranks(p, check_counts_agree, variant)[0] > 0


# ---- (2) ledger bytes == model bytes, over a grid --------------------------------------------------


def check_grid(ctx, dtypes, lengths, shapes=2):
    checked = 0
    for cfg in (SMALL, OTHER)[:shapes]:
        for dtype in dtypes:
            for n in lengths:
                for variant in VARIANTS:
                    ledger, _ = _run_recorded(ctx, cfg, variant, n, dtype)
                    for phase in ("forward", "backward"):
                        seen = Counter(r.traffic() for r in ledger.records if r.phase == phase)
                        model = Counter(predict(cfg, ctx.world_size, n, dtype, variant, phase))
                        assert seen == model, (cfg, dtype, n, variant, phase, seen - model, model - seen)
                        checked += 1
    return checked


@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_ledger_equals_model_on_a_grid(p):
    """Every (shape, dtype, n, variant, phase) at p = 1, 2; at p = 4, 8 (each collective 4-8 ranks on two cores) one
    shape, one dtype and the shortest and longest n: what the bytes depend on (p, n, the shape, e) is still varied
    across the grid."""
    dtypes, lengths = ((torch.float32, torch.float64), (1, 7, 33)) if p <= 2 else ((torch.float64,), (1, 33))
    shapes = 2 if p <= 2 else 1
    assert run_ranks(p, check_grid, dtypes, lengths, shapes)[0] == shapes * len(dtypes) * len(lengths) * 3 * 2


# ---- (3) a profiler trace, parsed back, lists what the ledger saw ----------------------------------


def check_trace(ctx, variant, out_dir):
    dense, x = dense_and_input(SMALL, torch.float32, 6)
    stack = shard_stack(dense, variant, ctx.group)
    ledger = TrafficLedger(ctx.world_size)
    with torch.no_grad(), layer_scopes(stack), ledger.attach(stack), \
            torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        stack(x)
    path = f"{out_dir}/{variant}-rank{ctx.rank}.json"
    prof.export_chrome_trace(path)
    seen: dict[int, list] = {}
    for r in ledger.records:
        seen.setdefault(r.layer, []).append((r.kind, r.shape))
    parsed = collectives_by_layer(path)
    assert parsed == seen
    assert backend_events(path) == len(ledger.records)  # gloo's own events agree too
    return sum(len(v) for v in parsed.values())


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("p", [2, 4])
def test_profiler_trace_matches_ledger(p, variant, tmp_path):
    per_layer = {"v1": 4, "v2": 2, "intra_head": 3}[variant]
    assert run_ranks(p, check_trace, variant, str(tmp_path)) == [per_layer * SMALL.n_layers] * p


# ---- the ledger is off unless switched on -----------------------------------------------------------


def check_off_by_default(ctx):
    dense, x = dense_and_input(SMALL, torch.float32, 4)
    stack = shard_stack(dense, "v2", ctx.group)
    ledger = TrafficLedger(ctx.world_size)
    assert active() is None
    stack(x)
    assert ledger.records == []
    with ledger.recording():  # on, but no stack attached: collectives are recorded with no layer
        stack(x)
    assert len(ledger.records) == 2 * SMALL.n_layers and {r.layer for r in ledger.records} == {None}
    assert all(r.time_s == 0.0 for r in ledger.records)  # counting only: no clock, no wait for the device
    timed = TrafficLedger(ctx.world_size, timing=True)
    with timed.recording():
        stack(x)
    assert [r.traffic() for r in timed.records] == [r.traffic() for r in ledger.records[-len(timed.records):]]
    assert all(r.time_s > 0 for r in timed.records)
    assert active() is None


def test_ledger_is_off_by_default():
    run_ranks(2, check_off_by_default)


# ---- the model against numbers worked out by hand ----------------------------------------------------


def test_ring_formulas_by_hand():
    # all-reduce of 40x512 float32 over 8 ranks: 2 * 7/8 * 20480 * 4 bytes
    assert ring_bytes_per_rank("all_reduce", 40 * 512, 8, 4) == 143_360
    # all-gather to 40x2048 float64 over 4 ranks: 3/4 * 81920 * 8 bytes
    assert ring_bytes_per_rank("all_gather", 40 * 2048, 4, 8) == 491_520
    assert ring_bytes_per_rank("all_reduce", 1000, 1, 4) == 0


def test_model_per_layer_by_hand():
    f32 = torch.float32
    # article03, p = 8, n = 40: v2 = 4 * 7/8 * n * d * 4 B; v1 = 7/8 * n * (k + 2d + ffn) * 4 B
    assert bytes_per_rank_per_layer(ARTICLE03, 8, 40, f32, "v2") == 4 * 7 / 8 * 40 * 512 * 4 == 286_720
    assert bytes_per_rank_per_layer(ARTICLE03, 8, 40, f32, "v1") == 7 / 8 * 40 * (512 + 1024 + 2048) * 4
    # intra_head adds 2 * 7/8 * h * n^2 * 4 B on top of v2
    extra = bytes_per_rank_per_layer(ARTICLE03, 8, 40, f32, "intra_head") - 286_720
    assert extra == 2 * 7 / 8 * 8 * 40 * 40 * 4


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("n", [1, 40, 4096])
def test_v2_moves_four_sevenths_of_v1_at_k_d_ffn_4d(p, n):
    v2 = bytes_per_rank_per_layer(ARTICLE03, p, n, torch.float32, "v2")
    v1 = bytes_per_rank_per_layer(ARTICLE03, p, n, torch.float32, "v1")
    assert Fraction(v2) / Fraction(v1) == Fraction(4, 7)
    assert len(predict(ARTICLE03, p, n, torch.float32, "v2")) * 2 == len(predict(ARTICLE03, p, n, torch.float32, "v1"))


def test_intra_head_grows_with_n_squared():
    extra = [bytes_per_rank_per_layer(ARTICLE03, 8, n, torch.float32, "intra_head")
             - bytes_per_rank_per_layer(ARTICLE03, 8, n, torch.float32, "v2") for n in (100, 200, 400)]
    assert extra[1] == 4 * extra[0] and extra[2] == 4 * extra[1]


def test_one_rank_moves_nothing():
    for v in VARIANTS:
        assert predict(ARTICLE03, 1, 40, torch.float32, v) == []


def test_trace_parser_counts_host_events_once_with_cuda_activity(tmp_path):
    """A CUDA trace repeats `layer i` on the GPU timeline and adds kernels; each collective still counts once."""
    def ev(name, cat, ts, dur, dims=None):
        e = {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}
        if dims is not None:
            e["args"] = {"Input Dims": dims}
        return e

    events = [
        ev("layer 1", "gpu_user_annotation", 0, 400),  # GPU time runs late: its copy of layer 1 covers layer 0
        ev("layer 0", "user_annotation", 0, 100), ev("layer 0", "gpu_user_annotation", 5, 120),
        ev("c10d::allreduce_", "cpu_op", 10, 5, [[[40, 512]], []]),
        ev("record_param_comms", "cpu_op", 10, 5), ev("record_param_comms", "cpu_op", 11, 3),  # NCCL logs two
        ev("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "kernel", 12, 30),
        ev("layer 1", "user_annotation", 200, 100),
        ev("c10d::allreduce_", "cpu_op", 210, 5, [[[40, 512]], []]),
        ev("record_param_comms", "cpu_op", 210, 5), ev("record_param_comms", "cpu_op", 211, 3),
        ev("record_param_comms", "kernel", 212, 3),  # not a host event
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert collectives_by_layer(path) == {0: [("all_reduce", (40, 512))], 1: [("all_reduce", (40, 512))]}
    assert backend_witness(path, 2) == (True, 2.0)
    assert backend_witness(path, 3) == (False, 4 / 3)
