"""Prefill/decode disaggregation: tokens, K,V bytes and message counts against independent references."""

import math
from collections import Counter

import pytest
import torch

from layers.models.lm import greedy_reference, shard_lm
from serve.pd import Layout, new_groups, prefill_schedule, serve_pd
from serve.block_manager import slots_of
from serve.build import prepare_weights
from serve.offline import OfflineEngine
from serve.config import EngineConfig
from serve.control import PlanMismatch
from serve.hooks import StepHook
from serve.request import Request
from tests.harness import run_ranks
from tests.test_serve import CFG, dense_lm, make_requests
from tp.dist import context
from tp.traffic_model import head_overlaps, kv_head_range, pair_count

# (prompt length, max_new_tokens, arrival): chunk 5 and budget 12 chunk the long prompts and batch several
# completions into one prefill iteration; the last request ends at token 1 and is never handed over
WORKLOAD = [(9, 6, 0), (17, 4, 0), (3, 8, 2), (25, 5, 3), (1, 3, 3), (12, 7, 6), (4, 1, 7)]
LAYOUTS = [(1, 1), (2, 2), (1, 2), (2, 1), (2, 4), (4, 2)]


def pair_orders_match(transfers: list[dict]) -> bool:
    """On every (prefill rank, decode rank) pair, the messages in the order the sender posted them equal the ones the
    receiver posted, in its order: NCCL matches a pair's messages in order, not by tag (gloo forgives a difference)."""
    sent, received = {}, {}
    for t in transfers:  # every rank's ledger, in its order
        mine = sent if t["kind"] == "send" else received
        pair = (t["rank"], t["peer"]) if t["kind"] == "send" else (t["peer"], t["rank"])
        mine.setdefault(pair, []).append((t["site"], t["request"], t["layer"], t["bytes"]))
    return sent == received


@pytest.fixture(scope="module")
def oracle():
    dense = dense_lm()
    out = []
    for r in make_requests(WORKLOAD):
        ref = greedy_reference(dense, r.prompt, r.max_new_tokens)
        assert min(ref.margins) > 1e-9, "near-tie in the oracle: pick another seed"
        out.append(ref.ids)
    return out


class Capture(StepHook):
    """Each request's K,V for positions [0, N) at the iteration its prompt completes (colocated engine)."""

    def __init__(self):
        self.kv = {}

    def after_step(self, engine, step):
        cache = engine.runner.cache
        for c in step.plan.scheduled:
            if c.sample and not c.decode:  # read through the block table the plan carries (blocks of a finished
                slots = torch.tensor(slots_of(c, 0, c.q_end, cache.block_size))  # request keep their contents)
                self.kv[c.request] = cache.read(slots, slice(None))


def pd(ctx, p_prefill, p_decode, streaming, compare_kv=False):
    layout = Layout(p_prefill, p_decode)
    groups = new_groups(layout)
    dense = dense_lm()
    res = serve_pd(dense, ctx, layout, make_requests(WORKLOAD), EngineConfig(long_prefill_token_threshold=5, max_num_batched_tokens=12, max_num_seqs=12), streaming=streaming, groups=groups, keep_kv=compare_kv)
    out = {"ids": [r["output_ids"] for r in res.requests], "ok": res.ledger_matches_model,
           "transfers": res.transfers, "requests": res.requests}
    if compare_kv and ctx.rank >= p_prefill:  # colocated engines on the decode group, capturing each prompt's K,V
        dctx = context(groups[1], ctx.backend, ctx.device)
        lm = prepare_weights(shard_lm(dense, "v2", dctx.group), EngineConfig())  # stored as the P/D sides store theirs
        alone, mixed = Capture(), Capture()
        prefill_only = [Request(r.id, r.prompt, 1, r.arrival) for r in make_requests(WORKLOAD)]
        OfflineEngine(lm, dctx, EngineConfig(long_prefill_token_threshold=5, max_num_batched_tokens=12, max_num_seqs=12), hooks=alone).run(prefill_only)
        OfflineEngine(lm, dctx, EngineConfig(long_prefill_token_threshold=5, max_num_batched_tokens=12, max_num_seqs=12), hooks=mixed).run(make_requests(WORKLOAD))
        out["kv_equal"] = {rid: torch.equal(kv, alone.kv[rid]) for rid, kv in res.kv.items()}
        out["kv_rel_diff_mixed"] = max(float((kv - mixed.kv[rid]).abs().max() / mixed.kv[rid].abs().max())
                                       for rid, kv in res.kv.items())
    return out


