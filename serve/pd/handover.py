"""The hand-over: each completed prompt's K,V (and token 1) from the prefill ranks that hold its heads to the decode
ranks that need them, by point-to-point messages: P/D's KV connector (serve/kv_connector/base.py's seam), its two
sides on the groups' engines (PrefillSide, kv_role kv_producer, sends; DecodeSide, kv_consumer, receives and adds
the request to its engine). Every message goes into the traffic ledger.

    PrefillSide   build_connector_meta(plan)   the prompts the plan completes, and their slots
                  save_kv_layer(layer)         streaming: that layer's K,V of each, as soon as the layer has run
                  request_finished(request)    token 1 (and, not streaming, every layer's K,V) once it is sampled
    DecodeSide    update_connector_output      before each iteration is planned: post receives ahead, agree (★) on
                                               the groups landed everywhere, add their requests with their K,V
                  has_pending                  hand-overs still to come"""

from __future__ import annotations

import contextlib
import datetime
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from serve.block_manager import slots_of
from serve.kv_connector.base import KVConnectorBase
from serve.kv_cache import KVPool
from serve.plan import SchedulerOutput
from serve.pd.plan import Layout
from serve.request import RequestStatus
from serve.request import Request
from serve.scheduler import Scheduler
from tp.dist import DEFAULT_TIMEOUT_S, control_device, host_control
from tp.ledger import TrafficLedger, TransferRecord
from tp.partition import kv_head_range
from tp.traffic_model import pd_pairs, token_sources


def _tag(request: int, layer: int | None, n_layers: int, token: bool = False) -> int:
    """gloo matches messages by (peer, tag): one tag per request and message (a layer's K,V, every layer's, its first
    token; NCCL keeps them in order)."""
    return request * (n_layers + 2) + (n_layers + 1 if token else n_layers if layer is None else layer)


class HandoverTimeout(RuntimeError):
    """A point-to-point message of the hand-over did not complete in time (the peer died, hung, or never sent it)."""


class _Waiter:
    """A thread that waits for point-to-point works in the order they were posted, then calls done(error).

    The serving loop cannot poll them itself: a gloo work reports completion only to wait(), and NCCL's wait()
    only makes the calling thread's current CUDA stream wait, so on a GPU this thread waits on a stream of its
    own and synchronizes that stream (never the device: the compute stream keeps running). Every wait is bounded
    by `timeout_s`; the error names the message (request, layer) and the pair. A daemon thread: after a failure
    nobody joins it, and it dies with the process."""

    def __init__(self, device: torch.device, timeout_s: float):
        self.device, self.timeout_s = device, timeout_s
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="pd-waiter", daemon=True)
        self.thread.start()

    def submit(self, works: list, labels: list[str], done) -> None:
        self.queue.put((works, labels, done))

    def _run(self) -> None:
        stream = None
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            stream = torch.cuda.Stream()
        timeout = datetime.timedelta(seconds=self.timeout_s)
        while (item := self.queue.get()) is not None:
            works, labels, done = item
            error = None
            label = ""
            try:
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    for work, label in zip(works, labels):
                        if not work.wait(timeout):
                            raise HandoverTimeout(f"{label}: not complete after pd.timeout_s={self.timeout_s:g} s")
                if stream is not None:
                    stream.synchronize()
            except HandoverTimeout as exc:
                error = exc
            except Exception as exc:  # the peer died, or the process group timed out
                first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                error = HandoverTimeout(f"{label}: {first_line}")
            done(error)

    def close(self, join: bool = True) -> None:
        self.queue.put(None)
        if join:
            self.thread.join()


def _label(fields: tuple) -> str:
    """One message in words: 'pd/kv of request 3, layer 2, prefill rank 0 -> decode rank 2'."""
    kind, site, rid, layer, rank, peer, _ = fields
    src, dst = (rank, peer) if kind == "send" else (peer, rank)
    what = f"{site} of request {rid}" if rid >= 0 else site
    return f"{what}{'' if layer is None else f', layer {layer}'}, prefill rank {src} -> decode rank {dst}"


