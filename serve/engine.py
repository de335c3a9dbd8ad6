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

from layers.lm import TPLM, TPLlamaLM, greedy_reference, oracle_verdict, sampled_reference
from layers.sampler import request_seed
from serve.block_manager import BlockManager
from serve.config import EngineConfig
from serve.inputs import ATTENTION_MODES
from serve.model_runner import ModelRunner
from serve.kv_cache import KVPool
from serve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from serve.plan import FINGERPRINT_SIZE, IterationPlan
from serve.request import Request, RequestStatus
from serve.sampling_params import SamplingParams

from serve.scheduler import Scheduler, SchedulerError, worst_case_blocks
from tp.comm import broadcast_from_main, gather_from_region
from tp.dist import TPContext, control_device, host_control, wait_for_stream
from tp.ledger import TrafficLedger
from tp.partition import ceil_div
from tp.traffic_model import predict_control, predict_iteration


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
                  eos_id: int | None = None, reserve_capacity: bool = False,
                  block_size: int = EngineConfig.block_size, kv_blocks: int | None = None,
                  prefix_cache: bool = EngineConfig.prefix_cache) -> Scheduler:
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
                 max_running: int | None = None, eos_id: int | None = None,
                 block_size: int = EngineConfig.block_size, kv_blocks: int | None = None,
                 prefix_cache: bool = EngineConfig.prefix_cache, attention: str = EngineConfig.attention,
                 reserve_capacity: bool = False, comm_timing: bool = False, on_iteration=None,
                 hooks: EngineHooks | None = None, seed: int = 0):
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
        self.seed = seed  # sampled requests without a seed of their own: one drawn from this and the request's id
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
        for r in requests:
            if r.params is not None and r.sampling_seed is None:
                r.sampling_seed = r.params.seed if r.params.seed is not None else request_seed(self.seed, r.id)
        sched = self.scheduler(requests)
        n_blocks = sched.blocks.num_blocks
        self.runner = ModelRunner(self.lm, self.ctx, n_blocks, self.block_size, self.attention)
        self.cache = self.runner.cache
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
                tokens, token_logits, sampler = self._forward(plan, sched)
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
            record = self._record(plan, finished, ledger, t1 - t0, blocks_used, sampler)
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

    def _forward(self, plan: IterationPlan, sched: Scheduler) -> tuple[torch.Tensor, torch.Tensor, tuple | None]:
        out, sampling = self.runner.run(plan, sched.by_id)
        return out.tokens, out.logits, out.traffic(sampling)

    def _record(self, plan: IterationPlan, finished: list[int], ledger: TrafficLedger, elapsed: float,
                blocks_used: int, sampler: tuple | None = None) -> dict:
        seen = [r.traffic() for r in ledger.records]
        predicted = predict_iteration(self.lm.cfg, self.ctx.world_size, plan.rows, len(plan.sample_rows), self.dtype,
                                      self.lm.variant, self.lm.vocab_parallel, FINGERPRINT_SIZE, sampler)
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


# ---- the online engine: requests added and aborted between any two steps ----------------------------------------

CONTROL_HEADER = 4  # (new requests, aborted requests, payload length, flag), float64
REQUEST_FIELDS = 12  # per new request, before its stop ids and prompt: see _encode
RUN, IDLE, STOP = 0, 1, 2  # the header's flag: run a step | rank 0 is idle (keep-alive, no step) | end the loop


def validate_prompt(ids: list[int], max_tokens: int, vocab_size: int, max_seq_len: int, num_blocks: int,
                    block_size: int) -> None:
    """ValueError (one line) unless the prompt can be served: token ids of the vocabulary, room for max_tokens in
    the model's context, and a pool that can hold the request alone."""
    if not isinstance(ids, (list, tuple)) or not ids:
        raise ValueError("empty prompt: a request needs at least one token")
    bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt holds {bad!r}, not a token id of the vocabulary [0, {vocab_size})")
    need = len(ids) + max_tokens - 1
    if need > max_seq_len:
        raise ValueError(f"prompt of {len(ids)} tokens + max_tokens={max_tokens} needs {need} positions, more than "
                         f"the model's context of {max_seq_len}; shorten the prompt or lower max_tokens")
    blocks = ceil_div(need, block_size)
    if blocks > num_blocks:
        raise ValueError(f"prompt of {len(ids)} tokens + max_tokens={max_tokens} needs {blocks} KV blocks of "
                         f"block_size={block_size}, more than the pool's kv_blocks={num_blocks}; raise kv_blocks")


