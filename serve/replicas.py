"""Data parallelism behind one `LLM`: N replicas, each its own group of tp · pp · cp rank processes with its own KV
pool (serve/executor.py's MultiprocExecutor), and a router (serve/router.py) choosing each new request's replica.

`Replicas` speaks the executor's interface (call, send, poll, wait, check, exited, shutdown), so `LLM` and the server
run over it unchanged: a request goes to the replica the router picks and stays there; a step, a generate() run and
a server's stepping run on every replica at once (each replica's rank 0 steps on its own), their outputs merged as
they come; stats are summed over the replicas (each replica's own under "replicas").

A replica that dies (a rank failed or was killed) is said in one line on stderr and leaves the rotation; its
unfinished requests are computed again from their prompts on the others (a generate() or a step; `restarted` is
told of each, so the driver starts its text again), or, while a server runs, end as aborted (a stream cannot take
its tokens back). When none is left, the call raises as a lone executor does.
"""

from __future__ import annotations

import sys
import time

from serve.executor import MultiprocExecutor
from serve.router import Router


def replica_gpus(replicas: int, world_size: int) -> list[str | None]:
    """Each replica's GPUs (its CUDA_VISIBLE_DEVICES): replica i the i-th run of world_size GPUs of those this
    process sees. ValueError when there are too few."""
    import os

    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = [g for g in visible.split(",") if g.strip()] if visible is not None else \
        [str(g) for g in range(torch.cuda.device_count())]
    if len(gpus) < replicas * world_size:
        raise ValueError(f"data_parallel_size={replicas} replicas of {world_size} rank(s) need "
                         f"{replicas * world_size} GPUs, one per rank; {len(gpus)} are visible")
    return [",".join(gpus[i * world_size:(i + 1) * world_size]) for i in range(replicas)]