def warm_up_pairs(cfg, layout: Layout, rank: int, ledger: TrafficLedger, device: torch.device,
                  timeout_s: float) -> None:
    """One message per (prefill rank, decode rank) pair before anything is served, so NCCL's pair communicators exist
    before the first streamed layer's send (docs/pd.md, "Safe on NCCL"). Pairs go in one global order, each waited for
    before the next, so the smallest pending pair always has both ends at it: no deadlock. Ledgered as "pd/warm-up"."""
    token = torch.zeros(1, dtype=torch.int64, device=device)
    for r, s, *_ in pd_pairs(cfg.n_kv_heads, cfg.n_layers, layout.prefill_ranks, layout.decode_ranks,
                             layout.prefill_pp):
        d = layout.prefill_ranks + s
        if rank not in (r, d):
            continue
        fields = ("send", "pd/warm-up", -1, None, r, d, (0, 0)) if rank == r else \
            ("recv", "pd/warm-up", -1, None, d, r, (0, 0))
        posted = time.perf_counter()
        work = dist.isend(token, dst=d, tag=_WARM_UP_TAG) if rank == r else dist.irecv(token, src=r, tag=_WARM_UP_TAG)
        if not work.wait(datetime.timedelta(seconds=timeout_s)):
            raise HandoverTimeout(f"{_label(fields)}: not complete after pd.timeout_s={timeout_s:g} s")
        ledger.transfer(_record(fields, token, time.perf_counter() - posted))


_WARM_UP_TAG = 2**30  # above every request's tags for any workload that fits in memory


