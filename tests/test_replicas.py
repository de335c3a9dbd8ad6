"""Data parallelism behind one LLM (serve/replicas.py) and its router (serve/router.py).

The router's rules are checked one by one (SGLang's cache-aware policy: imbalance first, then the prefix match above
its threshold, else the smallest record); replicas give the same greedy tokens as one engine (the dense oracle checks
every request: check=True), and a replica killed mid-stream loses nothing: its requests are computed again on the
other, and the oracle still matches."""

import os
import signal
import time

import pytest

from serve.router import Router, prefix_keys
from serve.sampling_params import SamplingParams


def test_the_router_follows_the_longest_prefix_and_balances_load():
    r = Router(3, "cache_aware", block_size=2, cache_threshold=0.5, balance_abs_threshold=4,
               balance_rel_threshold=1.5)
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    first = r.route(a, [0, 0, 0])
    assert first == 0 and r.decisions["smallest"] == 1  # nothing recorded: the smallest record, then the lower index
    assert r.route([9, 9, 9, 9], [1, 0, 0]) == 1  # no match: the smallest record (ties by load, then index)
    assert r.route(a[:6] + [0, 0], [1, 1, 0]) == 0  # 3 of 4 blocks match replica 0's record: above 0.5
    assert r.decisions["cache"] == 1
    assert r.route(a[:2] + [0] * 6, [1, 1, 0]) == 2  # 1 of 4 matches: not enough; the smallest record (replica 2)
    assert r.route(a, [9, 1, 1]) == 1  # imbalanced (9 - 1 > 4 and 9 > 1.5): the least loaded, whatever matches
    assert r.decisions["imbalanced"] == 1
    assert r.match(1, prefix_keys(a, 2)) == 4  # and the prompt is recorded where it went
    r.forget(1)
    assert r.match(1, prefix_keys(a, 2)) == 0


def test_round_robin_and_the_record_bound():
    r = Router(2, "round_robin", 16)
    assert [r.route([1], [5, 0]) for _ in range(4)] == [0, 1, 0, 1]
    small = Router(1, "cache_aware", block_size=1, max_tree_blocks=3)
    small.route([1, 2, 3, 4, 5], [0])
    assert len(small.trees[0]) == 3 and small.match(0, prefix_keys([1, 2, 3, 4, 5], 1)) == 0  # oldest forgotten
    with pytest.raises(ValueError, match="round_robin"):
        Router(2, "random", 16)


PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3][:10 + i] + [i] for i in range(6)]


def test_replicas_give_the_oracles_tokens_and_survive_a_dead_replica(capfd):
    from serve import LLM

    params = SamplingParams(temperature=0.0, max_tokens=5)
    with LLM("llama_tiny", data_parallel_size=2, dtype="float64", check=True, router_policy="round_robin",
             block_size=4) as llm:
        out = llm.generate(PROMPTS, params)
        assert all(o.oracle["verdict"] == "match" for o in out)
        stats = llm.stats()
        assert stats["replicas_alive"] == 2 and [s["iterations"] > 0 for s in stats["replicas"]] == [True, True]
        # requests on both replicas, then one replica's rank is killed: its requests run again on the other
        for i, prompt in enumerate(PROMPTS):
            llm.add_request(f"r{i}", prompt, params)
        os.kill(llm.executor.executors[1].procs[0].pid, signal.SIGKILL)
        llm.executor.executors[1].procs[0].wait()
        done, deadline = {}, time.monotonic() + 120
        while len(done) < len(PROMPTS) and time.monotonic() < deadline:
            for o in llm.step():
                if o.finished:
                    done[o.request_id] = o
        assert sorted(done) == [f"r{i}" for i in range(len(PROMPTS))]
        assert all(o.oracle["verdict"] == "match" for o in done.values())
        assert [done[f"r{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == \
            [o.outputs[0].token_ids for o in out]
        stats = llm.stats()
        assert stats["replicas_alive"] == 1 and stats["requests_moved"] == 3
        more = llm.generate(PROMPTS[:2], params)  # the survivor serves on
        assert [o.outputs[0].token_ids for o in more] == [o.outputs[0].token_ids for o in out[:2]]
    assert "replica 1 died" in capfd.readouterr().err


def test_bad_settings_are_refused_before_any_rank_starts():
    from serve import LLM

    with pytest.raises(ValueError, match="data_parallel_size=0"):
        LLM("llama_tiny", data_parallel_size=0)
    with pytest.raises(ValueError, match="router_policy='nearest'"):
        LLM("llama_tiny", data_parallel_size=2, router_policy="nearest")
