"""ORCA iteration-level scheduling with chunked prefill over a paged KV cache, on host data only (no torch, no
collectives).

Between two iterations, and identically on every rank:

    finish   a request leaves the moment it finishes (max_new_tokens reached, or eos_id sampled); `update`
             returns it and gives its blocks back
    carry    every running request with one token left to compute contributes exactly one decode row;
             they are scheduled first
    chunk    running requests with more left get their next chunk: at most chunk_size rows, and never more
             than the budget max_batched_tokens has left this iteration
    admit    waiting requests (arrived, not running; preempted ones first), oldest first, while budget, the
             running limit (max_running, at most max_batched_tokens) and free blocks allow; each brings its
             first chunk in the same iteration, starting after the longest run of cached full blocks its prompt
             shares with earlier requests (prefix caching), or its first decode row if it arrives with its
             prompt already in the cache (a decode side taking over prefilled requests, serve/pd/)
    preempt  a running request that needs a block when none is free takes one from a waiting request that holds
             blocks (a decode side's handed-over request not yet admitted), else from the most recently admitted
             running request (itself, if it is that one): the victim gives every block back and waits again,
             to recompute its prompt and the tokens it generated so far (vLLM's preemption by recompute;
             greedy tokens come out the same). So only running requests ever hold blocks for long, and a pool
             that holds each request alone always makes progress

Memory: a BlockManager (serve/block_manager.py) holds every request's block table; a plan's chunks carry the
tables, so the engine turns a plan into slot mappings without asking anything else. A request's state is
how many of its tokens have K,V in the cache (`computed`): the next iteration gives it rows
[computed, min(len(tokens), computed + chunk)). There is no prefill phase and decode phase, only tokens not yet
computed (as in vLLM's v1 scheduler).
"""

from __future__ import annotations

from collections import Counter, deque

from serve.block_manager import BlockManager
from serve.config import EngineConfig
from serve.plan import Chunk, IterationPlan
from serve.request import Request, RequestStatus
from tp.partition import ceil_div


class SchedulerError(ValueError):
    """Settings with which the scheduler cannot make progress."""


def blocks_needed(request: Request, block_size: int) -> int:
    """Blocks one request holds at its largest, alone."""
    return ceil_div(request.capacity, block_size)


def worst_case_blocks(requests: list[Request], block_size: int) -> int:
    """kv_blocks = null: every request at its largest at once, so a run never preempts."""
    return max(1, sum(blocks_needed(r, block_size) for r in requests))


