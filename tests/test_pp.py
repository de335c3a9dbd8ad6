"""Pipeline parallelism composed with TP (layers/models/pipeline.py): pp stages × tp ranks against the dense stack, the
stage boundary's messages and collectives against the traffic model, and bad layouts refused before any collective."""

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from layers.models.dense import DenseStack, init_weights
from layers.models.pipeline import check_layout, new_pp_groups, shard_stage, stage_layers
from tests.common import step_engine
from tests.harness import run_ranks
from tests.test_paged import LLAMA
from tests.test_serve import CFG
from tp.ledger import TrafficLedger
from tp.traffic_model import pp_stage_layers, predict_pp_stage


def pp_forward(ctx, pp, family, n_layers, boundary, rows=13):
    cfg = replace(CFG if family == "gpt2" else LLAMA, n_layers=n_layers)
    layout = check_layout(ctx.world_size, pp, n_layers, "v2")
    stages = new_pp_groups(layout)
    rank = dist.get_rank()
    dense = init_weights(DenseStack(cfg, torch.float64), seed=0)
    x = torch.randn(rows, cfg.d_model, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want = dense(x)  # every layer's output, on the single device
    stage = shard_stage(dense, "v2", layout, rank, stages[layout.stage_of(rank)], boundary)
    ledger = TrafficLedger(layout.tp)
    with torch.no_grad(), ledger.recording():
        outs = stage(x if stage.first else None, rows)
    scale = max(w.abs().max().item() for w in want)
    err = max((o - want[i]).abs().max().item() for o, i in zip(outs, stage.layers)) / scale
    collectives, messages = predict_pp_stage(cfg, pp, layout.tp, rank, rows, torch.float64, "v2", boundary)
    return {"layers": list(stage.layers), "err": err,
            "collectives_match": [r.traffic() for r in ledger.records] == collectives,
            "messages_match": [t.transfer() for t in ledger.transfers] == messages,
            "sent": sum(t.bytes for t in ledger.transfers if t.kind == "send"),
            "received": sum(t.bytes for t in ledger.transfers if t.kind == "recv")}


# (pp, tp, family, L, rows): L divisible by pp and not; rows divisible by tp (the scatter mode's exact tp×) and not
# (its zero padding rows)
GRID = [(2, 1, "gpt2", 4, 16), (2, 2, "gpt2", 5, 16), (4, 2, "gpt2", 6, 13), (3, 2, "llama", 4, 16),
        (2, 4, "llama", 3, 13)]


@pytest.mark.parametrize("pp,tp,family,n_layers,rows", GRID, ids=[f"pp{a}-tp{b}-{c}-L{d}-T{e}" for a, b, c, d, e in GRID])
def test_pp_by_tp_equals_the_dense_stack_and_moves_what_the_model_says(pp, tp, family, n_layers, rows):
    """Every layer's output on its stage equals the dense stack's (float64, 1e-12); each rank's collectives and
    boundary messages equal the model's, in both boundary modes; the scatter mode sends tp× fewer bytes across the
    boundary per rank than the whole-tensor mode (from the ledger; ⌈T/tp⌉ rows when tp does not divide T)."""
    sent = {}
    for boundary in ("whole", "scatter"):
        results = run_ranks(pp * tp, pp_forward, pp, family, n_layers, boundary, rows)
        assert sorted(i for r in results[::tp] for i in r["layers"]) == list(range(n_layers))  # each layer, once
        for r in results:
            assert r["err"] < 1e-12, (boundary, r)
            assert r["collectives_match"] and r["messages_match"], (boundary, r)
        sent[boundary] = [r["sent"] for r in results]
        assert [r["received"] for r in results] == [0] * tp + sent[boundary][:-tp]  # stage s+1 gets what s sent
    d = (CFG if family == "gpt2" else LLAMA).d_model
    assert sent["whole"] == [rows * d * 8] * ((pp - 1) * tp) + [0] * tp  # [T, d] float64 from every rank but the last
    piece = -(-rows // tp)
    assert sent["scatter"] == [piece * d * 8] * ((pp - 1) * tp) + [0] * tp  # [⌈T/tp⌉, d]
    if rows % tp == 0:
        assert sum(sent["whole"]) == tp * sum(sent["scatter"])


@pytest.mark.parametrize("n_layers,pp,sizes", [(8, 2, [4, 4]), (4, 3, [1, 2, 1]), (6, 4, [1, 2, 2, 1]),
                                               (7, 3, [2, 3, 2]), (3, 3, [1, 1, 1])])
def test_stage_layers_follow_the_rule_and_the_model_agrees(n_layers, pp, sizes):
    """L // pp each, the remainder one each to the stages before the last (vLLM's rule); the model's copy agrees."""
    got = stage_layers(n_layers, pp)
    assert [len(r) for r in got] == sizes and got == pp_stage_layers(n_layers, pp)
    assert [i for r in got for i in r] == list(range(n_layers))


@pytest.mark.parametrize("world,pp,n_layers,variant,message", [
    (8, 3, 8, "v2", "pp=3 must divide the world of 8 ranks"),
    (8, 8, 4, "v2", "pp=8 is more stages than the model's 4 layers"),
    (4, 2, 4, "v2sp", "pp=2 runs variant v1 or v2, not 'v2sp'"),
    (4, 0, 4, "v2", "pp=0 must divide the world of 4 ranks")])
def test_bad_layouts_are_refused_in_one_line(world, pp, n_layers, variant, message):
    with pytest.raises(ValueError, match=message):
        check_layout(world, pp, n_layers, variant)


def pp_microbatches(ctx, pp, family, n_layers, boundary, rows):
    cfg = replace(CFG if family == "gpt2" else LLAMA, n_layers=n_layers)
    layout = check_layout(ctx.world_size, pp, n_layers, "v2")
    stages = new_pp_groups(layout)
    rank = dist.get_rank()
    dense = init_weights(DenseStack(cfg, torch.float64), seed=0)
    gen = torch.Generator().manual_seed(2)
    xs = [torch.randn(n, cfg.d_model, generator=gen, dtype=torch.float64) for n in rows]
    stage = shard_stage(dense, "v2", layout, rank, stages[layout.stage_of(rank)], boundary)
    ledger = TrafficLedger(layout.tp)
    with torch.no_grad(), ledger.recording():
        outs, _ = stage.run(xs if stage.first else None, rows)
    err = 0.0
    for x, got in zip(xs, outs):
        want = dense(x)
        err = max(err, max((o - want[i]).abs().max().item() / want[i].abs().max().item()
                           for o, i in zip(got, stage.layers)))
    collectives, messages = [], []
    for m, n in enumerate(rows):  # the model per micro-batch, numbered as run() numbers them
        c, t = predict_pp_stage(cfg, pp, layout.tp, rank, n, torch.float64, "v2", boundary)
        collectives += c
        messages += [replace(x, request=m) for x in t]
    return {"err": err, "collectives": [r.traffic() for r in ledger.records] == collectives,
            "messages": [t.transfer() for t in ledger.transfers] == messages}  # in order: recv m, send m, ...


@pytest.mark.parametrize("pp,tp,boundary", [(2, 2, "scatter"), (4, 1, "whole"), (3, 2, "whole")])
def test_microbatches_flow_through_the_stages_in_order_and_equal_the_dense_stack(pp, tp, boundary):
    """A forward-only GPipe schedule of 4 micro-batches of different sizes: each equals the dense stack on every
    stage, every message carries its micro-batch's number, the collectives are the model's per micro-batch."""
    for r in run_ranks(pp * tp, pp_microbatches, pp, "gpt2", 5, boundary, [7, 3, 9, 4]):
        assert r["err"] < 1e-12 and r["collectives"] and r["messages"], r


# ---- run_block with pp ------------------------------------------------------------------------------------------


def test_run_block_with_pp_checks_every_stage_and_the_boundary(tmp_path):
    """pp=2 × tp=2 on a pool of 4 ranks: 3 requests in 2 micro-batches, scattered boundary: every stage's layers
    match the dense block, every rank's collectives and messages the model; the boundary bytes per rank are
    ⌈T/tp⌉·d·e per micro-batch."""
    import json

    from tests.launching import launch_on_pool

    proc, _ = launch_on_pool(4, "pp=2", "microbatches=2", "pp_boundary=scatter", "requests=[5,9,4]",
                             "variants=[v1,v2]", "model.n_layers=3", "dtype=float64", run_dir=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS: v1, v2 at pp=2 x tp=2 match the single-device block (scatter boundary, 2 micro-batch(es); " \
           "ledger = model on every rank: yes)" in proc.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["microbatch_requests"] == [[5, 9], [4]]
    for v in ("v1", "v2"):
        stages = report["variants"][v]["stages"]
        assert [[layer["layer"] for layer in st["layers"]] for st in stages] == [[0, 1], [2]]  # the extra one first
        assert all(layer["max_rel_err"] < 1e-12 for st in stages for layer in st["layers"])
        assert stages[0]["sent_per_rank"] == stages[1]["received_per_rank"] == (7 + 2) * 512 * 8  # ⌈14/2⌉, ⌈4/2⌉ rows
    # stage 1: one layer, 2 micro-batches: 2 all-reduces each, and each micro-batch's rows all-gathered once
    assert report["variants"]["v2"]["stages"][1]["collectives"] == {"all_gather": 2, "all_reduce": 4}


PP_BAD = [
    (8, ["pp=3"], "pp=3 must divide the world of 8 ranks"),
    (4, ["pp=4", "model.n_layers=2"], "pp=4 is more stages than the model's 2 layers"),
    (4, ["pp=2", "variants=[v2,v2sp]"], "variants=['v2', 'v2sp']: pp=2 runs v1 and v2"),
    (4, ["pp=2", "microbatches=3"], "microbatches=3 must be between 1 and the 2 request(s)"),
    (4, ["microbatches=2"], "microbatches=2 is for a pipeline: set pp > 1"),
    (4, ["pp=2", "pp_boundary=halves"], "pp_boundary='halves': choose whole or scatter"),
    (4, ["pp=2", "model=mixtral_tiny"], "pp=2 with MoE blocks is not built"),
    (4, ["pp=2", "profile=true"], "profile=true is not built for pp=2"),
]


@pytest.mark.parametrize("nproc,overrides,message", PP_BAD, ids=[" ".join(b[1]) for b in PP_BAD])
def test_bad_pipeline_settings_fail_before_any_collective(nproc, overrides, message):
    from tests.launching import refused

    refused(overrides, message, nproc, "run_block.py")


def test_stages_on_two_nodes(tmp_path):
    """Two torchrun agents (two "nodes" on this machine, a static rendezvous): node 0 holds stage 0, node 1 stage 1
    (one rank each: the multi-rank stages are the rank pools' tests above), and the boundary crosses between them;
    both exit 0 and rank 0 prints PASS."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    from tests.launching import ROOT

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={n}",
                                "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}",
                                str(ROOT / "launch" / "run_block.py"), "pp=2", "variants=[v2]", "model.n_layers=2",
                                f"hydra.run.dir={tmp_path / str(n)}"],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True) for n in (0, 1)]
    outs = []
    try:
        for agent in agents:
            outs.append(agent.communicate(timeout=120))
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
    assert [a.returncode for a in agents] == [0, 0], outs
    assert "PASS: v2 at pp=2 x tp=1 match the single-device block" in outs[0][0], outs[0]


# ---- serving iterations through the stages (PPLM) ---------------------------------------------------------------


def stage_lm(ctx, pp, family, n_layers, boundary="whole"):
    """(the dense LM of `family` with n_layers, float64, seed 0; this rank's PPLM of it at pp stages)."""
    from layers.models.lm import dense_lm
    from layers.models.pipeline import shard_pp_lm

    cfg = replace(CFG if family == "gpt2" else LLAMA, n_layers=n_layers)
    layout = check_layout(ctx.world_size, pp, n_layers, "v2")
    stages = new_pp_groups(layout)
    rank = dist.get_rank()
    dense = init_weights(dense_lm(cfg, torch.float64), seed=0)
    return dense, shard_pp_lm(dense, "v2", layout, rank, stages[layout.stage_of(rank)], boundary)


def pp_serve(ctx, pp, family, n_layers, boundary, attention, prompts, new):
    """A greedy run written out by hand, iteration by iteration, through PPLM.step over each stage's paged KV pool:
    all prompts whole in the first iteration (one in two chunks), then one decode row per request per iteration."""
    from layers.models.lm import greedy_reference
    from serve.model_runner import prepare_step
    from serve.kv_cache import KVPool
    from serve.plan import ScheduledRequest, SchedulerOutput

    dense, lm = stage_lm(ctx, pp, family, n_layers, boundary)
    cfg = dense.cfg
    block = 4
    tables = [tuple(range(i * 16, (i + 1) * 16)) for i in range(len(prompts))]
    pool = KVPool(len(lm.layers), 16 * len(prompts), block, lm.cache_heads, cfg.d_head, torch.float64)
    tokens = {i: list(p) for i, p in enumerate(prompts)}
    plans = [SchedulerOutput(0, (ScheduledRequest(0, 0, 3, decode=False, sample=False, blocks=tables[0]),
                               *(ScheduledRequest(i, 0, len(p), decode=False, sample=True, blocks=tables[i])
                                 for i, p in enumerate(prompts) if i))),
             SchedulerOutput(1, (ScheduledRequest(0, 3, len(prompts[0]), decode=False, sample=True, blocks=tables[0]),))]
    ledger = TrafficLedger(lm.layout.tp)
    with torch.no_grad(), ledger.recording():
        for it in range(new + 1):
            plan = plans[it] if it < 2 else SchedulerOutput(it, tuple(
                ScheduledRequest(i, len(tokens[i]) - 1, len(tokens[i]), decode=True, sample=True, blocks=tables[i])
                for i in range(len(prompts)) if len(tokens[i]) < len(prompts[i]) + new))
            step = prepare_step(plan, tokens, block, "cpu", attention)
            res = lm.step(step.ids, step.positions, pool.layers(step.batch), step.sample_rows)
            sampled = [c.request for c in plan.scheduled if c.sample]
            for r, t in zip(sampled, res.tokens.tolist()):
                tokens[r].append(t)
    want = [greedy_reference(dense, p, new).ids for p in prompts]
    got = [tokens[i][len(p):] for i, p in enumerate(prompts)]
    sent = [t for t in ledger.transfers if t.kind == "send"]
    broadcasts = [r for r in ledger.records if r.kind == "broadcast"]
    return got == want, len(sent), len(broadcasts), list(lm.layers)


@pytest.mark.parametrize("pp,tp,family,n_layers,boundary,attention", [
    (2, 1, "gpt2", 3, "whole", "cpu"), (2, 2, "gpt2", 4, "scatter", "batched"), (3, 2, "llama", 4, "whole", "cpu"),
    (2, 2, "llama", 3, "scatter", "reference")])
def test_serving_iterations_through_the_stages_equal_the_dense_oracle(pp, tp, family, n_layers, boundary, attention):
    """Greedy tokens through PPLM.step (embedding on the first stage, each stage's blocks over its own KV pool of its
    own layers, the head on the last, the tokens broadcast to every rank) equal the cache-free dense recompute; every
    iteration sends across each boundary once and broadcasts the tokens once."""
    prompts, new = [[5, 9, 2, 7, 1, 3], [4, 4, 8], [11, 2, 6, 6, 13]], 5
    results = run_ranks(pp * tp, pp_serve, pp, family, n_layers, boundary, attention, prompts, new)
    iterations = new + 1
    for r, (same, sent, broadcasts, layers) in enumerate(results):
        assert same, r
        assert sent == (iterations if r // tp < pp - 1 else 0), r
        assert broadcasts == iterations, r  # every iteration here samples a row
    assert sorted(i for *_, layers in results[::tp] for i in layers) == list(range(n_layers))


# ---- serving with micro-batches in flight (serve/pipeline.py's PipelineEngine) -----------------------------------


class InFlightCheck:
    """A StepHook: each micro-batch entering the pipeline shares no request with those still in flight; records the
    most micro-batches in flight at once."""

    def __init__(self):
        self.most, self.overlaps, self.sampling_overlaps = 0, [], []

    def before_schedule(self, engine):
        pass

    def before_forward(self, engine, plan):
        out = {c.request for e in engine.queue for c in e.plan.scheduled}
        self.overlaps += sorted(out & {c.request for c in plan.scheduled})
        # with chunk_pipelining: a request may be in flight only with prompt chunks that sample nothing
        self.sampling_overlaps += sorted({c.request for e in engine.queue for c in e.plan.scheduled if c.sample}
                                         & {c.request for c in plan.scheduled})
        self.most = max(self.most, len(engine.queue) + 1)

    def after_step(self, engine, step):
        pass


def pp_engine(ctx, pp, family, n_layers, boundary, attention="auto", workload=None, **settings):
    from layers.models.lm import greedy_reference
    from serve.offline import OfflineEngine
    from serve.config import EngineConfig
    from tests.test_paged import requests

    dense, lm = stage_lm(ctx, pp, family, n_layers, boundary)
    cfg = dense.cfg
    workload = workload or [(9, 6, 0), (17, 4, 0), (3, 8, 1), (25, 5, 2), (1, 3, 2), (12, 7, 3), (6, 9, 3)]
    check = InFlightCheck()
    settings = {"long_prefill_token_threshold": 5, "max_num_batched_tokens": 12, **settings}
    settings.setdefault("max_num_seqs", settings["max_num_batched_tokens"])
    engine = OfflineEngine(lm, ctx, EngineConfig(attention=attention, **settings), hooks=[check])
    res = engine.run(requests(workload))
    want = [greedy_reference(dense, r.prompt, r.max_new_tokens).ids for r in requests(workload)]
    rows = [t["rows"] for t in engine.engine.timeline if t["microbatch"] is not None]  # this stage's micro-batches
    from layers.models.pipeline import ENDS

    return {"same": [r["output_ids"] for r in res.requests] == want, "ledger": res.ledger_matches_model,
            "ends": sorted(n for n in ENDS if getattr(lm.lm, n, None) is not None),
            "tied": getattr(cfg, "tie_word_embeddings", True), "overlaps": check.overlaps,
            "sampling_overlaps": check.sampling_overlaps,
            "prompt_done_at": {rid: min(it["iteration"] for it in res.iterations for q, _, qe, _ in it["triples"]
                                        if q == rid and qe >= n) for rid, (n, *_) in enumerate(workload)}, "most": check.most, "pool_layers": engine.cache.n_layers,
            "stage_layers": len(lm.layers), "sent": sum(t["sent_bytes"] for t in engine.engine.timeline),
            "rows": rows, "preemptions": res.preemptions, "free": res.free_blocks_at_end, "blocks": res.num_blocks,
            "finished_at": sorted({it["iteration"] for it in res.iterations if it["finished"]})}


@pytest.mark.parametrize("pp,tp,family,n_layers,boundary,attention", [
    (2, 1, "gpt2", 3, "whole", "cpu"), (2, 2, "llama", 4, "scatter", "batched"), (4, 2, "gpt2", 5, "whole", "cpu"),
    (3, 2, "llama", 4, "scatter", "reference")])
def test_pipelined_serving_equals_the_dense_oracle_with_micro_batches_in_flight(pp, tp, family, n_layers, boundary,
                                                                                   attention):
    """Tokens through pp stages with up to pp micro-batches in flight equal the cache-free dense recompute; every
    rank's collectives and boundary messages of every step equal the model; no request is in two micro-batches in
    flight; each rank's KV pool holds its stage's layers only; the boundary bytes are the rows that crossed it."""
    results = run_ranks(pp * tp, pp_engine, pp, family, n_layers, boundary, attention)
    for rank, r in enumerate(results):
        assert r["same"] and r["ledger"], rank
        assert r["overlaps"] == [] and r["most"] == pp, rank  # pp micro-batches in flight at once, disjoint
        assert r["pool_layers"] == r["stage_layers"] == len(stage_layers(n_layers, pp)[rank // tp]), rank
        # the first stage holds the embedding, the last the final norm and the head, the others neither
        first = {"embed", "wpe"} if family == "gpt2" else {"embed"}
        last = {"embed", "ln_f"} if family == "gpt2" else {"head", "norm"} | ({"embed"} if r["tied"] else set())
        assert set(r["ends"]) == (first if rank < tp else set()) | (last if rank // tp == pp - 1 else set()), rank
        d, e = (CFG if family == "gpt2" else LLAMA).d_model, 8
        if rank // tp == pp - 1:
            assert r["sent"] == 0
        elif boundary == "whole" or tp == 1:
            assert r["sent"] == sum(r["rows"]) * d * e, rank  # every row of every micro-batch, from every TP rank
        else:  # scatter: ⌈T/tp⌉ rows of each micro-batch of T rows
            assert r["sent"] == sum(-(-n // tp) for n in r["rows"]) * d * e, rank
    assert len(results[0]["finished_at"]) > 1  # requests finish in different micro-batches


def test_pipelined_serving_preempts_by_recompute_and_gives_every_block_back():
    """A pool too small for the requests at once: preemption at pp = 2 leaves the tokens unchanged (a request in flight
    is never the victim), and every block is free at the end."""
    for r in run_ranks(2, pp_engine, 2, "gpt2", 2, "whole", "cpu", [(9, 12, 0), (17, 10, 0), (3, 14, 0), (12, 12, 1)],
                       long_prefill_token_threshold=5, max_num_batched_tokens=16, block_size=4, num_gpu_blocks_override=9):
        assert r["same"] and r["ledger"] and r["overlaps"] == []
        assert r["preemptions"] > 0 and r["free"] == r["blocks"] == 9


def pp_online(ctx, pp):
    """Rank 0 drives a PipelineEngine by hand: adds three requests, aborts one while its micro-batch is in flight, adds
    another mid-run; the other ranks step until told to stop."""
    from layers.models.lm import greedy_reference
    from serve.config import EngineConfig
    from serve.build import new_engine
    from serve.sampling_params import SamplingParams

    dense, lm = stage_lm(ctx, pp, "gpt2", 2)
    engine = new_engine(lm, ctx, EngineConfig(long_prefill_token_threshold=4, max_num_batched_tokens=8, max_num_seqs=4, block_size=4))
    prompts = {"a": [5, 9, 2, 7, 1], "b": [4, 4, 8], "c": [11, 2, 6, 6, 13, 3, 3], "d": [8, 1]}
    outs, aborted = {}, []

    def before(engine, step):
        if step >= 200:  # never drained: end it here (the test fails on the step count)
            for name in prompts:
                engine.abort_request(name)
        if step == 0:
            for name in "abc":
                engine.add_request(name, prompts[name], SamplingParams(temperature=0.0, max_tokens=6))
        if step == 2:  # a request in a micro-batch in flight (requests a, b, c are ids 0, 1, 2)
            aborted.append("abc"[min(engine.scheduler.in_flight)])
            engine.abort_request(aborted[0])
            engine.add_request("d", prompts["d"], SamplingParams(temperature=0.0, max_tokens=4))

    steps = step_engine(engine, before, 2, lambda outputs, step: outs.update({o.request_id: o for o in outputs}))
    if not ctx.is_main:
        return None
    aborted = aborted[0]
    want = {k: greedy_reference(dense, p, 6 if k != "d" else 4).ids for k, p in prompts.items()}
    return ({k: (o.outputs[0].finish_reason, o.outputs[0].token_ids == want[k]) for k, o in sorted(outs.items())},
            aborted, engine.scheduler.in_flight, len(engine.queue), engine.free_blocks == engine.num_blocks, steps)


def test_an_online_pipeline_aborts_a_request_in_flight_without_a_deadlock():
    outs, aborted, left, queue, free, steps = run_ranks(2, pp_online, 2)[0]
    assert outs.pop(aborted)[0] == "abort" and steps < 200
    assert sorted(outs) == sorted({"a", "b", "c", "d"} - {aborted})
    assert all(o == ("length", True) for o in outs.values()), outs
    assert not left and queue == 0 and free  # nothing in flight, every block back


def test_the_scheduler_forms_pp_micro_batches_of_disjoint_requests():
    """Host only: with 2 stages, six requests go out as two micro-batches of three; a request in flight gets no rows and
    is never the preemption victim; once its micro-batch is back it is scheduled again."""
    from serve.block_manager import KVCacheManager
    from serve.config import EngineConfig
    from serve.request import Request
    from serve.scheduler import Scheduler

    def two_stages(blocks, requests):
        config = EngineConfig(long_prefill_token_threshold=8, max_num_batched_tokens=64, max_num_seqs=64, block_size=4,
                              enable_prefix_caching=False)
        sched = Scheduler(config, KVCacheManager(blocks, 4, enable_prefix_caching=False), requests)
        sched.stages = 2
        return sched

    sched = two_stages(12, [Request(i, [1 + i, 2, 3], 4) for i in range(6)])
    first = sched.schedule(0)
    sched.in_flight.update(c.request for c in first.scheduled)
    second = sched.schedule(1)
    sched.in_flight.update(c.request for c in second.scheduled)
    assert [c.request for c in first.scheduled] == [0, 1, 2] and [c.request for c in second.scheduled] == [3, 4, 5]
    assert sched.schedule(2) is None  # everything is in flight
    sched.update_from_output(first, {0: 7, 1: 7, 2: 7})
    third = sched.schedule(3)
    assert [c.request for c in third.scheduled] == [0, 1, 2] and all(c.decode for c in third.scheduled)
    # a pool with no free block: the decodes that need one wait rather than preempt a request in flight
    tight = [Request(i, [1, 2, 3, 4], 3) for i in range(2)]
    sched = two_stages(2, tight)
    a = sched.schedule(0)
    sched.in_flight.update(c.request for c in a.scheduled)
    b = sched.schedule(1)
    sched.in_flight.update(c.request for c in b.scheduled)
    sched.update_from_output(a, {0: 9})
    c = sched.schedule(2)  # request 0's decode needs a second block; request 1 holds the other and is in flight:
    # request 0 waits for it (no preemption, no recompute), and request 1 is never the victim
    assert c is None and sched.preemptions == 0
    assert sched.by_id[0].status.value == sched.by_id[1].status.value == "running"
    assert 0 in sched.blocks.tables and 1 in sched.blocks.tables
    sched.update_from_output(b, {1: 9})  # request 1 is back: now request 0's decode preempts the latest admitted, request 1
    d = sched.schedule(3)
    assert [c.request for c in d.scheduled] == [0] and sched.preemptions == 1 and 1 not in sched.blocks.tables


# ---- launch/serve.py and the library with pp -----------------------------------------------------------------------


def test_serve_launcher_with_pp_checks_tokens_ledger_and_reports_the_stages(tmp_path):
    """launch/serve.py pp=2 on a pool of 4 ranks (scattered boundary): tokens equal the dense oracle, every rank's
    ledger the model, the KV formula per rank is the stage's layers over tp, and the per-stage table adds up."""
    import json

    from tests.launching import launch_on_pool

    proc, _ = launch_on_pool(4, "pp=2", "pp_boundary=scatter", "model.n_layers=3", "model.vocab_size=5003",
                             "prompt_count=5", "prompt_mean=12", "max_new_tokens=5", "long_prefill_token_threshold=4",
                             "max_num_batched_tokens=12", "arrivals=1", "dtype=float64", run_dir=tmp_path, script="serve.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS: served 5 requests at tp=2 x pp=2, tokens equal to the dense oracle" in proc.stdout
    assert "pp = 2 stages, boundary scatter" in proc.stdout and "bubble: " in proc.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["ledger_matches_model"] and report["check"]["verdicts"]["match"] == 5
    pp = report["pp"]
    assert [st["layers"] for st in pp["stages"]] == [[0, 2], [2, 3]] and [st["ranks"] for st in pp["stages"]] == \
        [[0, 1], [2, 3]]
    # rank 0 caches 2 of the 3 layers, half of the heads: 2·2·(8/2)·64·8 bytes per token
    assert report["kv_cache"]["bytes_per_token_per_rank"] == 2 * 2 * 4 * 64 * 8 and report["kv_cache"]["matches_formula"]
    rows = sum(t["rows"] for t in pp["stages"][0]["timeline"])
    assert rows == report["totals"]["rows_computed"]  # stage 0 ran every row once
    assert pp["stages"][1]["sent_bytes_per_rank"] == 0 < pp["stages"][0]["sent_bytes_per_rank"]
    assert all(st["microbatches"] == len(report["iterations"]) for st in pp["stages"])


PP_SERVE_BAD = [
    (4, ["pp=3"], "pp=3 must divide the world of 4 ranks"),
    (4, ["pp=4", "model.n_layers=2"], "pp=4 is more stages than the model's 2 layers"),
    (4, ["pp_boundary=scatter"], "pp_boundary=scatter is for a pipeline: set pp > 1"),
    (4, ["pp=2", "pp_boundary=halves"], "pp_boundary='halves': choose whole or scatter"),
    (4, ["pp=2", "pd.prefill_ranks=2", "pd.decode_ranks=2"], "pp=2 with pd.*: pipeline the prefill side with "
                                                              "pd.prefill_pp"),
    (4, ["pd.prefill_ranks=3", "pd.decode_ranks=1", "pd.prefill_pp=2"], "pd.prefill_pp=2 must divide "
                                                                        "pd.prefill_ranks=3"),
    (4, ["pd.prefill_pp=2"], "pd.prefill_pp=2 without pd: set pd.prefill_ranks and pd.decode_ranks"),
    (4, ["pd.prefill_ranks=2", "pd.decode_ranks=2", "pd.prefill_pp=2", "model.n_layers=1"],
     "pd.prefill_pp=2: pp=2 is more stages than the model's 1 layers"),
    (4, ["pp=2", "model=mixtral_tiny"], "pp=2 with an MoE model is not built"),
    (4, ["pp=2", "variant=v2sp"], "unknown variant 'v2sp' for serving"),
    (4, ["pp=2", "vocab_parallel=false"], "pp=2 with vocab_parallel=false is not built"),
    (8, ["pp=2", "model.n_heads=6", "model.d_head=8", "model.d_model=48"], "n_heads=6 heads cannot be split over p=4"),
]


@pytest.mark.parametrize("nproc,overrides,message", PP_SERVE_BAD, ids=[" ".join(b[1]) for b in PP_SERVE_BAD])
def test_bad_pipeline_serving_settings_fail_before_any_collective(nproc, overrides, message):
    from tests.launching import refused

    refused(overrides, message, nproc)


def test_the_library_serves_a_pipeline_equal_to_the_oracle():
    """LLM(pipeline_parallel_size=2): greedy, sampled and logprob requests, each checked against the dense oracle on
    rank 0 (check=True) and every rank's ledger against the model (on by default); bad sizes refused at once."""
    from serve import LLM, SamplingParams

    with pytest.raises(ValueError, match="pipeline_parallel_size=0 must be a positive integer"):
        LLM("article03", pipeline_parallel_size=0)
    with pytest.raises(ValueError, match="pipeline_parallel_size=9: pp=9 is more stages than the model's 8 layers"):
        LLM("article03", pipeline_parallel_size=9)
    prompts = [[464, 3290, 318], [40, 1101, 257, 3290, 11, 290], [1, 2, 3, 4, 5]]
    params = [SamplingParams(temperature=0.0, max_tokens=6), SamplingParams(max_tokens=5, temperature=0.8, seed=3),
              SamplingParams(temperature=0.0, max_tokens=4, logprobs=2)]
    with LLM("article03", pipeline_parallel_size=2, check=True, max_num_seqs=4, long_prefill_token_threshold=4,
             max_num_batched_tokens=16) as llm:
        outs = llm.generate(prompts, params)
        assert llm.stats()["oracle"] == {"match": 3}
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 5, 4]
    assert [o.oracle["verdict"] for o in outs] == ["match"] * 3 and len(outs[2].outputs[0].logprobs) == 4


def test_chunk_pipelining_sends_a_prompts_chunks_through_the_stages_back_to_back():
    """chunk_pipelining: a long prompt's next chunk enters the pipeline while its previous chunk is still in flight
    (a chunk at stage s needs the K,V its predecessor wrote at stage s one step earlier): tokens equal the dense
    oracle, the ledger the model; only prompt chunks that sample nothing overlap in flight; the long prompt's last
    chunk enters the pipeline after 10 steps instead of 4 per chunk."""
    workload = [(60, 3, 0), (4, 12, 0), (5, 12, 0)]
    one, both = (run_ranks(4, pp_engine, 4, "gpt2", 4, "whole", "cpu", workload, long_prefill_token_threshold=6, max_num_batched_tokens=8,
                           chunk_pipelining=on)[0] for on in (False, True))
    assert one["same"] and both["same"] and one["ledger"] and both["ledger"]
    assert one["overlaps"] == [] and both["overlaps"] and both["sampling_overlaps"] == []
    # 10 chunks of 6: one at a time, each waits for the one before to leave the 4 stages; back to back, one per step
    assert (one["prompt_done_at"][0], both["prompt_done_at"][0]) == (36, 9)
