"""A workload known up front, served by an LLMEngine on every rank, every iteration recorded (OfflineEngine: what
launch/serve.py, the benchmarks and the oracle tests run), and `drive`, the one step loop every driver shares
(docs/library.md, "One loop for every path").

    result = OfflineEngine(lm, ctx, EngineConfig(...), eos_token_ids=(50256,)).run(requests)   # every rank
    result.iterations, result.requests, result.ledger_matches_model, ...
"""

from __future__ import annotations

import contextlib

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from layers.sampling.sampler import request_seed
from serve.build import new_engine
from serve.config import EngineConfig
from serve.control import agree, digest, request_rows, settings_row
from serve.engine import LLMEngine
from serve.hooks import Recorder, StepHook
from serve.request import Request
from serve.scheduler import Scheduler, SchedulerError
from tp.dist import TPContext, wait_for_stream


@dataclass
class ServeResult:
    iterations: list[dict] = field(default_factory=list)
    requests: list[dict] = field(default_factory=list)
    kv_peak_bytes_per_rank: int = 0  # the most bytes of this rank's pool held by requests' blocks at once
    kv_pool_bytes_per_rank: int = 0  # the pool, reserved once
    kv_bytes_per_token_per_rank: int | float = 0  # the pool's bytes / its token positions (measured off the tensor)
    num_blocks: int = 0  # blocks in each rank's pool
    block_size: int = 0
    peak_blocks_used: int = 0
    prefix_hit_tokens: int = 0  # prompt tokens whose K,V came from the prefix cache
    rows_computed: int = 0  # rows through the model, all iterations
    preemptions: int = 0
    evicted_blocks: int = 0  # blocks given back by kv_eviction (serve/eviction.py), all requests
    free_blocks_at_end: int = 0  # = num_blocks when every finished request gave its blocks back
    time_s: float = 0.0
    started_at: float = 0.0  # time.perf_counter() when the loop started: start_s and token_times_s count from it
    idle_steps_match: bool = True  # steps that ran nothing (control message alone) == the model, all of them

    @property
    def ledger_matches_model(self) -> bool:
        return self.idle_steps_match and all(it["ledger_matches_model"] for it in self.iterations)


def drive(engine: LLMEngine, feed: Callable[[LLMEngine], bool] | None = None,
          sink: Callable[[list], None] | None = None) -> None:
    """The one step loop, on every rank of every entry point (LLM's and a server's ranks, serve/worker.py;
    OfflineEngine.run; launch/sync_check.py): what differs between them is the feed and the sink. Rank 0:
    feed(engine) adds what has arrived (and may wait for it) and says whether a step is due; False ends the loop and
    stops the other ranks. Each step's outputs go to sink. The other ranks step until rank 0 stops them."""
    try:
        if not engine.ctx.is_main:
            while not engine.stopped:
                engine.step()
        else:
            while feed(engine):
                outputs = engine.step()
                if sink is not None:
                    sink(outputs)
            engine.shutdown()
    except BaseException:
        if engine.connector is not None:  # closed quietly: the error that ended the loop is the one to see
            with contextlib.suppress(Exception):
                engine.connector.close()
        raise
    if engine.connector is not None:  # its threads, hooks and files go with the loop
        engine.connector.close()