@dataclass
class StepRecord:
    """What one LLMEngine step did, for its hooks (the same on every rank)."""

    plan: IterationPlan | None  # None: nothing ran (nothing to schedule)
    payload: int  # the control message's payload length
    sampler: tuple | None  # what the head's pick moved (SampleResult.traffic); None: greedy
    sampled: list[int] = field(default_factory=list)  # requests that got a token, in row order
    rows: list[list[float]] = field(default_factory=list)  # their host rows: id, logit[, logprobs]
    ended: list[int] = field(default_factory=list)  # requests that finished or were aborted this step


class StepHook:
    """A check or a record run after every LLMEngine step, on every rank; does nothing here."""

    def after_step(self, engine: "LLMEngine", step: StepRecord) -> None:
        pass


class LedgerCheck(StepHook):
    """Every step's collectives against the model: the control message, and when a forward ran the plan check, the
    embedding, the blocks and the head's pick (tp/traffic_model.py). A difference raises (on by default:
    EngineConfig.check_ledger). The record is the engine's last_iteration."""

    def after_step(self, engine: "LLMEngine", step: StepRecord) -> None:
        seen = [r.traffic() for r in engine.ledger.records]
        p, plan = engine.ctx.world_size, step.plan
        predicted = predict_control(p, step.payload, CONTROL_HEADER)
        if plan is not None:
            predicted += predict_iteration(engine.lm.cfg, p, plan.rows, len(plan.sample_rows), engine.dtype,
                                           engine.lm.variant, engine.lm.vocab_parallel, FINGERPRINT_SIZE, step.sampler)
        record = {"iteration": None if plan is None else plan.index, "rows": 0 if plan is None else plan.rows,
                  "collectives": dict(Counter(t.kind for t in seen)),
                  "bytes_per_rank": sum(t.bytes_per_rank for t in seen),
                  "predicted_bytes_per_rank": sum(t.bytes_per_rank for t in predicted),
                  "ledger_matches_model": seen == predicted}
        if plan is not None:
            engine.last_iteration = record
        if not record["ledger_matches_model"]:
            raise RuntimeError(f"step {engine.index}: the collectives seen ({seen}) differ from the model's "
                               f"({predicted})")


class OracleCheck(StepHook):
    """Rank 0: each request that finishes (aborted ones aside) against the dense model recomputed with no cache at
    every step (greedy_reference, or sampled_reference with the request's noise), until the same stop ids; the
    verdict ("match", "near-tie", "MISMATCH") goes into its RequestOutput.oracle."""

    def __init__(self, dense, near_tie: float):
        self.dense, self.near_tie = dense, near_tie
        self.logits: dict[int, list[float]] = {}
        self.verdicts: Counter = Counter()

    def after_step(self, engine: "LLMEngine", step: StepRecord) -> None:
        if not engine.ctx.is_main:
            return
        for rid, row in zip(step.sampled, step.rows):
            self.logits.setdefault(rid, []).append(row[1])
        for rid in step.ended:
            r, logits = engine.scheduler.by_id[rid], self.logits.pop(rid, [])
            if r.status is RequestStatus.FINISHED_ABORTED:
                continue
            with torch.no_grad():
                ref = (greedy_reference(self.dense, r.prompt, r.max_new_tokens, r.stop_ids)
                       if r.params is None or r.params.greedy else
                       sampled_reference(self.dense, r.prompt, r.params, r.sampling_seed, r.stop_ids))
            verdict = oracle_verdict(r.output, logits, ref, self.near_tie)
            self.verdicts[verdict["verdict"]] += 1
            if rid in engine._outputs:
                engine._outputs[rid].oracle = verdict


