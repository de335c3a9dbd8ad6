"""ORCA iteration-level scheduling with chunked prefill over a paged KV cache, on host data only (no torch, no
collectives).

Between two iterations, and identically on every rank (docs/serving.md, "The scheduler" and "Admission by memory"):

    finish   a request leaves the moment it finishes (max_new_tokens, or a stop id): `update` gives its blocks back
    carry    every running request with one token left to compute gets one decode row, first
    evict    under kv_eviction (serve/eviction.py), after each iteration, a running request gives back the blocks no
             later query of it reads
    chunk    running requests with more left get their next chunk: at most long_prefill_token_threshold rows,
             and never more than the budget max_num_batched_tokens has left this iteration
    admit    waiting requests in the policy's order, while budget, max_num_seqs and free blocks allow; each brings
             its first chunk, after the longest run of cached full blocks its prompt starts with (prefix caching),
             or its first decode row if it arrives with its prompt already cached (serve/pd/'s decode side)
    preempt  a running request that needs a block when none is free takes one from a waiting request that holds
             blocks, else from the running request the policy picks (itself, if it is that one): the victim gives
             every block back and recomputes later (vLLM's preemption by recompute), so a pool that holds each
             request alone always makes progress

The order of admission and the victim of a preemption are the policy's (EngineConfig.scheduling_policy: FCFSPolicy,
PriorityPolicy below). As in vLLM v1, a waiting request never preempts a running one to be admitted.

Memory: a KVCacheManager (serve/block_manager.py) holds every request's block table; a plan's chunks carry the
tables, so the engine turns a plan into slot mappings without asking anything else. A request's state is
how many of its tokens have K,V in the cache (`computed`): the next iteration gives it rows
[computed, min(len(tokens), computed + chunk)). There is no prefill phase and decode phase, only tokens not yet
computed (as in vLLM's v1 scheduler).
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Sequence

from serve.block_manager import EVICTED, KVCacheManager
from serve.config import SCHEDULING_POLICIES, EngineConfig, fits_alone
from serve.plan import ScheduledRequest, SchedulerOutput
from serve.request import Request, RequestStatus, output_budget, validate_prompt
from serve.sampling_params import FieldError, SamplingParams
from serve.spec_decode import check_request as check_speculation
from tp.partition import ceil_div


class SchedulerError(ValueError):
    """A workload with which the scheduler cannot make progress."""


def fits_or_raise(r: Request, num_blocks: int, block_size: int, peak: int | None = None) -> None:
    """SchedulerError unless the pool can hold r alone at its largest (serve/config.fits_alone, the rule; peak: the
    most blocks a request holds under kv_eviction)."""
    reason = fits_alone(r.capacity, num_blocks, block_size, peak=peak)
    if reason is not None:
        raise SchedulerError(f"request {r.id} cannot be held even alone: prompt {len(r.prompt)} + max_new_tokens "
                             f"{r.max_new_tokens} - 1 = {reason}")


class SchedulingPolicy:
    """Who is admitted next and who gives its blocks back. The waiting queue is kept in admission order: `enqueue`
    puts a request at its place (an arrival, or, with preempted, a running request preempted in this iteration, put
    back after the iteration's admission); admission takes the head while it fits. `victim`: the request that gives
    its blocks back, of the running ones that may (in admission order). `holds_back(v, r)`: v, preempted in this
    iteration, keeps r from being admitted in it (r would overtake it)."""

    def enqueue(self, waiting: deque[Request], r: Request, preempted: bool = False) -> None:
        raise NotImplementedError

    def victim(self, running: Sequence[Request]) -> Request:
        raise NotImplementedError

    def holds_back(self, victim: Request, r: Request) -> bool:
        raise NotImplementedError


class FCFSPolicy(SchedulingPolicy):
    """vLLM's "fcfs": arrivals at the back; the victims of an iteration back at the front (the scheduler puts them
    back latest admitted first, so the earliest admitted leads); the victim is the last admitted."""

    def enqueue(self, waiting, r, preempted=False):
        if preempted:
            waiting.appendleft(r)
        else:
            waiting.append(r)

    def victim(self, running):
        return running[-1]

    def holds_back(self, victim, r):
        return False  # it rejoins once admission is done: requests already waiting may take its blocks at once


class PriorityPolicy(SchedulingPolicy):
    """vLLM's "priority": every request by key(), lower first; a victim rejoins at its place, and nothing after it
    is admitted in the iteration that preempted it; the victim is the running request with the largest key (the
    lowest priority, arrived last)."""

    @staticmethod
    def key(r: Request) -> tuple[int, int, int]:
        return r.priority, r.arrival, r.id  # id: the order requests were added within one iteration

    def enqueue(self, waiting, r, preempted=False):
        waiting.insert(next((i for i, w in enumerate(waiting) if self.key(w) > self.key(r)), len(waiting)), r)

    def victim(self, running):
        return max(running, key=self.key)

    def holds_back(self, victim, r):
        return self.key(victim) < self.key(r)


POLICIES: dict[str, SchedulingPolicy] = {"fcfs": FCFSPolicy(), "priority": PriorityPolicy()}
assert tuple(POLICIES) == SCHEDULING_POLICIES, (tuple(POLICIES), SCHEDULING_POLICIES)


def check_priority(priority, policy: str) -> None:
    """ValueError (one line) unless a request may carry this priority under this policy: an integer (of less than
    2**53 in size: the control message carries it as float64), other than 0 only under "priority" (vLLM's rule)."""
    if isinstance(priority, bool) or not isinstance(priority, int) or abs(priority) >= 2 ** 53:
        raise FieldError(f"priority={priority!r} must be an integer (lower is scheduled first)", "priority")
    if priority and policy != "priority":
        raise FieldError(f"priority={priority} needs scheduling_policy='priority' (this engine's is {policy!r}): "
                         f"set it, or leave priority at 0", "priority")


class Scheduler:
    """The scheduler of one engine (every rank holds an identical one). config: the engine's settings, checked there
    (serve/config.py); blocks: the pool's block manager; requests: a workload held from the start (host planning:
    P/D's replay of the prefill side's schedule), else requests arrive by add()."""

    def __init__(self, config: EngineConfig, blocks: KVCacheManager, requests: list[Request] = ()):
        assert blocks.block_size == config.block_size, (blocks.block_size, config.block_size)
        self.config = c = config
        self.blocks = blocks
        self.policy = POLICIES[c.scheduling_policy]
        for r in requests:
            self.check_fits(r)
        self._rows: dict[int, tuple[int, int]] = {}  # this iteration: request -> its rows (q_start, q_end)
        self._left = 0  # this iteration: rows of the budget not given yet
        self.preemptions = 0
        self.preempted_waiting: list[int] = []  # this iteration: waiting requests that gave their blocks back
        # Requests that already hold cache at iteration 0 (built mid-stream, e.g. to replay a trace) start
        # running; one that holds cache but arrives later (handed over by a prefill group) waits for its arrival.
        self.running = [r for r in requests if r.num_computed_tokens > 0 and r.arrival <= 0 and not r.finished]
        if len(self.running) > c.max_num_seqs:
            raise SchedulerError(f"{len(self.running)} requests start mid-stream, more than "
                                 f"max_num_seqs={c.max_num_seqs}")
        for r in self.running:
            self.hold_computed(r)
            r.status = RequestStatus.RUNNING
        started = {r.id for r in self.running}
        self.pending = deque(sorted((r for r in requests if r.id not in started and not r.finished),
                                    key=lambda r: (r.arrival, r.id)))
        self.waiting: deque[Request] = deque()
        self.by_id = {r.id: r for r in requests}
        # pipeline parallelism (dispatch): requests in micro-batches that have not come back from the last stage, and
        # in how many; they get no rows (but a prompt's next chunk, with chunk_pipelining) and are never preempted
        self.in_flight: Counter[int] = Counter()
        self.stages = 1  # the PipelineEngine sets its pp
        self.connector = None  # a KV connector's scheduler side (set_connector)

    def set_connector(self, connector) -> None:
        """A KV connector (serve/kv_connector/): asked for tokens past each admission's prefix hit, told of each named
        block leaving the pool, and its step's metadata rides in each plan."""
        self.connector = connector
        self.blocks.on_leave = None if connector is None else connector.block_leaving

    @classmethod
    def for_workload(cls, requests: list[Request], config: EngineConfig) -> "Scheduler":
        """A scheduler holding `requests` from the start, its pool as config.pool_blocks sizes it for them. Host only:
        serve/pd/ replays the prefill side's schedule with it, and OfflineEngine checks a workload with it before
        anything runs."""
        n = config.pool_blocks(0, [r.capacity for r in requests])
        return cls(config, KVCacheManager(n, config.block_size, config.enable_prefix_caching), requests)

    def check_fits(self, r: Request) -> None:
        fits_or_raise(r, self.blocks.num_blocks, self.blocks.block_size, self.config.peak_blocks())

    def add(self, r: Request) -> None:
        """A request arriving while the engine runs (LLMEngine.add_request): it waits from iteration r.arrival on."""
        self.check_fits(r)
        if r.id in self.by_id:
            raise SchedulerError(f"request {r.id} was added twice")
        self.by_id[r.id] = r
        self.pending.append(r)
        if len(self.pending) > 1 and (self.pending[-2].arrival, self.pending[-2].id) > (r.arrival, r.id):
            self.pending = deque(sorted(self.pending, key=lambda q: (q.arrival, q.id)))

    def abort(self, request_id: int) -> bool:
        """End a request now, wherever it is (pending, waiting, running); its blocks go back to the pool at once.
        False if it had finished already (or is unknown)."""
        r = self.by_id.get(request_id)
        if r is None or r.finished:
            return False
        for queue in (self.pending, self.waiting):
            if r in queue:
                queue.remove(r)
        if r in self.running:
            self.running.remove(r)
        if r.id in self.blocks.tables:
            self.blocks.release(r.id)
        r.abort()
        return True

    def forget(self, request_id: int) -> None:
        """Drop a finished request's record (an online engine that runs for long does not keep them all)."""
        r = self.by_id.pop(request_id)
        assert r.finished, f"request {request_id} is still running"

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.pending or self.in_flight)

    def dispatch(self, plan: SchedulerOutput) -> None:
        """A pipeline: the plan's micro-batch enters the first stage. Its requests are in flight until update(plan),
        and each request's `computed` counts its dispatched rows (its next chunk, if it may have one, starts there)."""
        for c in plan.scheduled:
            self.in_flight[c.request] += 1
            self.by_id[c.request].num_computed_tokens = c.q_end

    def microbatch_cap(self) -> int:
        """The most requests one micro-batch takes: all of them with one stage; with pp stages, 1/pp of the requests
        that could run (running, and waiting up to max_num_seqs), rounded up, so that pp micro-batches of about equal
        size can be in flight at once."""
        most = self.config.max_num_seqs
        if self.stages == 1:
            return most
        return max(1, ceil_div(min(most, len(self.running) + len(self.waiting)), self.stages))

    def next_arrival(self) -> int | None:
        return self.pending[0].arrival if self.pending else None

    def add_computed(self, r: Request, index: int) -> None:
        """A request arriving at iteration `index` with the K,V of its first r.num_computed_tokens positions already computed
        (a P/D decode side takes a handed-over request in): blocks for those positions now, their K,V written by
        the caller; then it waits for admission like any request, holding its blocks (a running request that
        needs one takes them back first: it recomputes when admitted, as any preempted request does)."""
        self.check_fits(r)
        r.arrival = index
        self.hold_computed(r)
        self.add(r)

    def hold_computed(self, r: Request) -> None:
        """Blocks for the `computed` positions a request brings with it (resumed mid-stream, or handed over)."""
        if self.blocks.blocks_for(r.num_computed_tokens) > self.blocks.num_free:
            raise SchedulerError(f"request {r.id} arrives with {r.num_computed_tokens} cached positions and "
                                 f"only {self.blocks.num_free} blocks are free")
        self.blocks.admit(r.id, [])
        self.blocks.grow(r.id, r.num_computed_tokens)
        self.blocks.commit(r.id, r.tokens, r.num_computed_tokens)  # its full blocks are named at once: later prompts can hit

    def schedule(self, index: int) -> SchedulerOutput | None:
        """The plan of iteration `index`; None when no request gets a row: nothing has arrived yet and nothing runs
        (or waiting requests cannot get blocks while nothing runs: the engine refuses to spin on that)."""
        while self.pending and self.pending[0].arrival <= index:
            self.policy.enqueue(self.waiting, self.pending.popleft())
        c = self.config
        self._rows, self._left = {}, c.max_num_batched_tokens
        preempted: list[Request] = []
        self.preempted_waiting: list[int] = []
        ready = [r for r in self.running if r.id not in self.in_flight
                 or (c.chunk_pipelining and r.num_computed_tokens < len(r.tokens))]  # a prompt's next chunk
        decodes = [r for r in ready if r.decoding]
        carried = [r for r in ready if not r.decoding]
        cap = self.config.max_num_seqs if self.stages == 1 else self.microbatch_cap()
        spare = self._left - len(decodes)  # rows for proposals: what the budget holds beyond one row per decode
        for r in decodes + carried:  # decodes first: one row each (max_num_seqs <= budget: they always fit)
            if r in self.running and self._left > 0 and len(self._rows) < cap:
                if not r.decoding:
                    self._reserve(r, c.long_prefill_token_threshold, preempted)
                elif self._reserve(r, 1 + min(len(r.spec_token_ids), max(spare, 0)), preempted):
                    spare -= self._rows[r.id][1] - self._rows[r.id][0] - 1
        admitted, hits = [], 0
        while (self.waiting and self._left > 0 and len(self.running) < c.max_num_seqs
               and len(self._rows) < cap):
            r = self.waiting[0]
            external = 0  # tokens past the prefix hit that the KV connector supplies
            if r.id in self.preempted_waiting or any(self.policy.holds_back(v, r) for v in preempted):
                break  # preempted in this iteration: not admitted again at once, nor overtaken where the policy says
            if r.id in self.blocks.tables:  # its cached positions already hold blocks (a decode side placed them)
                fits = self.blocks.rows_that_fit(r.id, r.num_computed_tokens, 1) > 0
            elif r.num_computed_tokens > 0:  # arrives with cached positions: blocks for them and its first decode row, at once
                fits = self.blocks.blocks_for(r.num_computed_tokens + 1) <= self.blocks.num_free
            else:  # fresh, or preempted: blocks for its next chunk, which starts after its cached prefix
                # a request scoring its prompt computes every prompt row (vLLM's rule): no prefix hit; nor under h2o,
                # whose evictions follow the attention of the request's own queries (a hit would skip them)
                scoring = r.params is not None and r.params.prompt_logprobs is not None
                hit, need = self.blocks.admit_cost(r.tokens, min(c.long_prefill_token_threshold, self._left),
                                                   cached=not scoring and not (c.kv_eviction and c.kv_eviction.scored))
                if hit and c.kv_eviction is not None and need > c.peak_blocks():  # a prefix hit would take more
                    hit, need = self.blocks.admit_cost(r.tokens, min(c.long_prefill_token_threshold, self._left),
                                                       cached=False)  # blocks than eviction ever lets it hold
                if self.connector is not None and not scoring:
                    external = self.connector.get_num_new_matched_tokens(r, len(hit) * self.blocks.block_size)
                    if external:
                        need = self.blocks.admit_need(r.tokens, min(c.long_prefill_token_threshold, self._left), hit,
                                                      external)
                if c.reserve_capacity:
                    need = self.blocks.blocks_for(r.capacity)
                fits = need <= self.blocks.num_free
            if not fits:  # nobody overtakes the head of the queue; a request waiting behind it that holds blocks
                # (placed by a decode side) gives them back for it
                holder = next((w for w in reversed(self.waiting) if w is not r and w.id in self.blocks.tables), None)
                if holder is None:
                    break
                self._preempt(holder, preempted, waiting=True)
                continue
            if r.id not in self.blocks.tables and r.num_computed_tokens > 0:
                self.hold_computed(r)
            elif r.id not in self.blocks.tables:
                self.blocks.admit(r.id, hit)
                if c.reserve_capacity:
                    self.blocks.grow(r.id, r.capacity)
                r.num_computed_tokens = len(hit) * self.blocks.block_size
                if external:  # fresh blocks, filled by the connector before the step's layers read them
                    self.blocks.grow(r.id, r.num_computed_tokens + external)
                    self.connector.update_state_after_alloc(r, self.blocks.tables[r.id][len(hit):], external)
                    r.num_computed_tokens += external
                    self.blocks.commit(r.id, r.tokens, r.num_computed_tokens)
                if c.kv_eviction is not None:  # a new admission: its evictions, from the first position it computes
                    r.evictions.append((len(r.output), r.num_computed_tokens, []))
                hits += min(r.num_computed_tokens, len(r.prompt))
                r.prefix_hit += min(r.num_computed_tokens, len(r.prompt))  # every admission: a resumed one may find its own
                if r.num_cached_tokens is None:
                    r.num_cached_tokens = min(r.num_computed_tokens, len(r.prompt))
            self.waiting.popleft()
            self.running.append(r)
            r.status = RequestStatus.RUNNING
            admitted.append(r.id)
            self._reserve(r, 1 if r.decoding else c.long_prefill_token_threshold, preempted)  # fits: checked above, never preempts
        for victim in preempted:  # back in the queue after admission (fcfs: at the front): not re-admitted at once
            self.policy.enqueue(self.waiting, victim, preempted=True)
        chunks = []
        for r in self.running:
            if r.id in self._rows:
                start, end = self._rows[r.id]
                chunks.append(ScheduledRequest(r.id, start, end, decode=r.decoding,
                                               sample=end >= len(r.tokens),
                                               blocks=tuple(self.blocks.tables[r.id]),
                                               spec=tuple(r.spec_token_ids[:end - len(r.tokens)]),
                                               window=None if c.kv_eviction is None else c.kv_eviction.window,
                                               scored=c.kv_eviction is not None and c.kv_eviction.scored))
        chunks.sort(key=lambda c: not c.decode)  # decodes first in the flat rows; stable: admission order inside
        if not chunks:
            return None
        plan = SchedulerOutput(index, tuple(chunks), tuple(admitted),
                               tuple(v.id for v in preempted) + tuple(self.preempted_waiting), hits)
        if self.connector is not None:  # what the connector's worker side does in this plan rides in it
            object.__setattr__(plan, "kv_connector_metadata", self.connector.build_connector_meta(plan))
        return plan

    def positions_held(self) -> int:
        """Token positions whose K,V the running requests hold once this iteration's rows are written (a shared
        prefix block counts once per request)."""
        return sum(self._rows[r.id][1] if r.id in self._rows else r.num_computed_tokens for r in self.running)

    def _reserve(self, r: Request, most: int, preempted: list[Request]) -> bool:
        """Give r its rows this iteration (at most `most`, the budget left and what fits in memory), growing its
        block table; with no block free, preempt the running request the policy picks until one is (r itself, if it
        is that request: the policy never picks one before it). False if r got no rows."""
        proposed = len(r.spec_token_ids) if r.decoding else 0  # a decode's proposals ride in the rows after its own
        want = min(most, len(r.tokens) + proposed - r.num_computed_tokens, self._left)
        while (rows := self.blocks.rows_that_fit(r.id, r.num_computed_tokens, want)) == 0:
            holder = next((w for w in reversed(self.waiting) if w.id in self.blocks.tables), None)
            if holder is not None:  # a handed-over request still waiting holds blocks: it gives them back first
                self._preempt(holder, preempted, waiting=True)
                continue
            victim = self.policy.victim([w for w in self.running if w.id not in self.in_flight])  # r at the latest
            if victim is r and self.in_flight:  # the other holders are in micro-batches in flight: r waits for
                return False  # them to come back rather than give up its blocks and recompute
            self._preempt(victim, preempted)
            if victim is r:
                return False
        self.blocks.grow(r.id, r.num_computed_tokens + rows)
        self._rows[r.id] = (r.num_computed_tokens, r.num_computed_tokens + rows)
        self._left -= rows
        return True

    def _evict(self, r: Request) -> None:
        """kv_eviction (serve/eviction.py): the blocks the policy drops go back to the pool, logged in r.evictions
        with the positions computed when they went."""
        policy, table = self.config.kv_eviction, self.blocks.tables[r.id]
        gone = policy.to_evict(table, r.num_computed_tokens, self.blocks.block_size, r.kv_scores, EVICTED)
        gone = [b for b in gone if table[b] != EVICTED]
        if not gone:
            return
        self.blocks.evict(r.id, gone)
        if not r.evictions:  # placed with its K,V (not admitted through a prefix lookup)
            r.evictions.append((len(r.output), 0, []))
        r.evictions[-1][2].extend((b, r.num_computed_tokens) for b in gone)

    def observe_scores(self, plan: SchedulerOutput, scores: list[float]) -> None:
        """kv_eviction h2o: an iteration's attention per logical block of each scheduled request (every rank's heads
        summed, plan order, len(c.blocks) numbers per chunk), added to the request's running totals."""
        at = 0
        for c in plan.scheduled:
            n, r = len(c.blocks), self.by_id.get(c.request)
            if r is not None and not r.finished:
                if len(r.kv_scores) < n:
                    r.kv_scores.extend([0.0] * (n - len(r.kv_scores)))
                for b in range(n):
                    r.kv_scores[b] += scores[at + b]
            at += n

    def _preempt(self, victim: Request, preempted: list[Request], waiting: bool = False) -> None:
        """waiting: the victim is a request not yet running that holds blocks (its K,V placed by a decode side); it
        keeps its place in the queue and recomputes its tokens when admitted, as any preempted request does."""
        if waiting:
            self.preempted_waiting.append(victim.id)
        else:
            self.running.remove(victim)
        self.blocks.release(victim.id)
        if victim.id in self._rows:  # scheduled earlier in this iteration: its rows are given back
            start, end = self._rows.pop(victim.id)
            self._left += end - start
        victim.num_computed_tokens = 0
        victim.spec_token_ids = []
        victim.kv_scores = []  # kv_eviction: it recomputes whole, its evictions start again at its next admission
        if victim.draft_computed is not None:  # a draft recomputes it whole: its blocks may come back as others'
            victim.draft_computed = 0
        victim.status = RequestStatus.PREEMPTED
        victim.preemptions += 1
        self.preemptions += 1
        if not waiting:
            preempted.append(victim)

    def update_from_output(self, plan: SchedulerOutput, sampled: dict[int, int | list[int]],
                           scores: list[float] | None = None) -> list[int]:
        """Apply an iteration's results (request id -> its new token, or a verified chunk's tokens: the accepted
        proposals and the target's own); return the ids that finished now, whose blocks are given back (their
        contents stay in the pool until reused: a hook may still read them). A verified request keeps the K,V of the
        rows whose tokens it now holds; blocks that held only rejected rows go back to the pool. scores: kv_eviction
        h2o's attention per block this iteration (observe_scores), before its evictions."""
        if scores is not None:
            self.observe_scores(plan, scores)
        finished = []
        for c in plan.scheduled:
            if c.request in self.in_flight:  # a pipeline's micro-batch back from the last stage
                self.in_flight[c.request] -= 1
                if not self.in_flight[c.request]:
                    del self.in_flight[c.request]
            r = self.by_id.get(c.request)
            if r is None or r.finished:  # aborted while its micro-batch was in flight (pipeline parallelism)
                continue
            r.num_computed_tokens = max(r.num_computed_tokens, c.q_end)  # a later chunk may have been dispatched already (a pipeline)
            if c.sample:
                before = len(r.output)
                new = sampled[c.request]
                for token in [new] if isinstance(new, int) else new:
                    if r.append_output_token(token):
                        finished.append(r.id)
                        break
                if c.spec:  # the rows up to the last accepted proposal hold K,V of the request's tokens
                    r.num_computed_tokens = c.q_start + len(r.output) - before
                    if not r.finished:
                        self.blocks.shrink(r.id, r.num_computed_tokens)
            # K,V written on every stage up to here (a draft model reads only what it wrote itself: serve/draft.py)
            self.blocks.commit(r.id, r.tokens, min(c.q_end, r.num_computed_tokens))
            if self.config.kv_eviction is not None and not r.finished:
                self._evict(r)
        for rid in finished:
            if self.connector is not None:
                self.connector.request_finished(self.by_id[rid], self.blocks.tables[rid])
            self.blocks.release(rid)
        if finished:
            self.running = [r for r in self.running if not r.finished]
        return finished