class OfflineEngine:
    """A workload served by an LLMEngine (a PipelineEngine for a pipeline stage's model) on every rank of the group
    (SPMD: every rank calls run with the same requests). config: the engine's settings, whole; its
    num_gpu_blocks_override None sizes the pool for the workload (every request at its largest at once: such a run
    never preempts), and its check_ledger is replaced by the Recorder, which compares every step and keeps the
    verdict. eos_token_ids join every request's stop ids; hooks: more StepHooks (a capture in a test), run after the
    Recorder; connector: a KV connector its driver built (a P/D side: serve/pd/); on_iteration(record, scheduler):
    called with each record (launch/serve.py's progress)."""

    def __init__(self, lm, ctx: TPContext, config: EngineConfig | None = None, *,
                 eos_token_ids: tuple[int, ...] = (), hooks: StepHook | list[StepHook] | None = None, seed: int = 0,
                 on_iteration=None, cp_group=None, connector=None):
        self.lm, self.ctx, self.cp_group, self.connector = lm, ctx, cp_group, connector
        self.config = dataclasses.replace(config or EngineConfig(), check_ledger=False)
        self.eos_token_ids = tuple(eos_token_ids)
        self.on_iteration = on_iteration
        self.hooks = [] if hooks is None else [hooks] if isinstance(hooks, StepHook) else list(hooks)
        self.seed = seed  # sampled requests without a seed of their own: one drawn from this and the request's id
        self.engine: LLMEngine | None = None  # built by run(): its pool's size may depend on the requests
        self.cache = None

    @torch.no_grad()
    def run(self, requests: list[Request]) -> ServeResult:
        ids = [r.id for r in requests]  # every rank refuses what rank 0 alone would (before any collective)
        if len(set(ids)) != len(ids):
            raise SchedulerError(f"request ids {sorted({i for i in ids if ids.count(i) > 1})} are given twice")
        done = [r.id for r in requests if r.finished]
        if done:
            raise SchedulerError(f"requests {done} have finished already: give new Request objects")
        for r in requests:
            if r.params is not None and r.sampling_seed is None:
                r.sampling_seed = r.params.seed if r.params.seed is not None else request_seed(self.seed, r.id)
            r.stop_ids = r.stop_ids | frozenset(self.eos_token_ids)
        # every rank checks the workload against the settings (SchedulerError on every rank, before any collective)
        sizing = Scheduler.for_workload(requests, self.config)
        config = dataclasses.replace(self.config, num_gpu_blocks_override=sizing.blocks.num_blocks)
        result = ServeResult(num_blocks=config.num_gpu_blocks_override, block_size=config.block_size)
        recorder = Recorder(result, self.on_iteration)
        engine = self.engine = new_engine(self.lm, self.ctx, config, self.eos_token_ids, self.seed,
                                          [recorder, *self.hooks], cp_group=self.cp_group, connector=self.connector)
        self.cache = engine.runner.cache
        result.kv_pool_bytes_per_rank = self.cache.bytes
        agree(self.ctx, digest([settings_row(config, self.eos_token_ids)] + request_rows(requests)),
              "requests or scheduler settings differ")
        wait_for_stream(self.ctx.device)  # the pool's zeroing is not billed to the first iteration
        start = result.started_at = time.perf_counter()
        arriving = sorted(requests, key=lambda q: (q.arrival, q.id))[::-1]  # the next arrival last

        def feed(engine: LLMEngine) -> bool:
            # add what has arrived; with nothing running, the next arrivals now (the step skips ahead to them); a
            # step is due while anything is unfinished or the connector's hand-overs are still to come
            horizon = engine.index if engine.has_unfinished_requests() or not arriving else \
                max(engine.index, arriving[-1].arrival)
            while arriving and arriving[-1].arrival <= horizon:
                engine.add(arriving.pop())
            connector = engine.connector
            return engine.has_unfinished_requests() or (connector is not None and connector.has_pending())

        drive(engine, feed)
        wait_for_stream(self.ctx.device)
        result.time_s = time.perf_counter() - start
        return self._result(result, recorder, requests, start)

    def _result(self, result: ServeResult, recorder: Recorder, requests: list[Request], start: float) -> ServeResult:
        sched = self.engine.scheduler
        sched.blocks.check()  # every count back to 0, every block free (or a bug in the block manager)
        result.free_blocks_at_end = sched.blocks.num_free
        result.kv_peak_bytes_per_rank = result.peak_blocks_used * self.cache.bytes_per_block
        result.preemptions = sched.preemptions
        result.evicted_blocks = sched.blocks.evicted
        # measured, not computed: the bytes the pool tensor holds per token position
        per_token = self.cache.measured_bytes_per_token()
        result.kv_bytes_per_token_per_rank = int(per_token) if per_token == int(per_token) else per_token
        for r in requests:
            served = sched.by_id[r.id]
            if served is not r:  # ranks other than 0 served the copies rank 0 sent: the caller's requests get the end
                for name in ("output", "num_computed_tokens", "prefix_hit", "num_cached_tokens", "preemptions",
                             "status", "arrival", "evictions"):
                    setattr(r, name, getattr(served, name))
        given = {r.id for r in requests}
        served = requests + sorted((r for r in sched.by_id.values() if r.id not in given), key=lambda r: r.id)
        result.requests = [recorder.request(r, start) for r in served]  # and those hooks added (a decode side's)
        result.prefix_hit_tokens = sum(r.prefix_hit for r in served)
        return result