class LLMEngine:
    """The online engine, on every rank of one TP group (SPMD): vLLM's add_request / step / abort_request.

    Requests arrive at rank 0 (`add_request`, `abort_request` queue them). Each `step`, on every rank:

        control   ★ rank 0 broadcasts what arrived and what was aborted since the last step (one message: a
                  header, then the payload when there is one), so that every rank's scheduler sees the same
                  requests at the same step
        schedule  Scheduler.schedule: finish, carry decodes, chunk, admit, preempt (host data, same on every rank)
        agree     ★ all-gather of the plan's fingerprint: a rank that planned otherwise raises PlanMismatch
        run       ModelRunner.run: the step's tensors, one forward through the TP model, the head's pick
        update    one read of the sampled ids (the step's wait), Scheduler.update: append, finish, free blocks

    and rank 0 returns a RequestOutput for each request that produced a token or finished. The ranks other than 0
    call `step` in a loop until the control message says STOP (`shutdown`); while rank 0 has nothing to do it
    sends IDLE messages (`keep_alive`), so their wait in the broadcast never reaches the group's timeout.
    Every collective of a step goes into the ledger and is compared with the model (check_ledger).
    """

    def __init__(self, lm: TPLM | TPLlamaLM, ctx: TPContext, config: EngineConfig | None = None,
                 eos_token_ids: tuple[int, ...] = (), seed: int = 0, hooks: list[StepHook] | None = None):
        """hooks: run after every step; default LedgerCheck when config.check_ledger (an OracleCheck adds the dense
        oracle: LLM(check=True))."""
        self.lm, self.ctx, self.config = lm, ctx, config or EngineConfig()
        self.hooks = list(hooks) if hooks is not None else [LedgerCheck()] if self.config.check_ledger else []
        self.seed = seed  # a request without a seed samples with one drawn from this and its id
        c, m = self.config, lm.cfg
        self.eos_token_ids = tuple(eos_token_ids)
        self.num_blocks = c.pool_blocks(m.max_seq_len)
        self.scheduler = Scheduler([], c.chunk_size, c.max_batched_tokens, c.max_running,
                                   blocks=BlockManager(self.num_blocks, c.block_size, c.prefix_cache))
        self.runner = ModelRunner(lm, ctx, self.num_blocks, c.block_size, c.attention)
        self.dtype = self.runner.dtype
        self.ledger = TrafficLedger(ctx.world_size, ctx.device, timing=c.comm_timing)
        self.index = 0  # the next step's iteration number
        self.stopped = False
        self.last_control = time.monotonic()  # when rank 0 last broadcast a control message (keep-alives read it)
        self.last_iteration: dict | None = None  # the record of the last step that ran a forward
        self.iterations = 0
        self.busy_s = 0.0  # wall time inside step() that ran a forward, summed (rank 0's clock)
        # rank 0 only: what arrived since the last step, and the request ids users gave
        self._new: list[Request] = []
        self._aborts: list[int] = []
        self._ids: dict[str, int] = {}
        self._outputs: dict[int, RequestOutput] = {}
        self._next = 0

    # -- rank 0: requests in -----------------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    prompt: str | None = None) -> None:
        """Queue a request for the next step (rank 0). Bad input raises ValueError here, before any collective."""
        if not self.ctx.is_main:
            raise RuntimeError("add_request is called on rank 0; the other ranks receive requests in step()")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, not {type(params).__name__}")
        if request_id in self._ids:
            raise ValueError(f"request_id {request_id!r} is already running")
        m = self.lm.cfg
        validate_prompt(prompt_token_ids, params.max_tokens, m.vocab_size, m.max_seq_len, self.num_blocks,
                        self.config.block_size)
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        seed = params.seed if params.seed is not None else request_seed(self.seed, self._next)
        r = Request(self._next, list(prompt_token_ids), params.max_tokens, self.index, stop_ids=frozenset(stop),
                    params=params, sampling_seed=seed)
        self._next += 1
        self._ids[request_id] = r.id
        self._outputs[r.id] = RequestOutput(request_id, prompt, r.prompt, [CompletionOutput(0, "", r.output)], False,
                                            RequestMetrics(time.time()))
        self._new.append(r)

    def abort_request(self, request_id: str) -> bool:
        """Abort at the next step: its blocks go back to the pool before anything is scheduled (rank 0). False if
        no such request is running."""
        rid = self._ids.get(request_id)
        if rid is None or rid in self._aborts:
            return False
        self._aborts.append(rid)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._new or self._aborts) or self.scheduler.has_work()

    @property
    def free_blocks(self) -> int:
        return self.scheduler.blocks.num_free

    # -- every rank: one step ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> list[RequestOutput]:
        """One iteration on every rank; rank 0 returns the outputs of the requests it moved (the others: [])."""
        start = time.perf_counter()
        self.ledger.clear()
        with self.ledger.attach(self.lm.stack):
            flag, new, aborts, payload = self._control(RUN)  # ★ broadcast: what arrived, what was aborted
            if flag != RUN:
                self.stopped = flag == STOP
                return []
            for r in new:
                self.scheduler.add(r)
            for rid in aborts:
                self.scheduler.abort(rid)
            plan = self.scheduler.schedule(self.index)
            if plan is not None:
                self._agree(plan.fingerprint(), f"iteration {plan.index}: ranks scheduled different rows")  # ★
                result, sampling = self.runner.run(plan, self.scheduler.by_id)
        if plan is None:  # nothing to run this step (nothing arrived, or all waiting requests were aborted)
            if self.scheduler.waiting and not self.scheduler.running:
                raise SchedulerError(f"requests {[r.id for r in self.scheduler.waiting]} wait for KV blocks that "
                                     f"nothing running will give back")
            self._after(StepRecord(None, payload, None, ended=aborts))
            return self._outputs_of([], aborts)
        sampled = [c.request for c in plan.chunks if c.sample]
        rows = result.to_host()  # ★ the step's one wait for the device
        finished = self.scheduler.update(plan, {rid: int(row[0]) for rid, row in zip(sampled, rows)})
        if result.logprob is not None:
            self._logprobs(sampled, rows, result.top_ids.shape[1])
        self._after(StepRecord(plan, payload, result.traffic(sampling), sampled, rows, aborts + finished))
        self.busy_s += time.perf_counter() - start
        self.index += 1
        self.iterations += 1
        return self._outputs_of(sampled, aborts + finished)

    def _after(self, step: StepRecord) -> None:
        for hook in self.hooks:
            hook.after_step(self, step)

    def keep_alive(self) -> None:
        """Rank 0 with nothing to do: an IDLE control message, so the other ranks' wait never times out."""
        self._control(IDLE)

    def shutdown(self) -> None:
        """Rank 0: tell every rank to leave its step loop (they see STOP in their next control message)."""
        if not self.stopped:
            self._control(STOP)
            self.stopped = True

    # -- the pieces ---------------------------------------------------------------------------------------------------

    def _control(self, flag: int) -> tuple[int, list[Request], list[int], int]:
        """★ rank 0's control message to every rank: (flag, new requests, aborted ids, payload length)."""
        device = control_device(self.ctx.group)
        self.last_control = time.monotonic()
        with host_control():  # CPU tensors over the group's gloo backend: no wait for the GPU
            if self.ctx.is_main:
                new, aborts = (self._new, self._aborts) if flag == RUN else ([], [])
                payload = self._encode(new, aborts)
                header = torch.tensor([len(new), len(aborts), len(payload), flag], dtype=torch.float64, device=device)
                broadcast_from_main(header, self.ctx.group, "engine/control header")
                if payload:
                    broadcast_from_main(torch.tensor(payload, dtype=torch.float64, device=device), self.ctx.group,
                                        "engine/control payload")
                if flag == RUN:
                    self._new, self._aborts = [], []
                return flag, new, aborts, len(payload)
            header = broadcast_from_main(torch.zeros(CONTROL_HEADER, dtype=torch.float64, device=device),
                                         self.ctx.group, "engine/control header")
            n_new, n_abort, length, flag = (int(v) for v in header.tolist())
            if not length:
                return flag, [], [], 0
            payload = broadcast_from_main(torch.zeros(length, dtype=torch.float64, device=device), self.ctx.group,
                                          "engine/control payload").tolist()
            new, aborts = self._decode(payload, n_new, n_abort)
            return flag, new, aborts, length

    @staticmethod
    def _encode(new: list[Request], aborts: list[int]) -> list[float]:
        """Each new request: REQUEST_FIELDS numbers, its stop ids, its prompt; then the aborted ids. float64 holds
        ids and seeds below 2**53 exactly (SamplingParams refuses larger seeds)."""
        out: list[float] = []
        for r in new:
            q = r.params
            out += [r.id, r.arrival, r.max_new_tokens, len(r.prompt), len(r.stop_ids), q.temperature, q.top_k, q.top_p,
                    q.min_p, q.seed is not None, q.seed or 0, -1 if q.logprobs is None else q.logprobs]
            out += sorted(r.stop_ids) + r.prompt
        return out + aborts

    def _decode(self, payload: list[float], n_new: int, n_abort: int) -> tuple[list[Request], list[int]]:
        new, at = [], 0
        for _ in range(n_new):
            rid, arrival, max_tokens, n_prompt, n_stop, temp, top_k, top_p, min_p, has_seed, seed, logprobs = \
                payload[at:at + REQUEST_FIELDS]
            at += REQUEST_FIELDS
            stop = frozenset(int(t) for t in payload[at:at + int(n_stop)])
            at += int(n_stop)
            prompt = [int(t) for t in payload[at:at + int(n_prompt)]]
            at += int(n_prompt)
            params = SamplingParams(int(max_tokens), temp, int(top_k), top_p, min_p, int(seed) if has_seed else None,
                                    logprobs=None if logprobs < 0 else int(logprobs))
            new.append(Request(int(rid), prompt, int(max_tokens), int(arrival), stop_ids=stop, params=params,
                               sampling_seed=int(seed) if has_seed else request_seed(self.seed, int(rid))))
        return new, [int(t) for t in payload[at:at + n_abort]]

    def _agree(self, fingerprint: list[float], what: str) -> None:
        with host_control():
            mine = torch.tensor([fingerprint], dtype=torch.float64, device=control_device(self.ctx.group))
            every = gather_from_region(mine, self.ctx.group, "engine/plan check").view(-1, FINGERPRINT_SIZE).tolist()
        if any(row != every[0] for row in every):
            raise PlanMismatch(f"{what} (fingerprints {every})")

    def _logprobs(self, sampled: list[int], rows: list[list[float]], width: int) -> None:
        """Rank 0: each row's chosen logprob and its top-N into the request's output."""
        for rid, row in zip(sampled, rows):
            o = self._outputs.get(rid)
            n = self.scheduler.by_id[rid].params.logprobs
            if o is None or n is None:
                continue
            step = {int(t): lp for t, lp in zip(row[3:3 + width][:n], row[3 + width:3 + 2 * width][:n])}
            step[int(row[0])] = row[2]
            c = o.outputs[0]
            c.logprobs = (c.logprobs or []) + [step]
            c.cumulative_logprob = (c.cumulative_logprob or 0.0) + row[2]

    def _outputs_of(self, sampled: list[int], ended: list[int]) -> list[RequestOutput]:
        """Rank 0: a RequestOutput per request that got a token or ended (finished, aborted) this step."""
        if not self.ctx.is_main:
            return []
        now, out = time.time(), []
        for rid in dict.fromkeys(sampled + ended):
            o = self._outputs.get(rid)
            if o is None:
                continue
            r = self.scheduler.by_id[rid]
            if o.metrics.first_token_time is None and r.output:
                o.metrics.first_token_time = now
            o.outputs[0].token_ids = list(r.output)
            o.num_cached_tokens = r.num_cached_tokens or 0
            if r.finished:
                o.finished, o.metrics.finished_time = True, now
                o.outputs[0].finish_reason = r.status.finish_reason
                if r.status is RequestStatus.FINISHED_STOPPED:
                    o.outputs[0].stop_reason = r.output[-1]
                del self._outputs[rid], self._ids[o.request_id]
                self.scheduler.forget(rid)
            out.append(o)
        return out