class Scheduler:
    def __init__(self, requests: list[Request], chunk_size: int, max_batched_tokens: int,
                 max_running: int | None = None, eos_id: int | None = None, blocks: BlockManager | None = None,
                 reserve_capacity: bool = EngineConfig.reserve_capacity):
        if chunk_size < 1:
            raise SchedulerError(f"chunk_size={chunk_size} must be at least 1")
        if max_batched_tokens < 1:
            raise SchedulerError(f"max_batched_tokens={max_batched_tokens} must be at least 1")
        max_running = max_batched_tokens if max_running is None else max_running
        if max_running < 1:
            raise SchedulerError(f"max_running={max_running} must be at least 1")
        if max_running > max_batched_tokens:
            raise SchedulerError(
                f"max_batched_tokens={max_batched_tokens} is smaller than a full decode batch of "
                f"max_running={max_running} requests (each running request needs one row per iteration); "
                f"raise max_batched_tokens or lower max_running")
        # None: the pre-paging scheduler's world, memory for every request at its largest and nothing shared
        bs = EngineConfig.block_size
        self.blocks = blocks or BlockManager(worst_case_blocks(requests, bs), bs, prefix_cache=False)
        too_big = [r for r in requests if blocks_needed(r, self.blocks.block_size) > self.blocks.num_blocks]
        if too_big:
            self.check_fits(max(too_big, key=lambda r: r.capacity))
        if reserve_capacity and self.blocks.prefix_cache:
            raise SchedulerError("reserve_capacity (the pre-paging rule) shares nothing: turn prefix_cache off")
        # The pre-paging rule, kept to measure what paging frees: a request takes blocks for its whole capacity
        # (prompt + max_new_tokens - 1) when admitted; with block_size 1, one contiguous region's worth.
        self.reserve_capacity = reserve_capacity
        self._rows: dict[int, tuple[int, int]] = {}  # this iteration: request -> its rows (q_start, q_end)
        self._left = 0  # this iteration: rows of the budget not given yet
        self.chunk_size = chunk_size
        self.budget = max_batched_tokens
        self.max_running = max_running
        self.eos_id = eos_id
        self.preemptions = 0
        self.preempted_waiting: list[int] = []  # this iteration: waiting requests that gave their blocks back
        # Requests that already hold cache at iteration 0 (built mid-stream, e.g. to replay a trace) start
        # running; one that holds cache but arrives later (handed over by a prefill group) waits for its arrival.
        self.running = [r for r in requests if r.computed > 0 and r.arrival <= 0 and not r.finished]
        if len(self.running) > max_running:
            raise SchedulerError(f"{len(self.running)} requests start mid-stream, more than max_running={max_running}")
        for r in self.running:
            self.hold_computed(r)
            r.status = RequestStatus.RUNNING
        started = {r.id for r in self.running}
        self.pending = deque(sorted((r for r in requests if r.id not in started and not r.finished),
                                    key=lambda r: (r.arrival, r.id)))
        self.waiting: deque[Request] = deque()
        self.by_id = {r.id: r for r in requests}
        # Pipeline parallelism (serve/pipeline.py's PipelineEngine): requests in micro-batches that have not come
        # back from the last stage, and in how many. They get no rows and are never preempted until they have (vLLM
        # V1's batch queue); with chunk_pipelining, a prompt whose chunk is in flight may still get its next chunk
        # (its `computed` counts the rows dispatched). Each micro-batch takes at most share() of the requests, so
        # that pp micro-batches can be in flight.
        self.in_flight: Counter[int] = Counter()
        self.stages = 1
        self.chunk_pipelining = EngineConfig.chunk_pipelining  # the PipelineEngine sets both from its config

    def check_fits(self, r: Request) -> None:
        """SchedulerError unless the pool can hold r alone at its largest."""
        need = blocks_needed(r, self.blocks.block_size)
        if need > self.blocks.num_blocks:
            raise SchedulerError(
                f"kv_blocks={self.blocks.num_blocks} cannot hold request {r.id} even alone: prompt {len(r.prompt)} + "
                f"max_new_tokens {r.max_new_tokens} - 1 = {r.capacity} positions need {need} blocks of "
                f"block_size={self.blocks.block_size}; raise kv_blocks to at least {need}")

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

    def dispatch(self, plan: IterationPlan) -> None:
        """A pipeline: the plan's micro-batch enters the first stage. Its requests are in flight until update(plan),
        and each request's `computed` counts its dispatched rows (its next chunk, if it may have one, starts there)."""
        for c in plan.chunks:
            self.in_flight[c.request] += 1
            self.by_id[c.request].computed = c.q_end

    def share(self) -> int:
        """The most requests one micro-batch takes: all of them with one stage; with pp stages, 1/pp of the requests
        that could run (running, and waiting up to max_running), rounded up, so that pp micro-batches of about equal
        size can be in flight at once."""
        if self.stages == 1:
            return self.max_running
        return max(1, -(-min(self.max_running, len(self.running) + len(self.waiting)) // self.stages))

    def next_arrival(self) -> int | None:
        return self.pending[0].arrival if self.pending else None

    def add_computed(self, r: Request, index: int) -> None:
        """A request arriving at iteration `index` with the K,V of its first r.computed positions already computed
        (a P/D decode side takes a handed-over request in): blocks for those positions now, their K,V written by
        the caller; then it waits for admission like any request, holding its blocks (a running request that
        needs one takes them back first: it recomputes when admitted, as any preempted request does)."""
        self.check_fits(r)
        r.arrival = index
        self.hold_computed(r)
        self.add(r)

    def hold_computed(self, r: Request) -> None:
        """Blocks for the `computed` positions a request brings with it (resumed mid-stream, or handed over)."""
        if self.blocks.blocks_for(r.computed) > self.blocks.num_free:
            raise SchedulerError(f"request {r.id} arrives with {r.computed} cached positions and "
                                 f"only {self.blocks.num_free} blocks are free")
        self.blocks.admit(r.id, [])
        self.blocks.grow(r.id, r.computed)
        self.blocks.commit(r.id, r.tokens, r.computed)  # its full blocks are named at once: later prompts can hit

    def schedule(self, index: int) -> IterationPlan | None:
        """The plan of iteration `index`; None when no request gets a row: nothing has arrived yet and nothing runs
        (or waiting requests cannot get blocks while nothing runs: the engine refuses to spin on that)."""
        while self.pending and self.pending[0].arrival <= index:
            self.waiting.append(self.pending.popleft())
        self._rows, self._left = {}, self.budget
        preempted: list[Request] = []
        self.preempted_waiting: list[int] = []
        ready = [r for r in self.running if r.id not in self.in_flight
                 or (self.chunk_pipelining and r.computed < len(r.tokens))]  # a prompt's next chunk
        decodes = [r for r in ready if r.decoding]
        carried = [r for r in ready if not r.decoding]
        share = self.share()
        for r in decodes + carried:  # decodes first: one row each (max_running <= budget: they always fit)
            if r in self.running and self._left > 0 and len(self._rows) < share:
                self._reserve(r, 1 if r.decoding else self.chunk_size, preempted)
        admitted, hits = [], 0
        while (self.waiting and self._left > 0 and len(self.running) < self.max_running
               and len(self._rows) < share):
            r = self.waiting[0]
            if r.id in self.preempted_waiting:  # preempted in this iteration: not admitted again at once
                break
            if r.id in self.blocks.tables:  # its cached positions already hold blocks (a decode side placed them)
                fits = self.blocks.rows_that_fit(r.id, r.computed, 1) > 0
            elif r.computed > 0:  # arrives with cached positions: blocks for them and its first decode row, at once
                fits = self.blocks.blocks_for(r.computed + 1) <= self.blocks.num_free
            else:  # fresh, or preempted: blocks for its next chunk, which starts after its cached prefix
                hit, need = self.blocks.admit_cost(r.tokens, min(self.chunk_size, self._left))
                if self.reserve_capacity:
                    need = self.blocks.blocks_for(r.capacity)
                fits = need <= self.blocks.num_free
            if not fits:  # first come, first served: nobody overtakes the oldest waiting request; a request waiting
                # behind it that holds blocks (placed by a decode side) gives them back for it
                holder = next((w for w in reversed(self.waiting) if w is not r and w.id in self.blocks.tables), None)
                if holder is None:
                    break
                self._preempt(holder, preempted, waiting=True)
                continue
            if r.id not in self.blocks.tables and r.computed > 0:
                self.hold_computed(r)
            elif r.id not in self.blocks.tables:
                self.blocks.admit(r.id, hit)
                if self.reserve_capacity:
                    self.blocks.grow(r.id, r.capacity)
                r.computed = len(hit) * self.blocks.block_size
                hits += min(r.computed, len(r.prompt))
                r.prefix_hit += min(r.computed, len(r.prompt))  # every admission: a resumed one may find its own
                if r.num_cached_tokens is None:
                    r.num_cached_tokens = min(r.computed, len(r.prompt))
            self.waiting.popleft()
            self.running.append(r)
            r.status = RequestStatus.RUNNING
            admitted.append(r.id)
            self._reserve(r, 1 if r.decoding else self.chunk_size, preempted)  # fits: checked above, never preempts
        for victim in preempted:  # back to the front of the queue, after admission: not re-admitted at once
            self.waiting.appendleft(victim)
        chunks = []
        for r in self.running:
            if r.id in self._rows:
                start, end = self._rows[r.id]
                chunks.append(Chunk(r.id, start, end, decode=r.decoding, sample=end == len(r.tokens),
                                    blocks=tuple(self.blocks.tables[r.id])))
        chunks.sort(key=lambda c: not c.decode)  # decodes first in the flat rows; stable: admission order inside
        if not chunks:
            return None
        return IterationPlan(index, tuple(chunks), tuple(admitted),
                             tuple(v.id for v in preempted) + tuple(self.preempted_waiting), hits)

    def positions_held(self) -> int:
        """Token positions whose K,V the running requests hold once this iteration's rows are written (a shared
        prefix block counts once per request)."""
        return sum(self._rows[r.id][1] if r.id in self._rows else r.computed for r in self.running)

    def _reserve(self, r: Request, most: int, preempted: list[Request]) -> bool:
        """Give r its rows this iteration (at most `most`, the budget left and what fits in memory), growing its
        block table; with no block free, preempt the most recently admitted running request until one is (r
        itself, if it is that request). False if r got no rows."""
        want = min(most, len(r.tokens) - r.computed, self._left)
        while (rows := self.blocks.rows_that_fit(r.id, r.computed, want)) == 0:
            holder = next((w for w in reversed(self.waiting) if w.id in self.blocks.tables), None)
            if holder is not None:  # a handed-over request still waiting holds blocks: it gives them back first
                self._preempt(holder, preempted, waiting=True)
                continue
            victim = next(w for w in reversed(self.running) if w.id not in self.in_flight)  # r at the latest
            if victim is r and self.in_flight:  # the other holders are in micro-batches in flight: r waits for
                return False  # them to come back rather than give up its blocks and recompute
            self._preempt(victim, preempted)
            if victim is r:
                return False
        self.blocks.grow(r.id, r.computed + rows)
        self._rows[r.id] = (r.computed, r.computed + rows)
        self._left -= rows
        return True

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
        victim.computed = 0
        victim.status = RequestStatus.PREEMPTED
        victim.preemptions += 1
        self.preemptions += 1
        if not waiting:
            preempted.append(victim)

    def update(self, plan: IterationPlan, sampled: dict[int, int]) -> list[int]:
        """Apply an iteration's results (request id -> new token); return the ids that finished now, whose blocks
        are given back (their contents stay in the pool until reused: a hook may still read them)."""
        finished = []
        for c in plan.chunks:
            if c.request in self.in_flight:  # a pipeline's micro-batch back from the last stage
                self.in_flight[c.request] -= 1
                if not self.in_flight[c.request]:
                    del self.in_flight[c.request]
            r = self.by_id.get(c.request)
            if r is None or r.finished:  # aborted while its micro-batch was in flight (pipeline parallelism)
                continue
            r.computed = max(r.computed, c.q_end)  # a later chunk may have been dispatched already (a pipeline)
            if c.sample:
                if r.append(sampled[c.request], self.eos_id):
                    finished.append(r.id)
            self.blocks.commit(r.id, r.tokens, c.q_end)  # K,V written on every stage up to here
        for rid in finished:
            self.blocks.release(rid)
        if finished:
            self.running = [r for r in self.running if not r.finished]
        return finished
