"""The ORCA scheduler and its plans, on host data only (no process group): its rules and seeds/05's numbers."""

import argparse

import pytest

from serve.config import EngineConfig
from serve.plan import SchedulerOutput
from serve.request import Request
from serve.scheduler import Scheduler, SchedulerError


def decoding(rid: int, kv_length: int, prompt: int = 1000) -> Request:
    """A request mid-stream whose next decode row sits at position kv_length - 1."""
    out = kv_length - prompt
    return Request(rid, [1] * prompt, max_new_tokens=500, output=[2] * out, num_computed_tokens=kv_length - 1)


def workload(requests, long_prefill_token_threshold: int, budget: int, max_num_seqs: int | None = None) -> Scheduler:
    """A scheduler holding the requests from the start, every one of them allowed to run at once unless max_num_seqs
    says otherwise, its pool sized for the workload (never preempts), no prefix caching."""
    return Scheduler.for_workload(requests, EngineConfig(long_prefill_token_threshold, budget, max_num_seqs or budget,
                                                         enable_prefix_caching=False))


def drive(requests, long_prefill_token_threshold, budget, max_num_seqs=None, token=lambda rid, it: 7):
    """Run the scheduler to completion with made-up tokens; return every plan."""
    sched, plans, index = workload(requests, long_prefill_token_threshold, budget, max_num_seqs), [], 0
    while sched.has_work():
        plan = sched.schedule(index)
        if plan is None:
            index = sched.next_arrival()
            continue
        plans.append(plan)
        sched.update_from_output(plan, {c.request: token(c.request, index) for c in plan.scheduled if c.sample})
        index += 1
    return plans


def test_seed05_fresh_prefill_beside_two_decodes():
    # A fresh prefill (0, 4096, 4096) + B decode step 51 (kv 1500) + C decode step 200 (kv 1700) = 4098 rows.
    reqs = [decoding(1, 1500, prompt=1450), decoding(2, 1700, prompt=1501), Request(0, [5] * 4096, 10)]
    plan = workload(reqs, 4096, 8192).schedule(0)
    assert plan.rows == 4098
    assert [(c.request, c.triple) for c in plan.scheduled] == [(1, (1499, 1500, 1500)), (2, (1699, 1700, 1700)),
                                                             (0, (0, 4096, 4096))]
    # score blocks: 1x1500, 1x1700, and the 4096² square (lower-triangular inside)
    assert [c.q_rows * c.kv_length for c in plan.scheduled] == [1500, 1700, 4096 * 4096]
    assert plan.score_entries() == 1500 + 1700 + 4096 * 4097 // 2
    assert plan.decodes == 2 and plan.prefill_chunks == 1 and plan.admitted == (0,)
    assert plan.sample_rows == [0, 1, 4097]  # both decodes, and the prompt's last row


def test_seed05_piggyback_chunk_beside_three_decodes():
    # E chunk of 1024 rows after a cached prefix of 7168 (kv 8192) + decodes at kv 1500, 1700, 1100 = 1027 rows.
    e = Request(9, [3] * 50 * 1024, 10, num_computed_tokens=7 * 1024)
    reqs = [e, decoding(1, 1500), decoding(2, 1700), decoding(3, 1100)]
    plan = workload(reqs, 1024, 2048).schedule(0)
    assert plan.rows == 1027
    assert [c.triple for c in plan.scheduled] == [(1499, 1500, 1500), (1699, 1700, 1700), (1099, 1100, 1100),
                                               (7168, 8192, 8192)]
    assert plan.sample_rows == [0, 1, 2]  # an intermediate chunk never samples
    assert plan.cache_rows_read() == 1499 + 1699 + 1099 + 7168


