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


class FakeReplica:
    """An executor's interface without processes (serve/executor.py's call / send / poll / wait / check): each step,
    every request it holds gets one token (its prompt's length plus the step), until max_tokens. `dead`: its ranks
    are gone (a call raises as MultiprocExecutor's does, and the executor is closed)."""

    def __init__(self):
        self.closed, self.dead, self.mode, self.held, self.sent = False, False, None, {}, []

    def check(self, what, deadline=None):
        if self.dead:
            self.closed = True
            raise RuntimeError(f"{what}: rank 0 exited (code -9) without a Python error; every rank is stopped")

    def exited(self):
        return [(0, -9)] if self.dead else []

    def call(self, op, *args):
        self.check(op)
        if op == "add_request":
            self.held[args[0]] = (args[1], args[2].max_tokens, [])
        elif op == "has_unfinished_requests":
            return bool(self.held)
        elif op == "stats":
            return self.stats()
        return None

    def send(self, op, *args):
        if self.dead:
            raise OSError("broken pipe")
        if op == "add_nowait":
            self.call("add_request", *args)
        elif op in ("run", "serve", "step"):
            self.mode = op

    def stats(self):
        return {"running": len(self.held), "spec_decode_acceptance_rate": None, "kv_tier_hit_blocks": {"cpu": 1}}

    def poll(self, what, timeout):
        self.check(what)
        return self.mode == "run" or (self.mode in ("serve", "step") and (bool(self.held) or self.mode == "step"))

    def wait(self, what, deadline=None):
        from serve.outputs import CompletionOutput, RequestOutput

        self.check(what)
        if self.mode == "run" and not self.held:
            self.mode = None
            return "ok", None
        outputs = []
        for rid, (ids, most, tokens) in list(self.held.items()):
            tokens.append(len(ids) + len(tokens))
            done = len(tokens) == most
            outputs.append(RequestOutput(rid, None, ids, [CompletionOutput(0, "", list(tokens),
                                                                           "length" if done else None)], done))
            if done:
                del self.held[rid]
        if self.mode == "step":
            self.mode = None
            return "ok", (outputs, self.stats())
        return "outputs", (outputs, self.stats()) if self.mode == "serve" else outputs


def fake_replicas(n, policy="round_robin"):
    from serve.replicas import Replicas

    r = Replicas.__new__(Replicas)  # its start without processes: the executors are the fakes
    r.router, r.restarted, r.executors = Router(n, policy, 4), None, [FakeReplica() for _ in range(n)]
    r.info, r.alive, r.owner, r.args, r.stats_of = {}, [True] * n, {}, {}, [None] * n
    r.mode, r.running, r.aborted, r.lost_requests, r._moved, r._tokens, r._turn = None, set(), [], 0, [], {}, 0
    return r


def test_a_replica_dying_mid_generate_has_its_requests_run_again_on_the_others():
    r = fake_replicas(2)
    for i in range(4):
        r.call("add_request", f"q{i}", [1] * (i + 1), SamplingParams(max_tokens=3), None, 0)
    assert sorted(r.owner.values()) == [0, 0, 1, 1]
    r.send("run")
    r.executors[1].dead = True
    done = {}
    while (reply := r.wait("generate"))[0] == "outputs":
        done.update({o.request_id: o.outputs[0].token_ids for o in reply[1] if o.finished})
    assert done == {f"q{i}": [i + 1, i + 2, i + 3] for i in range(4)}  # all of them, the moved ones from scratch
    assert r.alive == [True, False] and r.lost_requests == 2 and not r.owner
    stats = r.call("stats")
    assert stats["running"] == 0 and stats["kv_tier_hit_blocks"] == {"cpu": 1}  # the live replica's alone


def test_a_replica_dying_while_serving_ends_its_requests_as_aborted_with_their_tokens():
    r = fake_replicas(2)
    r.send("serve")
    for i in range(4):
        r.send("add_nowait", f"q{i}", [1] * (i + 1), SamplingParams(max_tokens=4), None, 0)
    got = []
    for _ in range(2):  # one step of each replica: every request has a token
        assert r.poll("serve", 0.1)
        got += r.wait("serve")[1][0]
    assert {o.request_id for o in got} == {f"q{i}" for i in range(4)}  # both replicas had their turn
    r.executors[0].dead = True
    ended = {}
    while len(ended) < 4 and r.poll("serve", 0.1):
        outputs, stats = r.wait("serve")[1]
        ended.update({o.request_id: o for o in outputs if o.finished})
    aborted = {rid: o for rid, o in ended.items() if o.outputs[0].finish_reason == "abort"}
    assert sorted(aborted) == ["q0", "q2"]
    assert aborted["q2"].outputs[0].token_ids == [3] and aborted["q2"].prompt_token_ids == [1, 1, 1]  # as streamed
    assert all(o.outputs[0].finish_reason == "length" for rid, o in ended.items() if rid not in aborted)
    assert stats["replicas_alive"] == 1 and stats["spec_decode_acceptance_rate"] is None  # a rate is not summed
    r.executors[1].dead = True
    with pytest.raises(RuntimeError, match="every replica has died"):
        r.poll("serve", 0.1)


PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3][:10 + i] + [i] for i in range(4)]


def test_replicas_give_the_oracles_tokens_and_survive_a_dead_replica(capfd):
    from serve import LLM

    params = SamplingParams(temperature=0.0, max_tokens=4)
    with LLM("llama_tiny", data_parallel_size=2, dtype="float64", check=True, router_policy="round_robin",
             block_size=4) as llm:
        out = llm.generate(PROMPTS, params)
        assert all(o.oracle["verdict"] == "match" for o in out)
        stats = llm.stats()
        assert stats["replicas_alive"] == 2 and [s["iterations"] > 0 for s in stats["replicas"]] == [True, True]
        # requests on both replicas, then one replica's rank is killed: its two run again on the other
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
        assert stats["replicas_alive"] == 1 and stats["requests_moved"] == 2
        more = llm.generate(PROMPTS[:2], params)  # the survivor serves on
        assert [o.outputs[0].token_ids for o in more] == [o.outputs[0].token_ids for o in out[:2]]
    assert "replica 1 died" in capfd.readouterr().err


def test_bad_settings_are_refused_before_any_rank_starts():
    from serve import LLM

    with pytest.raises(ValueError, match="data_parallel_size=0"):
        LLM("llama_tiny", data_parallel_size=0)
    with pytest.raises(ValueError, match="router_policy='nearest'"):
        LLM("llama_tiny", data_parallel_size=2, router_policy="nearest")