class Replicas:
    def __init__(self, spec, world_size: int, replicas: int, router: Router, restarted=None):
        """restarted(args): called with add_request's arguments (request id, ids, params, text, priority) of each
        request moved off a dead replica, before it runs again."""
        self.router, self.restarted = router, restarted
        self.executors: list[MultiprocExecutor] = []
        gpus = replica_gpus(replicas, world_size) if spec.device == "cuda" else [None] * replicas
        try:
            for i in range(replicas):
                self.executors.append(MultiprocExecutor(spec, world_size, gpus[i]))
        except BaseException:
            self.shutdown()
            raise
        self.info = self.executors[0].info
        self.alive = [True] * replicas
        self.owner: dict[str, int] = {}  # request id -> its replica (until it finishes)
        self.args: dict[str, tuple] = {}  # request id -> what add_request was given (to move it when a replica dies)
        self.stats_of: list[dict | None] = [None] * replicas
        self.mode: str | None = None  # "run" (generate) or "serve" while the replicas step on their own
        self.running: set[int] = set()  # "run": replicas still stepping
        self.aborted: list = []  # serve: outputs of requests whose replica died, to hand out
        self.lost_requests = 0
        self._moved: list[str] = []  # requests off a dead replica, to add to the others
        self._tokens: dict[str, list[int]] = {}  # each unfinished request's tokens so far (an abort carries them)
        self._turn = 0  # where the next scan for a message starts (every replica gets its turn)

    # -- the executor's interface ------------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return not any(self.alive) or all(e.closed for e in self.executors)

    def check(self, what: str, deadline: float | None = None) -> None:
        for i in self._live():
            self._guard(i, lambda e: e.check(what, deadline))
        self._need_one(what)

    def exited(self) -> list[tuple[int, int]]:
        return [rc for i in self._live() for rc in self.executors[i].exited()]

    def call(self, op: str, *args):
        if op == "add_request":
            return self._add(args, wait=True)
        if op == "abort_request":
            i = self.owner.get(args[0])
            return False if i is None else self._guard(i, lambda e: e.call(op, *args))
        if op == "has_unfinished_requests":
            if self._moved and self.mode is None:  # a death seen between steps: they run again from now
                moved, self._moved = self._moved, []
                self._readd(moved)
            return bool(self.owner or self._moved) or any(self._guard(i, lambda e: e.call(op)) for i in self._live())
        if op == "stats":
            for i in self._live():
                self._guard(i, lambda e, i=i: self.stats_of.__setitem__(i, e.call("stats")))
            return self.merged()
        if op == "step":
            outputs = []
            for i in self._live():
                self._guard(i, lambda e: e.send("step"))
            for i in self._live():
                self._guard(i, lambda e, i=i: outputs.extend(self._took(i, e.wait("step")[1])))
            self._need_one(op)
            moved, self._moved = self._moved, []
            self._readd(moved)
            return outputs, self.merged()
        return self._guard(0, lambda e: e.call(op, *args))

    def send(self, op: str, *args) -> None:
        if op == "add_nowait":
            self._add(args, wait=False)
        elif op == "abort_nowait":
            i = self.owner.get(args[0])
            if i is not None:
                self._guard(i, lambda e: e.send(op, *args))
        elif op in ("run", "serve"):
            self.mode = op
            self.running = set(self._live())
            for i in self._live():
                self._guard(i, lambda e: e.send(op))
        else:
            raise ValueError(f"{op}: not an operation of replicas")

    def poll(self, what: str, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while True:
            if self.aborted or any(self._guard(i, lambda e: e.poll(what, 0)) for i in self._waiting()):
                return True
            self._need_one(what)
            if self.mode == "run" and not self.running:
                return True
            if time.monotonic() >= end:
                return False
            time.sleep(0.005)

    def wait(self, what: str, deadline: float | None = None):
        """The next message of any replica: ("outputs", ...) as they come; a generate() run's ("ok", None) once every
        replica has ended it (requests moved off a dead replica run again first)."""
        while True:
            if self.aborted:
                outputs, self.aborted = self.aborted, []
                return "outputs", (outputs, self.merged()) if self.mode == "serve" else outputs
            if self.mode == "run" and not self.running:
                if self._pending_moved():
                    continue
                self.mode = None
                return "ok", None
            for i in list(self._waiting()):
                if not self._guard(i, lambda e: e.poll(what, 0)):
                    continue
                kind, value = self._guard(i, lambda e: e.wait(what, deadline), (None, None))
                if kind is None:
                    break
                self._turn = i + 1
                if kind == "ok":  # a replica's generate() run is over
                    self.running.discard(i)
                    break
                if self.mode == "serve":
                    return kind, (self._took(i, value), self.merged())
                return kind, self._took(i, (value, None))
            else:
                self._need_one(what)
                time.sleep(0.005)

    def shutdown(self) -> None:
        for e in self.executors:
            e.shutdown()

    def kill(self) -> None:
        for e in self.executors:
            e.kill()

    # -- the pieces --------------------------------------------------------------------------------------------------

    def _live(self) -> list[int]:
        return [i for i, up in enumerate(self.alive) if up]

    def _waiting(self) -> list[int]:
        """The replicas a message may come from, starting one past the last that sent (none starves)."""
        live = [i for i in self._live() if self.mode != "run" or i in self.running]
        return sorted(live, key=lambda i: (i - self._turn) % len(self.alive))

    def _need_one(self, what: str) -> None:
        if not any(self.alive):
            raise RuntimeError(f"{what}: every replica has died; every rank is stopped")

    def _guard(self, i: int, fn, lost=False):
        """fn(replica i's executor); a RuntimeError from a dead replica takes it out (_lose) and gives `lost`."""
        e = self.executors[i]
        try:
            return fn(e)
        except (RuntimeError, OSError, EOFError) as exc:
            if not e.closed and not isinstance(exc, RuntimeError):  # a broken pipe: has a rank exited?
                try:
                    e.check("replica")
                except RuntimeError as dead:
                    exc = dead
            if not e.closed:
                raise
            self._lose(i, exc)
            return lost

    def _lose(self, i: int, exc: Exception) -> None:
        if not self.alive[i]:
            return
        self.alive[i] = False
        self.running.discard(i)
        self.router.forget(i)
        moved = [rid for rid, owner in self.owner.items() if owner == i]
        for rid in moved:
            del self.owner[rid]
        self.lost_requests += len(moved)
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        verb = "end as aborted" if self.mode == "serve" else "run again on the others"
        print(f"replica {i} died ({first[:300]}); its {len(moved)} unfinished request(s) {verb}", file=sys.stderr,
              flush=True)
        if not any(self.alive):
            return
        if self.mode == "serve":
            from serve.outputs import CompletionOutput, RequestMetrics, RequestOutput

            for rid in moved:
                _, ids, _, text = self.args.pop(rid)[:4]
                done = CompletionOutput(0, "", self._tokens.pop(rid, []), "abort")  # the tokens it had streamed
                self.aborted.append(RequestOutput(rid, text, ids, [done], True, RequestMetrics(time.time())))
        else:
            self._moved += moved

    def _pending_moved(self) -> bool:
        """generate(): requests taken off a dead replica are added to the others and a new run starts; False if
        there were none."""
        moved, self._moved = self._moved, []
        if not moved:
            return False
        self._readd(moved)
        self.send("run")
        return True

    def _readd(self, moved: list[str]) -> None:
        for rid in moved:
            if self.restarted is not None:
                self.restarted(self.args[rid])
            self._add(self.args[rid], wait=True)

    def _add(self, args: tuple, wait: bool):
        rid, ids = args[0], args[1]
        while True:
            live = self._live()
            self._need_one("add_request")
            loads = [sum(1 for o in self.owner.values() if o == i) for i in range(len(self.alive))]
            i = self.router.route(ids, loads, self.alive)
            sent = self._guard(i, (lambda e: e.call("add_request", *args)) if wait else
                               (lambda e: e.send("add_nowait", *args)), lost=None)
            if self.alive[i]:
                break
        self.owner[rid], self.args[rid] = i, args
        return sent

    def _took(self, i: int, value):
        """A replica's step outputs: finished requests leave its count; its stats are kept."""
        outputs, stats = value
        if stats is not None:
            self.stats_of[i] = stats
        for o in outputs:
            if o.finished:
                self.owner.pop(o.request_id, None)
                self.args.pop(o.request_id, None)
                self._tokens.pop(o.request_id, None)
            elif self.mode == "serve":
                self._tokens[o.request_id] = list(o.outputs[0].token_ids)
        return outputs

    def merged(self) -> dict:
        """The live replicas' stats: counts summed (numbers, and dicts of numbers, key by key), anything else (a
        rate, a list, the last iteration's record) the first live replica's; each replica's own under "replicas"
        (a dead one's last), the router's decisions under "router"."""
        seen = [s for s, up in zip(self.stats_of, self.alive) if s is not None and up]
        out: dict = {}
        for s in seen:
            for k, v in s.items():
                if _count(k, v) and (k not in out or _count(k, out[k])):
                    out[k] = out.get(k, 0) + v
                elif isinstance(v, dict) and v and all(_count(k, x) for x in v.values()):
                    acc = out.setdefault(k, {})
                    for kk, x in v.items():
                        acc[kk] = acc.get(kk, 0) + x
                else:
                    out.setdefault(k, v)
        out["replicas"] = self.stats_of
        out["router"] = dict(self.router.decisions)
        out["replicas_alive"] = sum(self.alive)
        out["requests_moved"] = self.lost_requests
        return out


def _count(key: str, value) -> bool:
    """A stat that adds up over replicas: a number that is not a rate, a mean or a share."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and not any(word in key for word in ("rate", "mean", "share", "ratio")))
