"""The engine behind the HTTP server (docs/server.md, "How it runs"): one thread owns the `LLM` (its pipe to rank 0);
the server's handlers, on the asyncio loop, only put operations in its queue and read their requests' events.

    handlers (asyncio)  --ops queue-->  engine thread  --add/abort, no wait-->  rank 0: steps on its own while it
                        <--events---                   <--each step's outputs--  has work (LLM.serve) --★--> ranks

Rank 0 does not wait for this thread between steps (text, events, metrics and the log are off the step's path), and
a request added while others run joins the running batch at the step after the one running. Events a request's sink
receives, all of one turn's handed to the loop at once through `deliver` (without a loop: run on this thread):

    ("output", RequestOutput)   the request moved (cumulative tokens and text; finished=True at the end)
    ("error", APIError)         refused (400), timed out in the queue (503), or the engine failed (503)
    ("abort", None)             ended by the server's shutdown: after the grace period, or at once (drain(0))
"""

from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

from serve.api.protocol import APIError

IDLE_CHECK_S = 0.5  # with nothing live: how often the thread looks at the ranks
EXPECT_S = 1.0  # after an abort or a request's end: read the steps still coming for this long, without blocking


@dataclass
class Live:
    sink: Callable
    arrival: float  # time.monotonic() when submitted
    prompt_tokens: int
    first: float | None = None  # when its first token arrived here
    tokens: int = 0


def run_sinks(batch: list) -> None:
    """Each (sink, event) of a turn: the sink called with its event (on the server's loop, or on the engine thread)."""
    for sink, event in batch:
        sink(event)