# ---- host-only planning loops: the engines' and P/D's replays share them, so they cannot drift apart ---------------

def next_plan(sched: Scheduler, index: int, before_schedule=None) -> tuple[SchedulerOutput | None, int]:
    """The plan of the next iteration that runs, from iteration `index` on, and its index. Iterations with nothing to
    run are skipped when a request arrives later (no forward for the idle stretch); waiting requests that can never
    get KV blocks raise instead of spinning; (None, index) when nothing is left. before_schedule(index): called before
    each iteration is planned. LLMEngine.step and the prefill schedule every P/D rank computes (serve/pd/) both
    plan with this."""
    while True:
        if before_schedule is not None:
            before_schedule(index)
        plan = sched.schedule(index)
        if plan is not None:
            return plan, index
        if sched.in_flight:  # a pipeline's micro-batches are still out: its ticks go on, one at a time
            return None, index
        upcoming = sched.next_arrival()  # after schedule(), always later than index when there is one
        if sched.waiting and not sched.running and upcoming is None:
            raise SchedulerError(f"iteration {index}: requests {[r.id for r in sched.waiting]} wait for KV blocks "
                                 f"that nothing running will give back ({sched.blocks.num_free} of "
                                 f"{sched.blocks.num_blocks} free); raise num_gpu_blocks_override")
        if upcoming is None:
            return None, index
        index = upcoming