@pytest.mark.parametrize("chunk", [1, 3, 7, 64, 100, 1000])
def test_chunked_prompt_score_entries_and_cache_rereads(chunk):
    n = 100
    plans = drive([Request(0, [1] * n, 1)], chunk, budget=4096)
    prefill = [c for plan in plans for c in plan.scheduled]
    assert len(prefill) == -(-n // chunk)  # ⌈N/C⌉ iterations
    # Chunking saves no attention work: the visible score entries sum to N(N+1)/2 for every C.
    assert sum(plan.score_entries() for plan in plans) == n * (n + 1) // 2
    # ...but re-reads the cache: chunk k reads kC cached rows, Σ = C·k(k-1)/2 ≈ N²/(2C).
    k = -(-n // chunk)
    assert sum(c.q_start for c in prefill) == sum(i * chunk for i in range(k))


def test_ceil_100k_over_2048_is_49_iterations():
    plans = drive([Request(0, [1] * 100_000, 1)], 2048, 2048)
    assert len(plans) == 49


def test_decodes_first_budget_respected_and_only_complete_prompts_sample():
    reqs = [Request(i, [1] * n, 4, arrival=a) for i, (n, a) in enumerate([(10, 0), (23, 0), (5, 1), (40, 3)])]
    plans = drive(reqs, long_prefill_token_threshold=6, budget=9)
    seen_mixed = False
    for plan in plans:
        assert plan.rows <= 9
        kinds = [c.decode for c in plan.scheduled]
        assert kinds == sorted(kinds, reverse=True)  # every decode before every prompt chunk
        assert all(c.q_rows <= 6 for c in plan.scheduled)
        assert all(c.q_rows == 1 for c in plan.scheduled if c.decode)
        seen_mixed |= plan.decodes > 0 and plan.prefill_chunks > 0
    assert seen_mixed
    assert all(len(r.output) == 4 and r.finished for r in reqs)
    # per request, the triples tile [0, prompt + generated - 1) with no gap or overlap
    for r in reqs:
        mine = [c for p in plans for c in p.scheduled if c.request == r.id]
        assert [c.q_start for c in mine] == [0] + [c.q_end for c in mine[:-1]]
        assert mine[-1].q_end == len(r.prompt) + 4 - 1
        assert sum(c.sample for c in mine) == 4


def test_arrivals_finishing_and_admission_mid_stream():
    reqs = [Request(0, [1] * 4, 2), Request(1, [1] * 3, 5, arrival=3), Request(2, [1] * 2, 1, arrival=9)]
    sched = workload(reqs, 8, 8)
    p0 = sched.schedule(0)
    assert p0.admitted == (0,) and p0.rows == 4
    assert sched.update_from_output(p0, {0: 11}) == []
    p1 = sched.schedule(1)
    assert [c.triple for c in p1.scheduled] == [(4, 5, 5)]
    assert sched.update_from_output(p1, {0: 12}) == [0]  # finished the moment it reaches max_new_tokens
    assert sched.schedule(2) is None and sched.next_arrival() == 3  # idle until request 1 arrives
    p3 = sched.schedule(3)
    assert p3.admitted == (1,) and [c.triple for c in p3.scheduled] == [(0, 3, 3)]


def test_eos_finishes_early():
    reqs = [Request(0, [1, 2], 10, stop_ids=frozenset({50256}))]
    sched = workload(reqs, 4, 4)
    plan = sched.schedule(0)
    assert sched.update_from_output(plan, {0: 50256}) == [0] and reqs[0].output == [50256] and not sched.has_work()


def test_max_running_limits_admission():
    reqs = [Request(i, [1] * 2, 3) for i in range(5)]
    plans = drive(reqs, 8, 8, max_num_seqs=2)
    running = {}
    for plan in plans:
        assert len({c.request for c in plan.scheduled}) <= 2
        for c in plan.scheduled:
            running[c.request] = plan.index
    assert len(running) == 5


@pytest.mark.parametrize("kwargs,message", [
    (dict(long_prefill_token_threshold=0, max_num_batched_tokens=8), "long_prefill_token_threshold=0 must be an integer of at least 1"),
    (dict(long_prefill_token_threshold=4, max_num_batched_tokens=0, max_num_seqs=1), "max_num_batched_tokens=0 must be an integer of at least 1"),
    (dict(long_prefill_token_threshold=4, max_num_batched_tokens=4, max_num_seqs=8), "smaller than a full decode batch"),
])
def test_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_fingerprint_tells_plans_apart():
    reqs = [Request(0, [1] * 5, 2), Request(1, [1] * 5, 2)]
    a = workload(reqs, 3, 8).schedule(0)
    b = SchedulerOutput(a.index, a.scheduled[::-1], a.admitted)
    assert a.fingerprint() != b.fingerprint()
    assert a.fingerprint() == SchedulerOutput(a.index, a.scheduled, ()).fingerprint()


def test_priority_policy_admits_by_priority_then_arrival_and_fcfs_by_arrival():
    for policy, order in (("priority", [1, 2, 3, 0]), ("fcfs", [0, 1, 3, 2])):  # one request running at a time
        reqs = [Request(0, [1] * 3, 2, priority=2), Request(1, [1] * 3, 2, priority=0),
                Request(2, [1] * 3, 2, arrival=1, priority=0), Request(3, [1] * 3, 2, priority=1)]
        config = EngineConfig(8, 8, 1, enable_prefix_caching=False, scheduling_policy=policy)
        sched, admitted, index = Scheduler.for_workload(reqs, config), [], 0
        while sched.has_work():
            plan = sched.schedule(index)
            admitted += plan.admitted
            sched.update_from_output(plan, {c.request: 7 for c in plan.scheduled if c.sample})
            index += 1
        assert admitted == order, policy  # priority: 1 and 2 (priority 0; 2 arrives later), 3, then 0


def test_priority_rules_settings_and_the_control_message():
    from serve.config import add_engine_flags, engine_from_flags
    from serve.control import decode, encode, request_rows, settings_row
    from serve.scheduler import check_priority

    check_priority(-3, "priority")
    check_priority(0, "fcfs")
    with pytest.raises(ValueError, match=r"^priority=1 needs scheduling_policy='priority' \(this engine's is 'fcfs'\)"):
        check_priority(1, "fcfs")
    for bad in (True, 1.5, "1", 2 ** 53):
        with pytest.raises(ValueError, match="must be an integer"):
            check_priority(bad, "priority")
    with pytest.raises(ValueError, match="scheduling_policy='lifo': choose fcfs or priority"):
        EngineConfig(scheduling_policy="lifo")
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert engine_from_flags(parser.parse_args(["--scheduling-policy", "priority"])).scheduling_policy == "priority"
    assert engine_from_flags(parser.parse_args([])).scheduling_policy == "fcfs"
    # every rank gets each request's priority; the ranks' agreement digests tell policies and priorities apart
    r = Request(4, [1, 2], 3, priority=-(2 ** 40))
    assert decode(encode([r], []), 1, 0)[0][0].priority == -(2 ** 40)
    assert request_rows([r]) != request_rows([Request(4, [1, 2], 3)])
    assert settings_row(EngineConfig(scheduling_policy="priority")) != settings_row(EngineConfig())