@pytest.mark.parametrize("streaming", [True, False])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pd_tokens_equal_the_oracle_and_bytes_equal_the_formula(layout, streaming, oracle):
    p_prefill, p_decode = layout
    results = run_ranks(p_prefill + p_decode, pd, p_prefill, p_decode, streaming)
    for res in results:
        assert res["ids"] == oracle
        assert res["ok"]  # every rank's messages == predict_transfers; each side's collectives == its model
    transfers = results[0]["transfers"]
    kv = [t for t in transfers if t["site"] == "pd/kv"]
    sends = [t for t in kv if t["kind"] == "send"]
    pairs = {(t["rank"], t["peer"]) for t in sends}
    assert len(pairs) == p_prefill + p_decode - math.gcd(p_prefill, p_decode)
    handed = [n for n, new, _ in WORKLOAD if new > 1]
    k_tok = 2 * CFG.n_layers * CFG.n_heads * CFG.d_head * 8  # float64
    assert sum(t["bytes"] for t in sends) == sum(handed) * k_tok  # L_p · K_tok
    for s in range(p_prefill, p_prefill + p_decode):
        assert sum(t["bytes"] for t in kv if t["kind"] == "recv" and t["rank"] == s) == sum(handed) * k_tok // p_decode
    assert pair_orders_match(transfers)
    # every message was both sent and received, with the same bytes
    key = lambda t, a, b: (t[a], t[b], t["request"], t["layer"], t["site"], t["bytes"])  # noqa: E731
    assert Counter(key(t, "rank", "peer") for t in transfers if t["kind"] == "send") == \
        Counter(key(t, "peer", "rank") for t in transfers if t["kind"] == "recv")
    assert len([t for t in sends if t["layer"] is not None]) == (len(sends) if streaming else 0)
    never = [q for q in results[0]["requests"] if q["transfer_s"] is None]
    assert [q["request"] for q in never] == [6]  # max_new_tokens = 1: finished at prefill, nothing moved
    # set-up: one warm-up message per pair (NCCL's pair communicators exist before the first streamed layer),
    # ledgered before every other message of its rank
    warm = [t for t in transfers if t["site"] == "pd/warm-up"]
    assert {(t["rank"], t["peer"]) for t in warm if t["kind"] == "send"} == pairs
    assert len(warm) == 2 * len(pairs) and all(t["bytes"] == 8 and t["request"] == -1 for t in warm)
    for rank in range(p_prefill + p_decode):
        mine = [t["site"] for t in transfers if t["rank"] == rank]  # this rank's ledger, in order
        assert mine[:mine.count("pd/warm-up")] == ["pd/warm-up"] * mine.count("pd/warm-up")


class _NeverDone:
    """A point-to-point work whose peer never sends: waits out its timeout, then fails as gloo's do (or, like NCCL's,
    just reports not complete)."""

    def __init__(self, raises: bool):
        self.raises = raises

    def wait(self, timeout):
        import time

        time.sleep(timeout.total_seconds())
        if self.raises:
            raise RuntimeError(f"[gloo/transport] Timed out waiting {timeout.total_seconds() * 1e3:.0f}ms for recv\n"
                               f"  more lines of context")
        return False

    def is_completed(self):
        return False


