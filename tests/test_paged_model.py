"""Model-based tests of the paged state machine: hypothesis drives the real Scheduler and KVCacheManager with random
operations (requests from prompt families that share, repeat, reorder and re-use whole blocks after different
prefixes; steps; aborts) under random block sizes, pool sizes down to the minimum, chunk sizes and budgets, and
checks them after every operation against a plain reference model written here.

The reference model knows nothing of hashes. It keeps, for every physical block, what each of its slots holds:
the K,V of position t of a request are a function of that request's tokens [0, t], so a slot holds the token
prefix it was computed from (written when an iteration's plan runs, lost when the block is taken for new
tokens). From that alone it says
  - which blocks a prompt may reuse: those whose every slot holds the prompt's own prefix, so the longest hit at
    an admission is the longest run of leading blocks that exist somewhere in the pool with exactly that content
    (leaving the prompt's last token to compute);
  - that every request reads only K,V of its own tokens: each position < computed holds its own prefix;
  - what a request generates: the "model" below picks the next token from the tokens so far, so a request's
    output must equal that function iterated on its prompt, whatever preemptions and prefix hits it went through.

Each example draws a scheduling policy (fcfs or priority) and every request a priority (fcfs ignores it). A second
reference model, written from each policy's rules, keeps the waiting queue and the running requests in order
(arrivals, admissions, preemptions, finishes, aborts) and says which requests an iteration may admit (a prefix of
its queue) and which running request each preemption must take (fcfs: the one admitted last; priority: the largest
(priority, arrival, id)); the scheduler's queue and running list must equal the model's after every operation.

CI runs MAX_EXAMPLES examples of up to STEPS operations (TPREF_HYPOTHESIS_EXAMPLES=N runs more).
"""

import os

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from serve.block_manager import EVICTED, KVCacheManager
from serve.config import SCHEDULING_POLICIES, EngineConfig
from serve.request import RequestStatus
from serve.request import Request
from serve.scheduler import FCFSPolicy, PriorityPolicy, Scheduler
from tp.partition import ceil_div

MAX_EXAMPLES = int(os.environ.get("TPREF_HYPOTHESIS_EXAMPLES", "200"))
STEPS = 40
VOCAB = 5  # few distinct tokens: prompts collide block by block often
PIECES = 4  # whole-block pieces that prompts are built from
MAX_PIECES = 5  # per prompt
MAX_NEW = 6


def next_token(tokens: list[int]) -> int:
    """The reference "model": a fixed function of every token so far (so K,V of a wrong prefix changes it)."""
    h = 17
    for t in tokens:
        h = (h * 31 + t + 1) % 1_000_003
    return h % (VOCAB + 1)  # VOCAB is the eos id: a request may stop early


def reference_output(prompt: list[int], max_new: int, eos: int | None) -> list[int]:
    out: list[int] = []
    while len(out) < max_new:
        out.append(next_token(prompt + out))
        if out[-1] == eos:
            break
    return out


class WatchedBlocks(KVCacheManager):
    """The KVCacheManager under test, with the reference model's events: a block taken for new tokens loses its
    content, and each admission's hit is recorded beside the reference's longest allowed hit at that moment."""

    def setup(self, machine):
        self.machine = machine
        self.content = [[None] * self.block_size for _ in range(self.num_blocks)]  # slot -> the prefix it holds

    def grow(self, request, end):
        before = len(self.tables[request])
        super().grow(request, end)
        for b in self.tables[request][before:]:
            self.content[b] = [None] * self.block_size

    def admit(self, request, hit):
        r = self.machine.requests[request]
        if r.num_computed_tokens:  # a handed-over request placed with its K,V (a decode side): not a prefix lookup
            return super().admit(request, hit)
        allowed = 0 if self.machine.eviction == "h2o" else self.machine.longest_allowed_hit(r.tokens)  # h2o: no hit
        config = self.machine.sched.config  # under eviction a hit that would take more blocks than the request may
        chunk = ceil_div(config.long_prefill_token_threshold, self.block_size) + 1  # hold is computed again
        if config.peak_blocks() is not None and not hit and allowed + chunk > config.peak_blocks():
            allowed = 0
        assert len(hit) == allowed, (f"request {request} hits {len(hit)} blocks, the reference allows exactly "
                                     f"{allowed}")
        self.machine.reference_hits[request] += min(allowed * self.block_size, len(r.prompt))
        super().admit(request, hit)