class AsyncEngine:
    def __init__(self, llm, *, queue_timeout_s: float = 300.0, iteration_log: str | None = None, metrics=None,
                 on_failure: Callable[[], None] | None = None):
        self.llm, self.queue_timeout_s, self.metrics = llm, queue_timeout_s, metrics
        self.deliver: Callable[[list], None] = run_sinks  # takes [(sink, event), ...]: the server's loop runs them
        self._out: list = []  # this turn's (sink, event) pairs
        self.on_failure = on_failure
        self.failed: str | None = None  # why the engine failed (one line)
        self.detail: str | None = None
        self.stats: dict = llm.stats()  # rank 0's pool and queues, after the last step
        self.steps = 0
        self._ops: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, Live] = {}
        self._accepting = True
        self._deadline: float | None = None  # draining: live requests are aborted at this time
        self.drained = self.cut = 0  # while draining: requests that finished, requests aborted by the shutdown
        self._expect_until = 0.0  # steps may still come until then, with nothing live (an abort's)
        self._log = open(iteration_log, "w", buffering=1) if iteration_log else None
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.done = threading.Event()

    # -- the loop's side ---------------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, request_id: str, prompt_ids: list[int], text: str | None, params, sink: Callable,
               priority: int = 0) -> None:
        """Queue a request; its events go to sink (run on the server's loop through `deliver`, or on the engine thread
        without one). APIError(503) at once when the server is failing or shutting down (`refusal`)."""
        if (refused := self.refusal()) is not None:
            raise refused
        self._ops.put(("add", (request_id, prompt_ids, text, params, sink, time.monotonic(), priority)))
        if self.done.is_set():  # the thread ended between the check above and the put: answer it here
            self._refuse_queued()

    def abort(self, request_id: str) -> None:
        """The client is gone: abort at the next step, send it nothing more."""
        self._ops.put(("abort", request_id))

    def drain(self, grace_s: float) -> None:
        """Stop taking requests; live ones may finish for grace_s, then they are aborted and the ranks stopped. Called
        again (a second Ctrl-C: drain(0)), the earlier deadline holds."""
        self._accepting = False
        self._ops.put(("drain", time.monotonic() + grace_s))

    def exited_rank(self) -> str | None:
        """"rank R exited (code C)" for every rank process that has exited, a rank killed by a signal (the cause; the
        others fail after it) first; None while all run (a look at the processes only: nothing is sent to them)."""
        exited = self.llm.executor.exited() if not self.done.is_set() else []
        exited.sort(key=lambda rank_code: (rank_code[1] is None or rank_code[1] >= 0, rank_code[0]))
        return "; ".join(f"rank {r} exited (code {code})" for r, code in exited) or None

    def refusal(self, look_at_ranks: bool = False) -> APIError | None:
        """Why a new request is answered 503 now: the engine failed, or the server is shutting down; None while it
        accepts. look_at_ranks: a rank that has exited counts as failed at once (before the engine thread's look)."""
        failed = self.failed or (self.exited_rank() if look_at_ranks and self._accepting else None)
        if failed is not None:
            return APIError(503, f"the engine has failed: {failed}", code="engine_failed")
        return None if self._accepting else APIError(503, "the server is shutting down", code="shutting_down")

    @property
    def live(self) -> int:
        """Requests in flight (taken by the engine thread, not yet ended)."""
        return len(self._live)

    # -- the engine thread -------------------------------------------------------------------------------------------

    def _run(self) -> None:
        """Rank 0 steps on its own while it has work (LLM.serve): this thread sends it the queued operations (without
        waiting), and hands out each step's outputs as they come (text, events, metrics, the log), off the step's
        path. An operation lands in the step after the one running when it was sent."""
        try:
            self.llm.serve()
            while True:
                expecting = time.monotonic() < self._expect_until  # an abort's step, or a last one, to come
                self._take(block=not self._live and not expecting)
                self._expire()
                self._flush()
                if not self._live and self._deadline is not None:
                    return  # drained
                wait = IDLE_CHECK_S if self._live else 0.02 if expecting else 0.0
                outputs = self.llm.serve_outputs(wait)  # also: a dead rank raises
                if outputs is not None:  # one step's per turn: operations are taken between any two
                    self._hand_out(outputs, self.llm.last_stats)
                    self._flush()
        except BaseException as exc:  # noqa: BLE001 - a rank failed or died: every live request hears it
            self.detail = str(exc) or type(exc).__name__  # with the ranks' tracebacks: the server's log prints it
            self.failed = self.detail.splitlines()[0]
            self._accepting = False
            for live in self._live.values():
                self._emit(live.sink, ("error", self.refusal()))
            self._live.clear()
            self._flush()
            if self.on_failure is not None:
                self.on_failure()
        finally:
            self._accepting = False
            try:
                self.llm.shutdown()
            finally:
                self._refuse_queued()
                if self._log is not None:
                    self._log.close()
                self.done.set()

    def _refuse_queued(self) -> None:
        """The thread is ending: requests still in the queue are answered 503 (none is left waiting)."""
        why = self.refusal()
        for kind, arg in self._queued():
            if kind == "add":
                self._emit(arg[4], ("error", why))
        self._flush()

    def _take(self, block: bool) -> None:
        """Apply every queued operation; with block, wait up to IDLE_CHECK_S for the first."""
        for kind, arg in self._queued(block):
            if kind == "add":
                self._add(*arg)
            elif kind == "abort" and arg in self._live:
                self._abort(arg)
            elif kind == "drain":
                self._deadline = arg if self._deadline is None else min(self._deadline, arg)

    def _queued(self, block: bool = False):
        """The queued operations (kind, arg), in order, until the queue is empty; with block, the first is waited for
        up to IDLE_CHECK_S."""
        try:
            yield self._ops.get(timeout=IDLE_CHECK_S) if block else self._ops.get_nowait()
            while True:
                yield self._ops.get_nowait()
        except queue.Empty:
            return

    def _add(self, request_id, prompt_ids, text, params, sink, arrival, priority) -> None:
        if (refused := self.refusal()) is not None:
            self._emit(sink, ("error", refused))
            return
        try:
            self.llm.add_request(request_id, {"prompt_token_ids": prompt_ids, "prompt": text}, params, wait=False,
                                 priority=priority)
        except ValueError as exc:  # the request's checks: a FieldError names the field it refuses (OpenAI's param)
            self._emit(sink, ("error", APIError(400, str(exc), getattr(exc, "field", None))))
            return
        self._live[request_id] = Live(sink, arrival, len(prompt_ids))

    def _emit(self, sink: Callable, event: tuple) -> None:
        self._out.append((sink, event))

    def _flush(self) -> None:
        if self._out:
            batch, self._out = self._out, []
            self.deliver(batch)

    def _abort(self, request_id: str, event: tuple | None = None) -> None:
        """Abort a live request in the engine (client gone, queue timeout, shutdown): counted as ended with "abort";
        its sink hears `event` (None: nothing, its client is gone)."""
        live = self._live.pop(request_id)
        self.llm.abort_request(request_id, wait=False)
        self._expect_until = time.monotonic() + EXPECT_S
        if self.metrics is not None:
            self.metrics.finished("abort", live.prompt_tokens, live.tokens, None)
        if event is not None:
            self._emit(live.sink, event)

    def _expire(self) -> None:
        """Requests without a first token after queue_timeout_s are answered 503; past the drain's deadline, every
        live request is aborted."""
        now = time.monotonic()
        for rid, live in list(self._live.items()):
            if live.first is None and now - live.arrival > self.queue_timeout_s:
                self._abort(rid, ("error", APIError(503, f"no token after {now - live.arrival:.1f} s in the queue "
                                                         f"(the server's queue timeout is {self.queue_timeout_s:g} s); "
                                                         f"try again later", code="queue_timeout")))
        if self._deadline is not None and now >= self._deadline:
            self.cut += len(self._live)
            for rid in list(self._live):
                self._abort(rid, ("abort", None))

    def _hand_out(self, outputs: list, stats: dict) -> None:
        outputs = self.llm.detokenize(outputs)
        self.stats = stats
        self.steps += 1
        now = time.monotonic()
        new_tokens, first, finished, aborted = {}, [], {}, []
        for o in outputs:
            live = self._live.get(o.request_id)
            if live is None:  # aborted here already (its client is gone): this step applied the abort
                if o.finished and o.outputs[0].finish_reason == "abort":
                    aborted.append(o.request_id)
                continue
            n = len(o.outputs[0].token_ids)
            if n > live.tokens:
                new_tokens[o.request_id] = n - live.tokens
                if live.first is None:
                    live.first = now
                    first.append(o.request_id)
                    if self.metrics is not None:
                        self.metrics.first_token(now - live.arrival)
                live.tokens = n
            if o.finished:
                del self._live[o.request_id]
                self._expect_until = time.monotonic() + EXPECT_S  # a stop string's abort step may follow
                finished[o.request_id] = o.outputs[0].finish_reason
                self.drained += not self._accepting  # drain() was called
                if self.metrics is not None:
                    self.metrics.finished(o.outputs[0].finish_reason, live.prompt_tokens, n,
                                          (now - live.first) / (n - 1) if live.first is not None and n > 1 else None)
            self._emit(live.sink, ("output", o))
        if self.metrics is not None:
            self.metrics.generated(sum(new_tokens.values()))
        if self._log is not None:
            s = self.stats
            self._log.write(json.dumps({"step": self.steps, "t": round(now - self._start, 6),
                                        "running": s["running"], "waiting": s["waiting"],
                                        "free_blocks": s["free_blocks"], "tokens": new_tokens, "first": first,
                                        "finished": finished, "aborted": aborted}) + "\n")
