"""The serving loop on the TP stack: plan -> tensors -> one forward -> greedy tokens -> finish/admit/preempt.

Memory is paged (SPEC §10): the scheduler's BlockManager decides every request's block table on the host,
identically on every rank, and each rank's KVPool (one tensor, allocated once per run) stores K,V of the rank's
own heads at the slots those tables name. serve/inputs.py turns each plan into the iteration's tensors, once.

Every rank runs this loop with the same requests and settings, so every rank's scheduler
makes the same plan; the engine checks that cheaply: once at the start (a fingerprint of the
requests and scheduler settings), before each forward (one all-gather of a four-number plan
fingerprint, in the iteration's ledger), and once when its loop ends (so a rank that thinks it
is done meets a rank that still plans in the same all-gather). Any difference raises
PlanMismatch on every rank, before a forward could issue collectives of different sizes. The
fingerprints are control traffic: CPU tensors over the group's gloo backend (under NCCL too:
tp/dist.py), so the check never waits for a GPU. The traffic ledger records every collective of
every iteration, and each iteration is compared with the analytic model (tp/traffic_model.py:
predict_iteration).

What the host waits for, per iteration: one read of the sampled tokens and their logits (one
device-to-host copy; it also ends the iteration's clock, so timing costs no extra wait). The
inputs go over in one host-to-device copy (serve/inputs.py), the ledger counts without waiting,
and per-collective times (comm_timing=True) add two waits for the compute stream per collective.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from layers.lm import TPLM, TPLlamaLM
from serve.block_manager import BlockManager
from serve.inputs import ATTENTION_MODES, prepare_step
from serve.kv_cache import KVPool
from serve.plan import FINGERPRINT_SIZE, IterationPlan
from serve.scheduler import Request, Scheduler, SchedulerError, worst_case_blocks
from tp.comm import gather_from_region
from tp.dist import TPContext, control_device, host_control, wait_for_stream
from tp.ledger import TrafficLedger
from tp.traffic_model import predict_iteration


class PlanMismatch(RuntimeError):
    """Ranks scheduled different rows: their collectives would no longer describe the same tensors."""


@dataclass
class ServeResult:
    iterations: list[dict] = field(default_factory=list)
    requests: list[dict] = field(default_factory=list)
    kv_peak_bytes_per_rank: int = 0  # the most bytes of this rank's pool held by requests' blocks at once
    kv_pool_bytes_per_rank: int = 0  # the pool, reserved once
    kv_bytes_per_token_per_rank: int | float = 0  # the pool's bytes / its token positions (measured off the tensor)
    kv_blocks: int = 0
    block_size: int = 0
    peak_blocks_used: int = 0
    prefix_hit_tokens: int = 0  # prompt tokens whose K,V came from the prefix cache
    rows_computed: int = 0  # rows through the model, all iterations
    preemptions: int = 0
    free_blocks_at_end: int = 0  # = kv_blocks when every finished request gave its blocks back
    time_s: float = 0.0
    started_at: float = 0.0  # time.perf_counter() when the loop started: start_s and token_times_s count from it

    @property
    def ledger_matches_model(self) -> bool:
        return all(it["ledger_matches_model"] for it in self.iterations)


class EngineHooks:
    """Steps a caller can add to the loop; each does nothing here. serve/disagg.py's prefill and decode
    sides use them to hand requests and their K,V from one group of ranks to another."""

    def before_schedule(self, index: int, sched: Scheduler, cache: KVPool) -> None:
        """Before iteration `index` is planned (a decode side receives the requests arriving now)."""

    def before_forward(self, plan: IterationPlan) -> None:
        """The plan about to run (a prefill side streaming K,V layer by layer needs to know it)."""

    def after_update(self, plan: IterationPlan, finished: list[int], sched: Scheduler, cache: KVPool) -> None:
        """After the tokens are applied. The finished requests' blocks are free already, their contents intact
        until the next forward (plan.chunks still carries their block tables)."""


def new_scheduler(requests: list[Request], *, chunk_size: int, max_batched_tokens: int, max_running: int | None = None,
                  eos_id: int | None = None, reserve_capacity: bool = False, block_size: int = 16,
                  kv_blocks: int | None = None, prefix_cache: bool = True) -> Scheduler:
    """The scheduler a run starts with: its settings, and a block pool of kv_blocks (or, null, enough for every
    request at its largest at once: such a run never preempts)."""
    n_blocks = kv_blocks or worst_case_blocks(requests, block_size)
    return Scheduler(requests, chunk_size, max_batched_tokens, max_running, eos_id,
                     blocks=BlockManager(n_blocks, block_size, prefix_cache), reserve_capacity=reserve_capacity)


def schedule_loop(sched: Scheduler, before_schedule=None):
    """The serving loop's control flow, in one place: yields each iteration's plan; the caller runs it and applies
    its tokens (sched.update) before asking for the next. Iterations with nothing to run are skipped (no plan), and
    waiting requests that can never get KV blocks raise instead of spinning. before_schedule(index): called before
    each iteration is planned. The engine and the prefill schedule every P/D rank computes (serve/disagg.py) both
    run this loop, so they cannot drift apart."""
    index = 0
    while sched.has_work():
        if before_schedule is not None:
            before_schedule(index)
        plan = sched.schedule(index)
        if plan is None:  # nothing running, the next request arrives later: skip ahead, no forward
            upcoming = sched.next_arrival()
            if sched.waiting and (upcoming is None or upcoming <= index):
                raise SchedulerError(f"iteration {index}: requests {[r.id for r in sched.waiting]} wait for KV "
                                     f"blocks that nothing running will give back ({sched.blocks.num_free} of "
                                     f"{sched.blocks.num_blocks} free); raise kv_blocks")
            index = upcoming or index  # None: all finished, the loop ends
            continue
        yield plan
        index += 1


class Engine:
    def __init__(self, lm: TPLM | TPLlamaLM, ctx: TPContext, *, chunk_size: int, max_batched_tokens: int,
                 max_running: int | None = None, eos_id: int | None = None, block_size: int = 16,
                 kv_blocks: int | None = None, prefix_cache: bool = True, attention: str = "batched",
                 reserve_capacity: bool = False, comm_timing: bool = False, on_iteration=None,
                 hooks: EngineHooks | None = None):
        if block_size < 1:
            raise SchedulerError(f"block_size={block_size} must be at least 1")
        if kv_blocks is not None and kv_blocks < 1:
            raise SchedulerError(f"kv_blocks={kv_blocks} must be at least 1 (or null: enough for the workload)")
        if attention not in ATTENTION_MODES:
            raise SchedulerError(f"attention={attention!r}: choose {' or '.join(ATTENTION_MODES)}")
        self.lm, self.ctx = lm, ctx
        self.sched_args = dict(chunk_size=chunk_size, max_batched_tokens=max_batched_tokens,
                               max_running=max_running, eos_id=eos_id, reserve_capacity=reserve_capacity)
        self.block_size, self.kv_blocks, self.prefix_cache, self.attention = \
            block_size, kv_blocks, prefix_cache, attention
        self.comm_timing = comm_timing  # per-collective times in the ledger (comm_time_s): waits on the stream
        self.on_iteration = on_iteration  # called with each iteration's record (progress lines)
        self.hooks = hooks or EngineHooks()
        self.dtype = next(lm.parameters()).dtype
        self.cache: KVPool | None = None  # allocated by run(): its size may depend on the requests

    def pool_blocks(self, requests: list[Request]) -> int:
        """kv_blocks, or (null) enough for every request at its largest at once: such a run never preempts."""
        return self.kv_blocks or worst_case_blocks(requests, self.block_size)

    def scheduler(self, requests: list[Request]) -> Scheduler:
        return new_scheduler(requests, **self.sched_args, block_size=self.block_size, kv_blocks=self.kv_blocks,
                             prefix_cache=self.prefix_cache)

    @torch.no_grad()
    def run(self, requests: list[Request]) -> ServeResult:
        sched = self.scheduler(requests)
        n_blocks = sched.blocks.num_blocks
        cfg = self.lm.cfg
        # K,V heads this rank caches: h/p (GPT-2), max(h_kv/p, 1) (Llama's grouped-query attention)
        self.cache = KVPool(cfg.n_layers, n_blocks, self.block_size, self.lm.cache_heads, cfg.d_head, self.dtype,
                            self.ctx.device)
        result = ServeResult(kv_blocks=n_blocks, block_size=self.block_size, kv_pool_bytes_per_rank=self.cache.bytes)
        arrived_at: dict[int, float] = {}
        token_times: dict[int, list[float]] = {r.id: [] for r in requests}
        logits: dict[int, list[float]] = {r.id: [] for r in requests}
        ledger = TrafficLedger(self.ctx.world_size, self.ctx.device, timing=self.comm_timing)
        self._agree(self._settings_fingerprint(requests), "requests or scheduler settings differ")
        wait_for_stream(self.ctx.device)  # the pool's zeroing is not billed to the first iteration
        start = result.started_at = time.perf_counter()
        now = {}  # what the loop's before_schedule step saw: the iteration's start, prefix hits before it

        def before_schedule(index: int) -> None:
            now["t0"] = t0 = time.perf_counter()
            self.hooks.before_schedule(index, sched, self.cache)
            for r in requests:
                if r.arrival <= index and r.id not in arrived_at:
                    arrived_at[r.id] = t0
            now["hits"] = sum(r.prefix_hit for r in requests)

        index = 0
        for plan in schedule_loop(sched, before_schedule):
            t0, hits_before, index = now["t0"], now["hits"], plan.index + 1
            blocks_used = sched.blocks.num_used  # this iteration's tables, before finishing requests give theirs back
            positions_held, running = sched.positions_held(), len(sched.running)
            ledger.clear()
            with ledger.attach(self.lm.stack):
                self._check_plan(plan)
                self.hooks.before_forward(plan)
                tokens, token_logits = self._forward(plan, sched)
            # The iteration's one wait for the device: tokens and logits in one copy (ids < 2^53 are exact in float64)
            token_list, logit_list = torch.stack([tokens.double(), token_logits.double()]).tolist()
            token_list = [int(t) for t in token_list]
            t1 = time.perf_counter()
            sampled_ids = [c.request for c in plan.chunks if c.sample]
            for rid, lg in zip(sampled_ids, logit_list):
                token_times[rid].append(t1)
                logits[rid].append(lg)
            finished = sched.update(plan, dict(zip(sampled_ids, token_list)))
            self.hooks.after_update(plan, finished, sched, self.cache)
            record = self._record(plan, finished, ledger, t1 - t0, blocks_used)
            record["prefix_hit_tokens"] = sum(r.prefix_hit for r in requests) - hits_before
            record["positions_held"], record["running"] = positions_held, running
            record["start_s"] = t0 - start  # when this iteration began, from the run's start (timelines)
            result.iterations.append(record)
            result.peak_blocks_used = max(result.peak_blocks_used, blocks_used)
            result.rows_computed += plan.rows
            if self.on_iteration is not None:
                self.on_iteration(record, sched)
        self._check_plan(IterationPlan(index, ()))  # "done": differs from any plan a rank still running makes
        wait_for_stream(self.ctx.device)
        result.time_s = time.perf_counter() - start
        sched.blocks.check()  # every count back to 0, every block free (or a bug in the block manager)
        result.free_blocks_at_end = sched.blocks.num_free
        result.kv_peak_bytes_per_rank = result.peak_blocks_used * self.cache.bytes_per_block
        result.prefix_hit_tokens = sum(r.prefix_hit for r in requests)
        result.preemptions = sched.preemptions
        # measured, not computed: the bytes the pool tensor holds per token position
        per_token = self.cache.measured_bytes_per_token()
        result.kv_bytes_per_token_per_rank = int(per_token) if per_token == int(per_token) else per_token
        for r in requests:
            times = token_times[r.id]
            gaps = [b - a for a, b in zip(times[:-1], times[1:])]
            result.requests.append({
                "request": r.id, "arrival": r.arrival, "prompt_length": len(r.prompt),
                "generated": len(r.output), "output_ids": list(r.output), "logits": logits[r.id],
                "prefix_hit_tokens": r.prefix_hit, "preemptions": r.preemptions,
                "ttft_s": times[0] - arrived_at[r.id] if times else None,
                "mean_tbt_s": sum(gaps) / len(gaps) if gaps else None,
                "max_tbt_s": max(gaps) if gaps else None,
                "token_times_s": [t - start for t in times],  # when each token was ready, from the run's start
            })
        return result

    def _check_plan(self, plan: IterationPlan) -> None:
        """★ all-gather of every rank's plan fingerprint [1, 4] -> [1, 4p]; all ranks reach the same verdict."""
        self._agree(plan.fingerprint(), f"iteration {plan.index}: ranks scheduled different rows")

    def _agree(self, fingerprint: list[float], what: str) -> None:
        with host_control():  # CPU tensors, the group's gloo backend: no wait for the GPU
            mine = torch.tensor([fingerprint], dtype=torch.float64, device=control_device(self.ctx.group))
            every = gather_from_region(mine, self.ctx.group, "engine/plan check").view(-1, FINGERPRINT_SIZE).tolist()
        if any(row != every[0] for row in every):
            raise PlanMismatch(f"{what} (fingerprints {every}); every rank must get the same requests and settings")

    def _settings_fingerprint(self, requests: list[Request]) -> list[float]:
        a = self.sched_args
        knobs = [a["chunk_size"], a["max_batched_tokens"], a["max_running"] or -1,
                 -1 if a["eos_id"] is None else a["eos_id"], self.block_size, self.pool_blocks(requests),
                 int(self.prefix_cache), ATTENTION_MODES.index(self.attention), int(a["reserve_capacity"])]
        per_request = [(r.id, len(r.prompt), sum(r.prompt), r.max_new_tokens, r.arrival, r.computed) for r in requests]
        return [float(len(requests)), float(sum((i + 1) * k for i, k in enumerate(knobs))),
                float(sum((i + 1) * sum(x) for i, x in enumerate(per_request))),
                float(sum((i + 1) * (j + 1) * v for i, x in enumerate(per_request) for j, v in enumerate(x)))]

    def _forward(self, plan: IterationPlan, sched: Scheduler) -> tuple[torch.Tensor, torch.Tensor]:
        step = prepare_step(plan, {c.request: sched.by_id[c.request].tokens for c in plan.chunks}, self.block_size,
                            self.ctx.device, self.attention)
        return self.lm.step(step.ids, step.positions, self.cache.layers(step.batch), step.sample_rows)

    def _record(self, plan: IterationPlan, finished: list[int], ledger: TrafficLedger, elapsed: float,
                blocks_used: int) -> dict:
        seen = [r.traffic() for r in ledger.records]
        predicted = predict_iteration(self.lm.cfg, self.ctx.world_size, plan.rows, len(plan.sample_rows), self.dtype,
                                      self.lm.variant, self.lm.vocab_parallel, FINGERPRINT_SIZE)
        return {
            "iteration": plan.index, "rows": plan.rows, "prefill_chunks": plan.prefill_chunks,
            "decodes": plan.decodes, "admitted": list(plan.admitted), "finished": finished,
            "preempted": list(plan.preempted),
            "triples": [[c.request, *c.triple] for c in plan.chunks],
            "sampled": len(plan.sample_rows),
            "collectives": dict(Counter(t.kind for t in seen)),
            "logical_bytes": sum(t.logical_bytes for t in seen),
            "bytes_per_rank": sum(t.bytes_per_rank for t in seen),
            "comm_time_s": sum(r.time_s for r in ledger.records) if ledger.timing else None,
            "ledger_matches_model": seen == predicted,
            "predicted_bytes_per_rank": sum(t.bytes_per_rank for t in predicted),
            "score_entries": plan.score_entries(), "cache_rows_read": plan.cache_rows_read(),
            "blocks_used": blocks_used, "kv_bytes_per_rank": blocks_used * self.cache.bytes_per_block,
            "time_s": elapsed,
        }