class PagedMachine(RuleBasedStateMachine):
    blocks_class = WatchedBlocks
    eviction = None  # EvictingMachine, H2OMachine: every example serves under that kv_eviction policy

    policies_under_test: dict = {}  # a policy's name -> a SchedulingPolicy to run in its place (a broken one, below)

    @initialize(data=st.data(), block_size=st.integers(1, 8), extra_blocks=st.integers(0, 10),
                chunk=st.integers(1, 12), max_num_seqs=st.integers(1, 4), more_budget=st.integers(0, 12),
                eos=st.booleans(), policy=st.sampled_from(SCHEDULING_POLICIES))
    def setup(self, data, block_size, extra_blocks, chunk, max_num_seqs, more_budget, eos, policy):
        self.bs = block_size
        self.pieces = [data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=block_size, max_size=block_size))
                       for _ in range(PIECES)]
        self.window = None  # (sink, window): the positions a query at i reads, j < sink or j > i - window
        self.h2o = None  # (budget, recent) positions
        eviction = None
        if self.eviction == "streaming":
            self.window = (data.draw(st.integers(0, 2 * block_size)), data.draw(st.integers(block_size,
                                                                                            3 * block_size)))
            eviction = {"policy": "streaming", "sink_tokens": self.window[0], "window_tokens": self.window[1]}
        elif self.eviction == "h2o":
            recent = data.draw(st.integers(block_size, 2 * block_size))
            self.h2o = (data.draw(st.integers(recent + block_size, recent + 3 * block_size)), recent)
            eviction = {"policy": "h2o", "budget_tokens": self.h2o[0], "recent_tokens": self.h2o[1]}
        config = EngineConfig(long_prefill_token_threshold=chunk, max_num_batched_tokens=max_num_seqs + more_budget,
                              max_num_seqs=max_num_seqs, block_size=block_size, scheduling_policy=policy,
                              enable_prefix_caching=self.blocks_class.enable_prefix_caching, kv_eviction=eviction)
        longest = MAX_PIECES * block_size + block_size + 1 + MAX_NEW - 1  # the largest capacity a prompt can have
        # the smallest pool that holds every request alone: its whole length, or what eviction lets it hold at most
        self.minimum = min(ceil_div(longest, block_size), config.peak_blocks() or ceil_div(longest, block_size))
        self.blocks = self.blocks_class(self.minimum + extra_blocks, block_size)
        self.blocks.setup(self)
        self.eos = VOCAB if eos else None
        self.stops = frozenset() if self.eos is None else frozenset({self.eos})
        self.sched = Scheduler(config, self.blocks)
        self.sched.policy = self.policies_under_test.get(policy, self.sched.policy)
        self.policy = policy
        self.queue: list[int] = []  # the policy's reference model: waiting requests in admission order,
        self.run_order: list[int] = []  # running requests in the order they were admitted,
        self.pending: set[int] = set()  # requests added that have not arrived yet,
        self.holders: set[int] = set()  # and waiting requests that hold blocks (handed over, placed)
        self.requests: dict[int, Request] = {}
        self.reference_hits: dict[int, int] = {}
        self.index = 0
        self.prompts: list[list[int]] = []
        self.ready: list[Request] = []  # handed over with their prompt's K,V, waiting for blocks to be placed

    # ---- the reference model ---------------------------------------------------------------------------------

    def longest_allowed_hit(self, tokens: list[int]) -> int:
        bs, have = self.bs, {tuple(c) for c in self.blocks.content if None not in c}
        k = 0
        while k < (len(tokens) - 1) // bs and tuple(tuple(tokens[:k * bs + j + 1]) for j in range(bs)) in have:
            k += 1
        return k

    def key(self, rid: int) -> tuple[int, int, int]:
        """The priority policy's order, from its definition: lower priority first, then earlier arrival, then the
        order of adding."""
        return self.requests[rid].priority, self.requests[rid].arrival, rid

    def expected_victim(self, running: list[int]) -> int:
        return running[-1] if self.policy == "fcfs" else max(running, key=self.key)

    def arrive(self) -> None:
        """Requests whose iteration has come join the queue: fcfs at the back, in order of arrival; priority at
        their place in key order."""
        for rid in sorted(self.pending, key=lambda i: (self.requests[i].arrival, i)):
            if self.requests[rid].arrival <= self.index:
                self.pending.discard(rid)
                self.queue.append(rid)
        if self.policy == "priority":
            self.queue.sort(key=self.key)

    def check_choices(self, plan, running: list[int]) -> tuple[list[int], list[int]]:
        """An iteration's admissions and victims against the model; (running victims, waiting ones that gave their
        blocks back)."""
        admitted = list(plan.admitted)
        assert admitted == self.queue[:len(admitted)], \
            f"{self.policy}: admitted {admitted}, the head of the queue is {self.queue[:len(admitted)]}"
        victims = [v for v in plan.preempted if v in running]
        left = list(running)
        for v in victims:
            assert v == self.expected_victim(left), \
                f"{self.policy}: preempted {v} of {left}, the policy takes {self.expected_victim(left)}"
            left.remove(v)
        gave_back = [v for v in plan.preempted if v not in running]
        holders = [rid for rid in self.queue if rid in self.holders]
        for v in gave_back:  # the holder last in the queue first
            assert holders and v == holders[-1], f"request {v} gave its blocks back before {holders}"
            holders.remove(v)
        if self.policy == "priority" and victims:  # nothing after a victim in the queue is admitted with it
            assert all(self.key(a) < self.key(v) for a in admitted for v in victims), (admitted, victims)
        assert not set(admitted) & set(victims)
        return victims, gave_back

    def after_iteration(self, admitted: list[int], victims: list[int], gave_back: list[int], finished: list[int],
                        running: list[int]) -> None:
        del self.queue[:len(admitted)]
        self.run_order += admitted
        self.holders -= set(admitted) | set(gave_back)
        self.run_order = [rid for rid in self.run_order if rid not in victims and rid not in finished]
        if self.policy == "fcfs":  # back at the front, in the order they were admitted
            self.queue = [rid for rid in running if rid in victims] + self.queue
        else:
            self.queue = sorted(self.queue + victims, key=self.key)

    # ---- operations ------------------------------------------------------------------------------------------

    def _add(self, prompt, max_new, delay, priority):
        rid = len(self.requests)
        r = Request(rid, prompt, max_new, arrival=self.index + delay, stop_ids=self.stops, priority=priority)
        self.requests[rid], self.reference_hits[rid] = r, 0
        self.prompts.append(prompt)
        self.sched.add(r)
        self.pending.add(rid)

    @rule(pieces=st.lists(st.integers(0, PIECES - 1), max_size=MAX_PIECES), tail=st.data(),
          max_new=st.integers(1, MAX_NEW), delay=st.integers(0, 2), priority=st.integers(0, 3))
    def add_from_pieces(self, pieces, tail, max_new, delay, priority):
        """Whole blocks shared, reordered, or re-used after a different prefix; a tail that may shift alignment."""
        rest = tail.draw(st.lists(st.integers(0, VOCAB - 1), min_size=0 if pieces else 1, max_size=self.bs + 1))
        self._add([t for i in pieces for t in self.pieces[i]] + rest, max_new, delay, priority)

    @precondition(lambda self: self.prompts)
    @rule(which=st.data(), cut=st.integers(0, 3), max_new=st.integers(1, MAX_NEW), delay=st.integers(0, 2),
          priority=st.integers(0, 3))
    def add_repeat(self, which, cut, max_new, delay, priority):
        """An earlier prompt again, whole or shortened."""
        prompt = which.draw(st.sampled_from(self.prompts))
        self._add(prompt[:max(1, len(prompt) - cut)], max_new, delay, priority)

    @precondition(lambda self: not self.eviction)  # P/D with kv_eviction is refused: a hand-over brings every block
    @rule(pieces=st.lists(st.integers(0, PIECES - 1), max_size=MAX_PIECES), tail=st.data(),
          max_new=st.integers(2, MAX_NEW), priority=st.integers(0, 3))
    def hand_over(self, pieces, tail, max_new, priority):
        """A request prefilled elsewhere (P/D): it arrives with its prompt's K,V and its first token, and is placed
        into the pool when blocks are free for its prompt and its first decode row, as serve/pd/ does."""
        rest = tail.draw(st.lists(st.integers(0, VOCAB - 1), min_size=0 if pieces else 1, max_size=self.bs + 1))
        prompt = [t for i in pieces for t in self.pieces[i]] + rest
        rid = len(self.requests)
        r = Request(rid, prompt, max_new, output=[next_token(prompt)], num_computed_tokens=len(prompt),
                    stop_ids=self.stops, priority=priority)
        self.requests[rid], self.reference_hits[rid] = r, 0
        self.prompts.append(prompt)
        self.ready.append(r)  # the scheduler meets it when it is placed

    def _place(self):
        while self.ready and self.blocks.blocks_for(self.ready[0].num_computed_tokens + 1) <= self.blocks.num_free:
            r = self.ready.pop(0)
            if r.output[0] == self.eos:  # its first token ended it: nothing to decode, never added
                r.status = RequestStatus.FINISHED_STOPPED
                continue
            self.sched.add_computed(r, self.index)
            self.pending.add(r.id)
            self.holders.add(r.id)
            for t in range(r.num_computed_tokens):  # the K,V that came with it
                self.blocks.content[self.blocks.tables[r.id][t // self.bs]][t % self.bs] = tuple(r.tokens[:t + 1])

    @precondition(lambda self: any(not r.finished for r in self.requests.values()))
    @rule(which=st.data())
    def abort(self, which):
        rid = which.draw(st.sampled_from(sorted(i for i, r in self.requests.items() if not r.finished)))
        if any(r.id == rid for r in self.ready):  # handed over, not placed yet: the scheduler never saw it
            self.ready = [r for r in self.ready if r.id != rid]
            self.requests[rid].abort()
            return
        free_before, held = self.blocks.num_free, self.blocks.tables.get(rid, [])
        freed = sum(self.blocks.blocks[b].ref_count == 1 for b in held if b != EVICTED)
        assert self.sched.abort(rid)
        self.pending.discard(rid)
        self.holders.discard(rid)
        self.queue = [i for i in self.queue if i != rid]
        self.run_order = [i for i in self.run_order if i != rid]
        assert self.blocks.num_free == free_before + freed and rid not in self.blocks.tables  # freed at once

    @rule()
    def step(self):
        self._place()
        self.arrive()
        running = list(self.run_order)
        plan = self.sched.schedule(self.index)
        if plan is None:  # nothing to do may only mean nothing has arrived: never a stall with work waiting
            assert not self.sched.running and not self.sched.waiting, "the scheduler stalls with requests waiting"
            assert not self.ready, "handed-over requests wait for blocks that nothing holds"
        else:
            sampled = {}
            for c in plan.scheduled:
                r = self.requests[c.request]
                assert list(c.blocks) == self.blocks.tables[r.id]
                for t in range(c.q_start, c.q_end):  # the iteration's forward writes these slots
                    b = c.blocks[t // self.bs]
                    assert self.blocks.blocks[b].ref_count == 1, f"block {b} is written while shared"
                    self.blocks.content[b][t % self.bs] = tuple(r.tokens[:t + 1])
                if c.sample:
                    sampled[r.id] = next_token(r.tokens)
            if self.h2o is not None:  # each block's attention this step: any numbers, fixed by the example
                self.sched.observe_scores(plan, [((self.index + 3) * 7919 + b * 104729) % 997 / 997.0
                                                 for c in plan.scheduled for b in range(len(c.blocks))])
            victims, gave_back = self.check_choices(plan, running)
            finished = self.sched.update_from_output(plan, sampled)
            self.after_iteration(list(plan.admitted), victims, gave_back, finished, running)
        self.index += 1

    # ---- invariants --------------------------------------------------------------------------------------------

    @invariant()
    def queues_follow_the_policy(self):
        if not hasattr(self, "blocks"):
            return
        assert [r.id for r in self.sched.waiting] == self.queue, (self.policy, [r.id for r in self.sched.waiting])
        assert [r.id for r in self.sched.running] == self.run_order, (self.policy, [r.id for r in self.sched.running])

    @invariant()
    def blocks_are_consistent(self):
        if not hasattr(self, "blocks"):
            return
        self.blocks.check()  # counts = holders, free iff unheld, `cached` names exactly (parent, tokens)
        used = sum(b.ref_count > 0 for b in self.blocks.blocks)
        assert self.blocks.num_free + used == self.blocks.num_blocks

    @invariant()
    def every_request_reads_its_own_prefix(self):
        if not hasattr(self, "blocks"):
            return
        for rid, table in self.blocks.tables.items():
            r = self.requests[rid]
            for t in range(r.num_computed_tokens):
                if self.window is not None and table[t // self.bs] == EVICTED:
                    # evicted: no query from the next position on may read it (a sink or in the window), and a
                    # whole block went, after the request's last query that read it
                    sink, window = self.window
                    assert not (t < sink or t > r.num_computed_tokens - window), \
                        f"request {rid} position {t} was evicted while a later query reads it"
                    continue
                if table[t // self.bs] == EVICTED:  # h2o: given back, and never read again (keys_of)
                    continue
                assert self.blocks.content[table[t // self.bs]][t % self.bs] == tuple(r.tokens[:t + 1]), \
                    f"request {rid} position {t}: its slot holds another prefix's K,V"

    @invariant()
    def outputs_and_hit_counts_match_the_reference(self):
        if not hasattr(self, "blocks"):
            return
        for rid, r in self.requests.items():
            expected = reference_output(r.prompt, r.max_new_tokens, self.eos)
            assert r.output == expected[:len(r.output)], f"request {rid} generated {r.output}, not {expected}"
            if r.finished and r.status.finish_reason != "abort":
                assert r.output == expected
            assert r.prefix_hit == self.reference_hits[rid]

    def teardown(self):
        """Run what is left to the end: every request finishes and the pool is whole again."""
        if not hasattr(self, "blocks"):
            return
        for _ in range(10_000):
            if not self.sched.has_work() and not self.ready:
                break
            self.step()
            self.blocks_are_consistent()
            self.every_request_reads_its_own_prefix()
        assert not self.sched.has_work(), "the requests never finished"
        self.outputs_and_hit_counts_match_the_reference()
        assert all(r.finished for r in self.requests.values())
        assert self.blocks.num_free == self.blocks.num_blocks and not self.blocks.tables


def machine_settings(examples: int) -> settings:
    return settings(max_examples=examples, stateful_step_count=STEPS, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow], derandomize=True)


PagedMachine.TestCase.settings = machine_settings(MAX_EXAMPLES)
test_paged_state_machine = PagedMachine.TestCase


class EvictingMachine(PagedMachine):
    """The same operations under kv_eviction streaming: after every iteration a running request gives back each
    block that no later query reads, and no other. Checked besides the invariants above (which now skip evicted
    positions, and assert none of them is read later): the blocks a request holds are exactly those the rule keeps
    (every block with a position a later query reads, or not yet fully out of the window)."""

    eviction = "streaming"

    @invariant()
    def a_request_holds_exactly_what_its_later_queries_read(self):
        if not hasattr(self, "blocks") or self.window is None:
            return
        sink, window = self.window
        for rid, table in self.blocks.tables.items():
            r = self.requests[rid]
            if r.status is not RequestStatus.RUNNING:  # placed by a hand-over, not run since
                continue
            n = r.num_computed_tokens
            for b, entry in enumerate(table):
                positions = range(b * self.bs, min((b + 1) * self.bs, n))
                read_later = (b + 1) * self.bs > n or any(t < sink or t > n - window for t in positions)
                assert (entry != EVICTED) == read_later, (f"request {rid} block {b} (computed {n}, sink {sink}, "
                                                          f"window {window}): held {entry != EVICTED}")


EvictingMachine.TestCase.settings = machine_settings(MAX_EXAMPLES // 4)
test_paged_state_machine_with_eviction = EvictingMachine.TestCase


class H2OMachine(PagedMachine):
    """The same operations under kv_eviction h2o, each block's attention made up per step: after every iteration a
    running request holds at most budget_tokens // block_size blocks unless every block it still holds is recent
    (one of the last recent_tokens positions), never gave back a recent block, and among its old blocks kept none
    has less attention than one it gave back at that iteration. No request is admitted with a prefix hit (its
    evictions follow the attention of its own queries)."""

    eviction = "h2o"

    @invariant()
    def a_request_keeps_its_budget_its_recent_blocks_and_its_heavy_hitters(self):
        if not hasattr(self, "blocks") or self.h2o is None:
            return
        budget, recent = self.h2o
        for rid, table in self.blocks.tables.items():
            r = self.requests[rid]
            if r.status is not RequestStatus.RUNNING:
                continue
            n = r.num_computed_tokens
            held = [b for b in range(ceil_div(n, self.bs)) if table[b] != EVICTED]
            old = [b for b in held if (b + 1) * self.bs <= n - recent]
            assert len(held) <= budget // self.bs or not old, (rid, n, held, budget, recent)
            gone = [b for b in range(ceil_div(n, self.bs)) if table[b] == EVICTED]
            assert all((b + 1) * self.bs <= n - recent for b in gone), (rid, n, gone, recent)
            last = [b for b, t in r.evictions[-1][2] if t == n] if r.evictions else []
            scores = r.kv_scores + [0.0] * len(table)
            assert all((scores[b], b) < (scores[k], k) for b in last for k in old), (rid, last, old, scores)


H2OMachine.TestCase.settings = machine_settings(MAX_EXAMPLES // 4)
test_paged_state_machine_with_h2o = H2OMachine.TestCase


class Loose(WatchedBlocks):
    """A broken prefix cache: it hits on a block's own tokens, whatever came before them."""

    def match_prefix(self, tokens):
        out = []
        for i in range((len(tokens) - 1) // self.block_size):
            ids = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            b = next((b.id for b in self.blocks if b.hash is not None and b.token_ids == ids), None)
            if b is None:
                break
            out.append(b)
        return out


class LooseMachine(PagedMachine):
    blocks_class = Loose


def test_the_reference_model_sees_a_broken_prefix_cache():
    """The same machine fails on a prefix cache that ignores what precedes a block (the check can fail)."""
    with pytest.raises(AssertionError):
        run_state_machine_as_test(LooseMachine, settings=settings(
            max_examples=MAX_EXAMPLES, stateful_step_count=STEPS, deadline=None, derandomize=True,
            phases=[Phase.generate], suppress_health_check=[HealthCheck.too_slow], print_blob=False))


class LastAdmittedFirst(PriorityPolicy):
    """A broken priority policy: its victim is the request admitted last (fcfs's), whatever its priority."""

    victim = FCFSPolicy.victim


class BrokenPolicyMachine(PagedMachine):
    policies_under_test = {"priority": LastAdmittedFirst()}


def test_the_reference_model_sees_a_policy_that_preempts_the_wrong_request():
    """The same machine fails on a priority policy whose victim is the request admitted last (the check can fail)."""
    with pytest.raises(AssertionError, match="the policy takes"):
        run_state_machine_as_test(BrokenPolicyMachine, settings=settings(
            max_examples=MAX_EXAMPLES, stateful_step_count=STEPS, deadline=None, derandomize=True,
            phases=[Phase.generate], suppress_health_check=[HealthCheck.too_slow], print_blob=False))