@pytest.mark.parametrize("raises", [True, False])
def test_handover_waits_are_bounded_and_name_the_message(raises):
    """Every wait for a hand-over message ends after pd.timeout_s with one line naming the message and the pair:
    the receiver thread's (which the decode side raises at its next boundary) and the idle decode side's own."""
    import threading
    from types import SimpleNamespace

    from serve.pd.handover import DecodeSide, HandoverTimeout, _label, _Posted, _Waiter

    fields = ("recv", "pd/kv", 3, 1, 2, 0, (0, 4))
    assert _label(fields) == "pd/kv of request 3, layer 1, prefill rank 0 -> decode rank 2"
    waiter, landed, got = _Waiter(torch.device("cpu"), timeout_s=0.2), threading.Event(), []
    waiter.submit([_NeverDone(raises)], [_label(fields)], lambda error: (got.append(error), landed.set()))
    assert landed.wait(10)
    waiter.close()
    message = str(got[0])
    assert isinstance(got[0], HandoverTimeout) and "\n" not in message
    assert message.startswith("pd/kv of request 3, layer 1, prefill rank 0 -> decode rank 2: ")
    group = _Posted([], [(_NeverDone(False), None, fields, 0.0)])  # nothing ever lands
    with pytest.raises(HandoverTimeout, match="pd/kv of request 3, layer 1, prefill rank 0 -> decode rank 2: "
                                              "not complete after pd.timeout_s=0.1 s"):
        DecodeSide._wait_landed(SimpleNamespace(timeout_s=0.1), group)


@pytest.mark.parametrize("layout", [(2, 2), (1, 1)])
def test_received_kv_equals_the_colocated_cache_bit_for_bit(layout):
    """Bit for bit against a colocated engine on p ranks that runs the same iterations (the prompts alone, as the
    prefill group does); against the colocated engine serving everything, whose iterations also carry decode rows,
    to rounding: a matmul over more rows may block its sums differently."""
    for res in run_ranks(sum(layout), pd, *layout, True, True):
        if "kv_equal" in res:
            assert len(res["kv_equal"]) == 6 and all(res["kv_equal"].values())
            assert res["kv_rel_diff_mixed"] < 1e-13


