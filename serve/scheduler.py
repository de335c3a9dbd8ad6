"""ORCA iteration-level scheduling with chunked prefill, on host data only (no torch, no collectives).

Between two iterations, and identically on every rank:

    evict   a request leaves the moment it finishes (max_new_tokens reached, or eos_id sampled);
            `update` returns it so the engine frees its cache
    carry   every running request whose prompt is done contributes exactly one decode row;
            they are scheduled first
    chunk   running requests with prompt left get their next chunk: at most chunk_size rows,
            and never more than the budget max_batched_tokens has left this iteration
    admit   waiting requests (arrived, not yet running) join, oldest first, while budget and
            the running limit (max_running, at most max_batched_tokens) allow; each brings its
            first chunk in the same iteration (or its first decode row, if it arrives with its
            prompt already in the cache: a decode side taking over prefilled requests, serve/disagg.py)

A request's state is how many of its tokens have K,V in the cache (`computed`): the next
iteration gives it rows [computed, min(len(tokens), computed + chunk)). There is no prefill
phase and decode phase, only tokens not yet computed (as in vLLM's v1 scheduler).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from serve.plan import Chunk, IterationPlan


class SchedulerError(ValueError):
    """Settings with which the scheduler cannot make progress."""


@dataclass
class Request:
    id: int
    prompt: list[int]
    max_new_tokens: int
    arrival: int = 0  # the iteration at which it arrives
    output: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose K,V are cached (a request built mid-stream may start above 0)
    finished: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def prompt_done(self) -> bool:
        return self.computed >= len(self.prompt)

    @property
    def capacity(self) -> int:
        """Cache rows it can ever need: the last sampled token's K,V are never computed."""
        return len(self.prompt) + self.max_new_tokens - 1


class Scheduler:
    def __init__(self, requests: list[Request], chunk_size: int, max_batched_tokens: int,
                 max_running: int | None = None, eos_id: int | None = None):
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
        self.chunk_size = chunk_size
        self.budget = max_batched_tokens
        self.max_running = max_running
        self.eos_id = eos_id
        # Requests that already hold cache at iteration 0 (built mid-stream, e.g. to replay a trace) start
        # running; one that holds cache but arrives later (handed over by a prefill group) waits for its arrival.
        self.running = [r for r in requests if r.computed > 0 and r.arrival <= 0 and not r.finished]
        if len(self.running) > max_running:
            raise SchedulerError(f"{len(self.running)} requests start mid-stream, more than max_running={max_running}")
        started = {r.id for r in self.running}
        self.pending = deque(sorted((r for r in requests if r.id not in started and not r.finished),
                                    key=lambda r: (r.arrival, r.id)))
        self.waiting: deque[Request] = deque()
        self.by_id = {r.id: r for r in requests}

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.pending)

    def next_arrival(self) -> int | None:
        return self.pending[0].arrival if self.pending else None

    def arrive(self, request_id: int, index: int) -> None:
        """A pending request arrives now, at iteration `index`, whatever its planned arrival was (a decode side
        takes a request in when its hand-over completes); a finished one just leaves the pending queue."""
        r = self.by_id[request_id]
        self.pending.remove(r)
        r.arrival = index
        if not r.finished:
            self.waiting.append(r)

    def schedule(self, index: int) -> IterationPlan | None:
        """The plan of iteration `index`; None when nothing has arrived yet and nothing runs."""
        while self.pending and self.pending[0].arrival <= index:
            r = self.pending.popleft()
            if not r.finished:  # a handed-over request can finish on arrival (its first token was eos_id)
                self.waiting.append(r)
        budget, chunks, admitted = self.budget, [], []
        for r in self.running:  # decodes first: one row each
            if r.prompt_done:
                chunks.append(Chunk(r.id, r.computed, r.computed + 1, decode=True, sample=True))
                budget -= 1
        for r in self.running:  # carried prompts: their next chunk
            if not r.prompt_done and budget > 0:
                budget -= self._chunk(r, budget, chunks)
        while self.waiting and budget > 0 and len(self.running) < self.max_running:  # admit
            r = self.waiting.popleft()
            self.running.append(r)
            admitted.append(r.id)
            if r.prompt_done:  # arrived with its prompt cached: a decode row at once
                chunks.append(Chunk(r.id, r.computed, r.computed + 1, decode=True, sample=True))
                budget -= 1
            else:
                budget -= self._chunk(r, budget, chunks)
        if not chunks:
            return None
        return IterationPlan(index, tuple(chunks), tuple(admitted))

    def _chunk(self, r: Request, budget: int, chunks: list[Chunk]) -> int:
        rows = min(self.chunk_size, len(r.prompt) - r.computed, budget)
        end = r.computed + rows
        chunks.append(Chunk(r.id, r.computed, end, decode=False, sample=end == len(r.prompt)))
        return rows

    def update(self, plan: IterationPlan, sampled: dict[int, int]) -> list[int]:
        """Apply an iteration's results (request id -> new token); return the ids evicted now."""
        evicted = []
        for c in plan.chunks:
            r = self.by_id[c.request]
            r.computed = c.q_end
            if c.sample:
                token = sampled[c.request]
                r.output.append(token)
                if len(r.output) >= r.max_new_tokens or token == self.eos_id:
                    r.finished = True
                    evicted.append(r.id)
        if evicted:
            self.running = [r for r in self.running if not r.finished]
        return evicted