class PrefillSide(KVConnectorBase):
    """Sends each completed prompt's K,V (its own heads' share to each overlapping decode rank) and token 1."""

    def __init__(self, lm, layout: Layout, rank: int, streaming: bool, ledger: TrafficLedger, handed: set[int],
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        """lm: this rank's TPLM, or its pipeline stage's PPLM (layout.prefill_pp > 1: it holds and sends its stage's
        layers only)."""
        cfg = getattr(lm, "model_cfg", lm.cfg)  # the whole model's (a stage's lm.cfg counts its own layers)
        self.cfg, self.layout, self.rank, self.streaming, self.ledger, self.handed = \
            cfg, layout, rank, streaming, ledger, handed
        pairs = pd_pairs(cfg.n_kv_heads, cfg.n_layers, layout.prefill_ranks, layout.decode_ranks, layout.prefill_pp)
        self.peers = [(layout.prefill_ranks + s, lo, hi) for r, s, lo, hi, _ in pairs if r == rank]
        self.layers = next((layers for r, *_, layers in pairs if r == rank), range(0))  # this rank's, in the model
        first = token_sources(pairs, cfg.n_layers)  # a last-stage rank: its token follows its K,V on the pair
        self.token_peers = [layout.prefill_ranks + s for s, r in sorted(first.items()) if r == rank]
        tp = layout.prefill_ranks // layout.prefill_pp
        self.first_head = kv_head_range(cfg.n_kv_heads, rank % tp, tp).start  # of this rank's cache
        self.cache: KVPool | None = None
        self.sched: Scheduler | None = None
        self.engine = None
        self.slots: dict[int, torch.Tensor] = {}  # request -> the slots of its prompt's K,V [0, N), until sent
        self.finishing: dict[int, torch.Tensor] = {}  # the plan running now (one group): its prompts' slots
        self.by_plan: dict[int, dict[int, torch.Tensor]] = {}  # each plan in flight: its requests' slots
        self.waiter = _Waiter(next(lm.parameters()).device, timeout_s)  # records each send once it completes
        self.error: Exception | None = None
        self.done_at: dict[int, float] = {}

    def attach(self, engine) -> None:
        super().attach(engine)
        self.sched, self.cache = engine.scheduler, engine.runner.cache

    def per_layer(self) -> tuple[bool, bool]:
        return False, self.streaming  # sent after the prefill: nothing to do per layer

    def build_connector_meta(self, plan: SchedulerOutput) -> dict[int, torch.Tensor]:
        """The prompts this plan completes, and where their K,V lie (their block tables, read off the plan: the
        blocks are given back when the request finishes at token 1, their contents stay until the next forward;
        in a pipeline, until the micro-batch has come back from the last stage)."""
        bs = self.cache.block_size
        finishing = {c.request: torch.tensor(slots_of(c, 0, c.q_end, bs), device=self.cache.device)
                     for c in plan.scheduled if c.sample and c.request in self.handed}
        self.by_plan[plan.index] = finishing
        self.slots.update(finishing)
        return finishing

    def save_kv_layer(self, layer: int) -> None:
        """Streaming: the prompt's last chunk has passed `layer` (this rank's block `layer`: in a pipeline, of the
        micro-batch its stage runs now), so that layer's K,V of positions [0, N) are whole."""
        if hasattr(self.engine, "stage_plan"):  # a pipeline stage: the micro-batch it runs now
            running = self.engine.stage_plan
            finishing = {} if running is None else self.by_plan.get(running.index, {})
        else:
            finishing = self.finishing
        for rid, slots in finishing.items():
            self._send_kv(rid, slots, layer)

    def start_load_kv(self, metadata: dict[int, torch.Tensor] | None) -> None:
        """The plan about to run: its prompts' slots (build_connector_meta's), which the layers' sends read."""
        self.finishing = metadata or {}

    def request_finished(self, request, block_ids: list[int]) -> bool:
        """Token 1 is sampled (every request ends there on this side): it goes to the decode group, after every
        layer's K,V when not streaming."""
        self.done_at[request.id] = time.perf_counter()
        slots = self.slots.pop(request.id, None)
        if slots is None:  # not handed over (it wanted one token)
            return False
        if not self.streaming:
            self._send_kv(request.id, slots, None)
        token = torch.tensor([request.output[0]], dtype=torch.int64, device=self.cache.device)
        for peer in self.token_peers:
            self._send(token, peer, request.id, None, (0, 0), "pd/first token")
        self.by_plan = {i: f for i, f in self.by_plan.items() if any(rid in self.slots for rid in f)}
        return False

    def _send_kv(self, rid: int, slots: torch.Tensor, layer: int | None) -> None:
        """Each overlapping decode rank its heads' share of the prompt's K,V: of this rank's block `layer`, or of
        every layer it holds (None)."""
        for peer, lo, hi in self.peers:
            heads = slice(lo - self.first_head, hi - self.first_head)
            self._send(self.cache.read(slots, heads, layer), peer, rid, None if layer is None else self.layers[layer],
                       (lo, hi), "pd/kv")

    def _send(self, tensor: torch.Tensor, peer: int, rid: int, layer: int | None, heads, site: str) -> None:
        buf = tensor.contiguous()  # the message's own memory (a view when already contiguous): held until it is sent
        tag = _tag(rid, layer, self.cfg.n_layers, token=site == "pd/first token")
        fields = ("send", site, rid, layer, self.rank, peer, heads)
        posted = time.perf_counter()
        work = dist.isend(buf, dst=peer, tag=tag)

        def done(error):
            if error is not None:
                self.error = self.error or error
            else:
                self.ledger.transfer(_record(fields, buf, time.perf_counter() - posted))

        self.waiter.submit([work], [_label(fields)], done)

    def finish(self, join: bool = True) -> None:
        """Wait for every send (join=False after a failure: return at once, the error that stopped us stands)."""
        self.waiter.close(join)
        self.close()
        if join and self.error is not None:
            raise RuntimeError(f"sending K,V to the decode group failed: {self.error}") from self.error


@dataclass(eq=False)
class _Posted:
    """One prefill iteration's hand-overs, as a decode rank awaits them."""

    requests: list[Request]
    posts: list[tuple]  # (work, buffer, record fields, posted at)
    landed: threading.Event = field(default_factory=threading.Event)
    landed_at: float = 0.0
    error: Exception | None = None

    def done(self, error: Exception | None) -> None:  # called by the receiver thread
        self.error, self.landed_at = error, time.perf_counter()
        self.landed.set()


class DecodeSide(KVConnectorBase):
    """Takes each handed-over request in at an iteration boundary: blocks filled with its K,V, and token 1.

    Receives are posted ahead (the next `window` groups of requests, a group being those whose prompts complete in
    one prefill iteration), into receive buffers outside the pool; a receiver thread waits for them in order. At
    every iteration boundary each decode rank counts the groups whose messages have all landed here, and ★ one
    all-reduce (min) of that count over the decode group makes every decode rank take in the same groups (with
    nothing to decode, they first wait for the next). A request gets its blocks when it is taken in (docs/pd.md,
    "Bounded pools"), and one write per message puts its K,V at their slots."""

    def __init__(self, cfg, layout: Layout, rank: int, streaming: bool, ledger: TrafficLedger, group,
                 groups: list[list[int]], requests: dict[int, Request], eos: frozenset[int], keep_kv: bool = False,
                 window: int = 4, timeout_s: float = DEFAULT_TIMEOUT_S):
        """requests: the handed-over requests by id, each with its prompt marked computed; groups: their ids in the
        prefill side's order, one list per prefill iteration."""
        self.cfg, self.layout, self.rank, self.streaming, self.ledger, self.group, self.eos = \
            cfg, layout, rank, streaming, ledger, group, eos
        self.requests = requests
        self.kept: dict[int, torch.Tensor] | None = {} if keep_kv else None  # what was placed, for tests
        s = rank - layout.prefill_ranks
        pairs = pd_pairs(cfg.n_kv_heads, cfg.n_layers, layout.prefill_ranks, layout.decode_ranks, layout.prefill_pp)
        self.peers = [(r, lo, hi, layers) for r, s2, lo, hi, layers in pairs if s2 == s]  # layers: what r holds
        self.token_peer = token_sources(pairs, cfg.n_layers)[s]
        self.first_head = kv_head_range(cfg.n_kv_heads, s, layout.decode_ranks).start
        self.upcoming = deque(groups)  # request ids in the prefill side's order, one list per prefill iteration
        self.posted: deque[_Posted] = deque()
        self.ready: deque[tuple[Request, list]] = deque()  # landed, waiting for blocks: (request, its messages)
        self.window = window
        self.timeout_s = timeout_s  # the longest wait for a hand-over message
        self.waiter: _Waiter | None = None  # started with the first receives, on the cache's device
        self.received_at: dict[int, float] = {}
        self.agreements = 0  # all-reduces over the decode group (one per iteration boundary)

    def has_pending(self) -> bool:
        return bool(self.upcoming or self.posted or self.ready)

    def update_connector_output(self, engine) -> None:
        sched, cache = engine.scheduler, engine.runner.cache
        while True:
            self._post_ahead(cache)
            if self.posted:
                idle = not sched.has_work() and not self.ready
                # the groups that have landed here, in order
                landed = next((i for i, g in enumerate(self.posted) if not g.landed.is_set()), len(self.posted))
                if landed == 0 and idle:  # nothing to decode: wait for the next group
                    self._wait_landed(self.posted[0])
                    landed = 1
                with host_control():  # a CPU tensor over the group's gloo backend: the host never waits for the GPU
                    count = torch.tensor([landed], dtype=torch.int64, device=control_device(self.group))
                    dist.all_reduce(count, op=dist.ReduceOp.MIN, group=self.group)  # ★ every decode rank the same
                    count = int(count)
                self.agreements += 1
                for _ in range(count):
                    self._land(self.posted.popleft())
            self._place(engine)
            if sched.has_work() or not (self.posted or self.ready):
                return
            if self.ready:  # nothing runs, so every block is free, and each request fits the pool alone
                raise AssertionError(f"request {self.ready[0][0].id} does not fit an empty pool")
            # still idle: everything just taken in ended at token 1 (eos_id); the ranks agree on that too

    def _wait_landed(self, group: "_Posted") -> None:
        """Wait (at most timeout_s, and a little more for the receiver thread to report) for a group to land."""
        if not group.landed.wait(2 * self.timeout_s + 1.0):  # the receiver thread reports at timeout_s at the latest
            missing = next((fields for work, _, fields, _ in group.posts if not work.is_completed()), None)
            what = _label(missing) if missing else f"requests {[r.id for r in group.requests]}"
            raise HandoverTimeout(f"{what}: not complete after pd.timeout_s={self.timeout_s:g} s")

    def finish(self, join: bool = True) -> None:
        """Stop the receiver thread (join=False after a failure: it may wait for messages that never come)."""
        if self.waiter is not None:
            self.waiter.close(join)

    def _post_ahead(self, cache: KVPool) -> None:
        """Post the receives of the next groups, in the order the prefill side sends them (per pair)."""
        L, dh = self.cfg.n_layers, self.cfg.d_head
        while self.upcoming and len(self.posted) + len(self.ready) < self.window:  # receive buffers stay bounded
            requests = [self.requests[rid] for rid in self.upcoming.popleft()]
            posts = []

            def post(buf, src, tag, fields):
                posts.append((dist.irecv(buf, src=src, tag=tag), buf, fields, time.perf_counter()))

            layers = range(L) if self.streaming else [None]
            for layer, r in [(layer, r) for layer in layers for r in requests]:
                n = len(r.prompt)
                for src, lo, hi, held in self.peers:
                    if layer is not None and layer not in held:  # streamed: this layer comes from its stage's ranks
                        continue
                    shape = (2, hi - lo, n, dh) if self.streaming else (len(held), 2, hi - lo, n, dh)
                    buf = torch.empty(shape, dtype=cache.dtype, device=cache.device)
                    post(buf, src, _tag(r.id, layer, L), ("recv", "pd/kv", r.id, layer, self.rank, src, (lo, hi)))
                if not self.streaming:
                    self._post_token(r, post, cache.device)
            if self.streaming:
                for r in requests:
                    self._post_token(r, post, cache.device)
            group = _Posted(requests, posts)
            self.posted.append(group)
            if self.waiter is None:
                self.waiter = _Waiter(cache.device, self.timeout_s)
            self.waiter.submit([work for work, *_ in posts], [_label(f) for _, _, f, _ in posts], group.done)

    def _land(self, group: "_Posted") -> None:
        """A group whose messages landed on every decode rank: ledger them, and queue its requests for the pool."""
        if group.error is not None:
            raise HandoverTimeout(f"receiving from the prefill group failed: {group.error}") from group.error
        for work, buf, fields, posted in group.posts:
            self.ledger.transfer(_record(fields, buf, group.landed_at - posted))
        tokens = [(fields[2], buf) for _, buf, fields, _ in group.posts if fields[1] == "pd/first token"]
        first = dict(zip((rid for rid, _ in tokens), torch.cat([b for _, b in tokens]).tolist()))  # one host read
        for r in group.requests:
            r.output = [int(first[r.id])]
            self.ready.append((r, [(buf, fields) for _, buf, fields, _ in group.posts
                                   if fields[2] == r.id and fields[1] == "pd/kv"]))

    def _place(self, engine) -> None:
        """Landed requests into the engine, in order, while blocks are free for their prompt and their first decode
        row (a request that does not fit waits in its receive buffers, and the ones behind it wait too): each is
        added with its prompt computed (LLMEngine.add_computed: its blocks now), and its K,V written at their slots.
        The decode ranks hold the same queue and the same blocks, so they add the same requests at the same step."""
        blocks, cache = engine.scheduler.blocks, engine.runner.cache
        while self.ready and blocks.blocks_for(self.ready[0][0].num_computed_tokens + 1) <= blocks.num_free:
            r, posts = self.ready.popleft()
            self.received_at[r.id] = time.perf_counter()
            if r.output[0] in self.eos or r.max_new_tokens <= 1:  # token 1 ended it: nothing to decode
                r.status = (RequestStatus.FINISHED_STOPPED if r.output[0] in self.eos
                            else RequestStatus.FINISHED_LENGTH)
                continue
            engine.add_computed(r)  # blocks for the prompt's N positions, from the decode side's own pool
            slots = torch.tensor(blocks.slots(r.id, 0, r.num_computed_tokens), device=cache.device)
            held = {src: layers for src, _, _, layers in self.peers}
            for buf, (_, _, _, layer, _, src, (lo, hi)) in posts:
                heads = slice(lo - self.first_head, hi - self.first_head)
                if layer is None and len(held[src]) < cache.n_layers:  # a pipeline stage's layers, one message
                    for j, at in enumerate(held[src]):
                        cache.write(slots, heads, buf[j], at)
                else:
                    cache.write(slots, heads, buf, layer)
            if self.kept is not None:
                self.kept[r.id] = cache.read(slots, slice(None))

    def _post_token(self, r: Request, post, device) -> None:
        buf = torch.empty(1, dtype=torch.int64, device=device)
        post(buf, self.token_peer, _tag(r.id, None, self.cfg.n_layers, token=True),
             ("recv", "pd/first token", r.id, None, self.rank, self.token_peer, (0, 0)))


def _record(fields: tuple, buf: torch.Tensor, elapsed: float) -> TransferRecord:
    kind, site, rid, layer, rank, peer, heads = fields
    return TransferRecord(kind, site, rid, layer, rank, peer, heads, tuple(buf.shape),
                          str(buf.dtype).removeprefix("torch."), buf.numel() * buf.element_size(), elapsed)