def test_head_overlaps_pairs_and_coverage():
    for p_src, p_dst in [(1, 1), (2, 2), (1, 2), (2, 1), (2, 4), (4, 2), (4, 8), (8, 4), (2, 8)]:
        pairs = head_overlaps(8, p_src, p_dst)
        assert len(pairs) == p_src + p_dst - math.gcd(p_src, p_dst)
        for s in range(p_dst):  # each destination's heads, exactly once
            got = sorted(h for _, d, lo, hi in pairs if d == s for h in range(lo, hi))
            assert got == list(range(s * 8 // p_dst, (s + 1) * 8 // p_dst))


def test_kv_head_pairs_with_replicated_heads():
    """Grouped-query attention: each destination rank gets each of its K,V heads exactly once, from the lowest
    source rank holding it; the closed-form count equals the enumeration (MHA: p_src + p_dst − gcd)."""
    for h_kv in (1, 2, 4, 8):
        for p_src, p_dst in [(1, 1), (1, 2), (2, 1), (2, 2), (2, 4), (4, 2), (4, 8), (8, 4), (1, 8), (8, 1)]:
            pairs = head_overlaps(h_kv, p_src, p_dst)
            assert len(pairs) == pair_count(h_kv, p_src, p_dst)
            for s in range(p_dst):
                got = sorted(h for _, d, lo, hi in pairs if d == s for h in range(lo, hi))
                assert got == list(kv_head_range(h_kv, s, p_dst))
            for r, _, lo, hi in pairs:  # the sender holds what it sends, and no lower rank does
                assert set(range(lo, hi)) <= set(kv_head_range(h_kv, r, p_src))
                assert not any(set(range(lo, hi)) & set(kv_head_range(h_kv, q, p_src)) for q in range(r))


LLAMA_PD = {  # (p_P, p_D, h_kv): the (prefill rank, decode rank, K,V heads) pairs, written out
    (2, 2, 2): {(0, 2, (0, 1)), (1, 3, (1, 2))},
    (1, 2, 1): {(0, 1, (0, 1)), (0, 2, (0, 1))},  # both decode ranks hold head 0
    (2, 1, 1): {(0, 2, (0, 1))},  # head 0 is on both prefill ranks: rank 0 sends it
    (2, 4, 2): {(0, 2, (0, 1)), (0, 3, (0, 1)), (1, 4, (1, 2)), (1, 5, (1, 2))},
}


def llama_cfg(h_kv):
    from layers.models.llama import LlamaConfig

    return LlamaConfig(d_model=64, n_heads=8, n_kv_heads=h_kv, d_head=8, d_ffn=96, n_layers=2, max_seq_len=96,
                       vocab_size=CFG.vocab_size)


def dense_llama(h_kv):
    from layers.models.dense import init_weights
    from layers.models.lm import DenseLlamaLM

    return init_weights(DenseLlamaLM(llama_cfg(h_kv), torch.float64), seed=0)


def pd_llama(ctx, p_prefill, p_decode, h_kv, streaming):
    layout = Layout(p_prefill, p_decode)
    res = serve_pd(dense_llama(h_kv), ctx, layout, make_requests(WORKLOAD), EngineConfig(long_prefill_token_threshold=5, max_num_batched_tokens=12, max_num_seqs=12), streaming=streaming, groups=new_groups(layout))
    return [r["output_ids"] for r in res.requests], res.ledger_matches_model, res.transfers


@pytest.mark.parametrize("case", list(LLAMA_PD), ids=[f"P{a}-D{b}-hkv{c}" for a, b, c in LLAMA_PD])
def test_pd_llama_moves_kv_heads_and_tokens_equal_the_oracle(case):
    p_prefill, p_decode, h_kv = case
    dense = dense_llama(h_kv)
    oracle = [greedy_reference(dense, r.prompt, r.max_new_tokens).ids for r in make_requests(WORKLOAD)]
    for ids, ok, transfers in run_ranks(p_prefill + p_decode, pd_llama, p_prefill, p_decode, h_kv, case != (2, 2, 2)):
        assert ids == oracle and ok
    sends = [t for t in transfers if t["site"] == "pd/kv" and t["kind"] == "send"]
    assert {(t["rank"], t["peer"], tuple(t["heads"])) for t in sends} == LLAMA_PD[case]
    handed = sum(n for n, new, _ in WORKLOAD if new > 1)
    per_rank = 2 * 2 * max(h_kv // p_decode, 1) * 8 * 8  # 2·L·max(h_kv/p_D, 1)·d_head·e, float64
    for s in range(p_prefill, p_prefill + p_decode):
        got = sum(t["bytes"] for t in transfers if t["site"] == "pd/kv" and t["kind"] == "recv" and t["rank"] == s)
        assert got == handed * per_rank


def test_prefill_schedule_is_what_the_prefill_engine_does():
    reqs = make_requests(WORKLOAD)
    schedule = prefill_schedule(reqs, EngineConfig(5, 12, 12))
    done = [rid for _, rids in schedule for rid in rids]
    assert sorted(done) == list(range(len(WORKLOAD)))
    assert any(len(rids) > 1 for _, rids in schedule)  # two prompts complete in one iteration
    index = {rid: i for i, rids in schedule for rid in rids}
    assert all(index[r.id] >= r.arrival for r in reqs)


def disagree(ctx):
    chunk = 5 if ctx.rank < 2 else 6  # the decode ranks think the prefill side chunks differently
    try:
        serve_pd(dense_lm(), ctx, Layout(2, 2), make_requests(WORKLOAD), EngineConfig(long_prefill_token_threshold=chunk, max_num_batched_tokens=12, max_num_seqs=12))
    except PlanMismatch as exc:
        return str(exc)
    return None


def test_groups_that_disagree_stop_with_a_clear_error_on_every_rank():
    for message in run_ranks(4, disagree):
        assert message and "different requests or settings" in message


def test_eos_as_first_token_finishes_on_the_decode_side_without_a_decode():
    assert run_ranks(2, eos_first)[0]


def eos_first(ctx):
    dense = dense_lm()
    reqs = make_requests([(9, 4, 0)])
    first = greedy_reference(dense, reqs[0].prompt, 1).ids[0]
    res = serve_pd(dense, ctx, Layout(1, 1), reqs, EngineConfig(long_prefill_token_threshold=5, max_num_batched_tokens=12, max_num_seqs=12), eos_token_ids=(first,))
    q = res.requests[0]  # handed over (its K,V moved), ended by token 1: no decode row, but a transfer time
    return q["output_ids"] == [first] and q["first_decode_s"] is None and q["transfer_s"] is not None


def test_requests_arriving_with_their_prompt_cached_join_as_decodes():
    from serve.scheduler import Scheduler

    late = Request(0, [1, 2, 3], 4, arrival=2, output=[9], num_computed_tokens=3)
    sched = Scheduler.for_workload([late], EngineConfig(long_prefill_token_threshold=2, max_num_batched_tokens=4, max_num_seqs=4, enable_prefix_caching=False))
    assert sched.schedule(0) is None and sched.next_arrival() == 2
    plan = sched.schedule(2)
    assert plan.admitted == (0,) and [(c.triple, c.decode, c.sample) for c in plan.scheduled] == [((3, 4, 4), True, True)]


def eos_groups(ctx):
    """The decode group is idle when a group arrives whose every request ends at token 1: it must wait for the
    next group (not treat every pending request as arrived)."""
    dense = dense_lm()
    gen = torch.Generator().manual_seed(11)
    p, q = (torch.randint(0, CFG.vocab_size, (n,), generator=gen).tolist() for n in (7, 9))
    eos = greedy_reference(dense, p, 1).ids[0]
    reqs = [Request(0, p, 5, 0), Request(1, p, 5, 1), Request(2, q, 5, 2), Request(3, p, 4, 3)]
    res = serve_pd(dense, ctx, Layout(1, 1), reqs, EngineConfig(long_prefill_token_threshold=16, max_num_batched_tokens=16, max_num_seqs=16), eos_token_ids=(eos,))
    want = [greedy_reference(dense, r.prompt, r.max_new_tokens, eos).ids for r in reqs]
    return [r["output_ids"] for r in res.requests], want, eos


def test_groups_that_end_at_token_one_leave_the_decode_group_waiting_for_the_next():
    got, want, eos = run_ranks(2, eos_groups)[0]
    assert got == want and got[0] == [eos] and got[1] == [eos] and len(got[2]) == 5


# ---- P/D on a bounded paged cache: prefix hits on the prefill side, preemption on the decode side ------------------

SHARED = 12  # every prompt starts with the same 12 tokens: prefix hits on the prefill side
PAGED_WORKLOAD = [(3, 8, 0), (8, 6, 0), (1, 9, 1), (10, 5, 2), (5, 7, 3), (2, 4, 3)]  # (tail, max_new, arrival)
# (layout, prefill block_size, decode block_size, num_gpu_blocks_override per side, streaming, attention backend of both groups):
# 8 blocks of 4 hold the largest request (26 positions) and not much more; 9 blocks of 3 hold one request at a time,
# so landed requests wait for blocks. Every backend meets the prefill side's prefix hits; the bounded pools (the
# first two cases) may preempt on the decode side, which is not asserted (see below)
PAGED_CASES = [((1, 1), 4, 4, 8, True, "reference"), ((1, 1), 4, 3, 9, False, "cpu"), ((2, 2), 1, 8, 26, True, "batched"),
               ((1, 2), 8, 2, 14, True, "auto"), ((2, 1), 3, 5, 9, False, "batched")]


def paged_requests():
    gen = torch.Generator().manual_seed(11)
    shared = torch.randint(0, CFG.vocab_size, (SHARED,), generator=gen).tolist()
    return [Request(i, shared + torch.randint(0, CFG.vocab_size, (n,), generator=gen).tolist(), new, arrival)
            for i, (n, new, arrival) in enumerate(PAGED_WORKLOAD)]


def pd_paged(ctx, layout, block_size, decode_block_size, num_gpu_blocks_override, streaming, attention):
    res = serve_pd(dense_lm(), ctx, Layout(*layout), paged_requests(), EngineConfig(long_prefill_token_threshold=5, max_num_batched_tokens=12, block_size=block_size, num_gpu_blocks_override=num_gpu_blocks_override, attention=attention, max_num_seqs=12), streaming=streaming, decode_block_size=decode_block_size)
    return {"ids": [r["output_ids"] for r in res.requests], "logits": [r["logits"] for r in res.requests],
            "ok": res.ledger_matches_model,
            "prefill_hits": sum(it["prefix_hit_tokens"] for it in res.prefill_iterations),
            "decode_preempted": sum(len(it["preempted"]) for it in res.decode_iterations)}


@pytest.mark.parametrize("case", PAGED_CASES)
def test_pd_on_a_bounded_pool_with_prefix_hits_preemption_and_other_block_sizes_equals_the_oracle(case):
    layout, *_ = case
    dense = dense_lm()
    want = [greedy_reference(dense, r.prompt, r.max_new_tokens) for r in paged_requests()]
    assert all(min(w.margins) > 1e-9 for w in want)
    results = run_ranks(sum(layout), pd_paged, *case)
    for res in results:
        assert res["ids"] == [w.ids for w in want], case
        assert all(abs(a - b) <= 1e-12 * max(1, abs(b)) for got, w in zip(res["logits"], want)
                   for a, b in zip(got, w.logits)), case
        assert res["ok"], case  # every message and collective equals the model
        assert res["prefill_hits"] > 0, case
    # Whether the decode side runs short depends on when hand-overs land (timing), so preemption there is not
    # asserted per case: when it happens (the tight cases, usually) the tokens above still equal the oracle; the
    # decode side's placement and preemption rules are checked deterministically by tests/test_paged_model.py.


def _refuse_small_pool(ctx):
    from tp.dist import ConfigError

    with pytest.raises(ConfigError, match="on the decode side"):  # 26 positions in blocks of 2: 13 > 7
        serve_pd(dense_lm(), ctx, Layout(1, 1), paged_requests(), EngineConfig(long_prefill_token_threshold=5, max_num_batched_tokens=12, block_size=4, num_gpu_blocks_override=7, max_num_seqs=12), decode_block_size=2)
    return True


def test_pd_refuses_a_pool_too_small_for_a_request_on_either_side():
    assert run_ranks(2, _refuse_small_pool) == [True, True]  # on every rank, before any collective


# ---- the prefill side as a pipeline (the seeds' "prefill pool wants PP") ------------------------------------------


def pd_pipelined(ctx, p_prefill, prefill_pp, p_decode, streaming, n_layers):
    from dataclasses import replace

    from layers.models.dense import init_weights
    from layers.models.lm import dense_lm as make_lm

    dense = init_weights(make_lm(replace(CFG, n_layers=n_layers), torch.float64), seed=0)
    layout = Layout(p_prefill, p_decode, prefill_pp)
    groups = new_groups(layout)
    res = serve_pd(dense, ctx, layout, make_requests(WORKLOAD), EngineConfig(long_prefill_token_threshold=5, max_num_batched_tokens=12, max_num_seqs=12), streaming=streaming, groups=groups)
    want = [greedy_reference(dense, r.prompt, r.max_new_tokens).ids for r in make_requests(WORKLOAD)]
    return {"same": [r["output_ids"] for r in res.requests] == want, "ok": res.ledger_matches_model,
            "transfers": res.transfers}


@pytest.mark.parametrize("p_prefill,prefill_pp,p_decode,streaming,n_layers", [
    (2, 2, 1, True, 3), (4, 2, 2, False, 3), (4, 2, 2, True, 4), (3, 3, 1, False, 3)])
def test_pd_with_a_pipelined_prefill_side_equals_the_oracle(p_prefill, prefill_pp, p_decode, streaming, n_layers):
    """The prefill side as prefill_pp stages of p_prefill / prefill_pp TP ranks (serve/pipeline.py's engine, micro-batches
    in flight): tokens equal the dense oracle; each stage's ranks send their own layers' K,V to the decode ranks (per
    layer streamed, or one message of the stage's layers), every message equal to predict_transfers; each decode rank
    receives all L layers of its heads, the same bytes as with a single prefill stage."""
    results = run_ranks(p_prefill + p_decode, pd_pipelined, p_prefill, prefill_pp, p_decode, streaming, n_layers)
    for res in results:
        assert res["same"] and res["ok"]
    assert pair_orders_match(results[0]["transfers"])  # the first token from the last stage, after its K,V
    kv = [t for t in results[0]["transfers"] if t["site"] == "pd/kv" and t["kind"] == "send"]
    tp = p_prefill // prefill_pp
    handed = [n for n, new, _ in WORKLOAD if new > 1]
    k_tok = 2 * n_layers * CFG.n_heads * CFG.d_head * 8
    assert sum(t["bytes"] for t in kv) == sum(handed) * k_tok  # L_p · K_tok, as with one prefill stage
    senders = {t["rank"] for t in kv}
    assert senders == set(range(p_prefill))  # every stage's ranks send (their layers)
    from layers.models.pipeline import stage_layers

    for stage, layers in enumerate(stage_layers(n_layers, prefill_pp)):
        mine = [t for t in kv if t["rank"] // tp == stage]
        if streaming:
            assert {t["layer"] for t in mine} == set(layers)
        else:
            assert all(t["layer"] is None and t["shape"][0] == len(layers) for t in mine)


def pipelined_prefill(ctx, pp):
    import torch.distributed as dist

    from layers.models.pipeline import check_layout, new_pp_groups, shard_pp_lm

    layout = check_layout(ctx.world_size, pp, CFG.n_layers, "v2")
    stages = new_pp_groups(layout)
    lm = shard_pp_lm(dense_lm(), "v2", layout, dist.get_rank(), stages[layout.stage_of(dist.get_rank())])
    prefill_only = [Request(r.id, r.prompt, 1, r.arrival) for r in make_requests(WORKLOAD)]
    res = OfflineEngine(lm, ctx, EngineConfig(long_prefill_token_threshold=5, max_num_batched_tokens=12, max_num_seqs=12)).run(prefill_only)
    return [(it["iteration"], it["finished"]) for it in res.iterations if it["finished"]]


@pytest.mark.parametrize("pp", [2, 3])
def test_the_pipelined_prefill_schedule_is_what_the_pipeline_engine_does(pp):
    """Every decode rank learns from prefill_schedule(pp=...) which prompts a pipelined prefill side completes in which
    step, in which order (NCCL matches a pair's messages in order): it equals what the PipelineEngine did, and differs
    from the one-stage schedule."""
    ran = run_ranks(pp, pipelined_prefill, pp)[0]
    predicted = [(i, rids) for i, rids in prefill_schedule(make_requests(WORKLOAD), EngineConfig(5, 12, 12), pp=pp)]
    assert ran == predicted
    assert predicted != prefill_schedule(make_requests(WORKLOAD), EngineConfig(5, 12, 12))