def pipeline_schedule(sched: Scheduler, pp: int = 1, before_schedule=None):
    """The plans of a workload held from the start, in the order their tokens come back: PipelineEngine.step's ticks
    without the model over pp stages, LLMEngine's steps with pp = 1 (P/D's decode side knows from it what the
    prefill side will hand over, and in which order). The caller applies each plan's tokens
    (sched.update_from_output) before asking for the next."""
    sched.stages = pp
    queue, index = deque(), 0
    while sched.has_work() or queue:
        entered, index = next_plan(sched, index, before_schedule)
        if entered is not None:
            sched.dispatch(entered)
            queue.append((entered, index))
        if not queue:
            return
        if queue[0][1] == index - (pp - 1):
            yield queue.popleft()[0]
        index += 1


def check_request(config, model, num_blocks: int, block_bytes: int | None, ids: list[int], params: SamplingParams,
                  priority: int = 0) -> int:
    """Every rule a new request meets, in one call for the driver (LLM, before anything is sent) and for rank 0
    (LLMEngine.add_request, before its step's broadcast): the prompt (validate_prompt), the sampling settings under
    speculation, the priority under the scheduling policy. One-line ValueErrors naming the field; returns the
    request's output budget (output_budget)."""
    validate_prompt(ids, params.max_tokens, model.vocab_size, model.max_seq_len, num_blocks, config.block_size,
                    config.max_model_len, block_bytes, config.peak_blocks())
    check_speculation(config.speculative_config, params.logprobs, params.prompt_logprobs)
    check_priority(priority, config.scheduling_policy)
    return output_budget(len(ids), params.max_tokens, config.max_model_len or model.max_seq_len)
