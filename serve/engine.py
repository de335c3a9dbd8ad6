"""The serving engine on the TP stack: nano-vllm's spine with vLLM's names.

    LLMEngine.step  ->  Scheduler.schedule  ->  BlockManager  ->  ModelRunner  ->  the TP model  ->  Sampler
                                                                                                 ->  Scheduler.update

`LLMEngine` (below) is the online engine: rank 0 adds and aborts requests between any two steps and every rank runs
the same steps. `Engine` is the offline driver over it that launch/serve.py, the benchmarks and the oracle tests
use: it adds each request before the step its `arrival` names, steps until every request has finished, and records
every iteration (rows, collectives against the model, blocks, times) into a ServeResult.

Memory is paged (docs/background.md, paged KV cache): the scheduler's BlockManager decides every request's block
table on the host, identically on every rank, and each rank's KVPool (one tensor, allocated once) stores K,V of the
rank's own heads at the slots those tables name. serve/inputs.py turns each plan into the iteration's tensors, once.

Every rank's scheduler makes the same plan because every rank sees the same requests at the same step (rank 0's
control message); the engine checks that cheaply: once at the start (a fingerprint of the settings, and for
`Engine` of the requests), and before each forward (one all-gather of a four-number plan fingerprint, in the
iteration's ledger). Any difference raises PlanMismatch on every rank, before a forward could issue collectives of
different sizes. Control traffic is CPU tensors over the group's gloo backend (under NCCL too: tp/dist.py), so it
never waits for a GPU. The traffic ledger records every collective of every step, and each step is compared with
the analytic model (tp/traffic_model.py: predict_control + predict_iteration).

Over pipeline stages (layers/pipeline.py's PPLM) the same engine runs as serve/pipeline.py's PipelineEngine (new_engine
picks it): one step is one tick of the pipeline, with up to pp micro-batches in flight.

What the host waits for, per step: one read of the sampled tokens and their logits (one device-to-host copy; it also
ends the iteration's clock, so timing costs no extra wait). The inputs go over in one host-to-device copy
(serve/inputs.py), the ledger counts without waiting, and per-collective times (comm_timing=True) add two waits for
the compute stream per collective.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from layers.lm import TPLM, TPLlamaLM, greedy_reference, oracle_verdict, sampled_reference
from layers.sampler import request_seed
from serve.block_manager import BlockManager
from serve.config import ATTENTION_MODES, EngineConfig
from serve.model_runner import ModelRunner
from serve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from serve.plan import FINGERPRINT_SIZE, IterationPlan
from serve.request import Request, RequestStatus, eos_ids, eos_key
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
    idle_steps_match: bool = True  # steps that ran nothing (control message alone) == the model, all of them

    @property
    def ledger_matches_model(self) -> bool:
        return self.idle_steps_match and all(it["ledger_matches_model"] for it in self.iterations)


def new_scheduler(requests: list[Request], *, chunk_size: int, max_batched_tokens: int, max_running: int | None = None,
                  eos_id: int | None = None, reserve_capacity: bool = EngineConfig.reserve_capacity,
                  block_size: int = EngineConfig.block_size, kv_blocks: int | None = None,
                  prefix_cache: bool = EngineConfig.prefix_cache) -> Scheduler:
    """A scheduler holding `requests` from the start, with a block pool of kv_blocks (or, null, enough for every
    request at its largest at once: such a run never preempts). Host only: serve/pd/ replays the prefill side's
    schedule with it, and Engine checks a workload with it before anything runs."""
    n_blocks = kv_blocks or worst_case_blocks(requests, block_size)
    return Scheduler(requests, chunk_size, max_batched_tokens, max_running, eos_id,
                     blocks=BlockManager(n_blocks, block_size, prefix_cache), reserve_capacity=reserve_capacity)


def next_plan(sched: Scheduler, index: int, before_schedule=None) -> tuple[IterationPlan | None, int]:
    """The plan of the next iteration that runs, from iteration `index` on, and its index. Iterations with nothing to
    run are skipped when a request arrives later (no forward for the idle stretch); waiting requests that can never
    get KV blocks raise instead of spinning; (None, index) when nothing is left. before_schedule(index): called before
    each iteration is planned. LLMEngine.step and the prefill schedule every P/D rank computes (serve/pd/) both
    plan with this, so they cannot drift apart."""
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
                                 f"{sched.blocks.num_blocks} free); raise kv_blocks")
        if upcoming is None:
            return None, index
        index = upcoming


def schedule_loop(sched: Scheduler, before_schedule=None):
    """Every plan of a workload held from the start, in order (host only); the caller applies each plan's tokens
    (sched.update) before asking for the next."""
    index = 0
    while sched.has_work():
        plan, index = next_plan(sched, index, before_schedule)
        if plan is None:
            return
        yield plan
        index += 1


# ---- the online engine: requests added and aborted between any two steps ----------------------------------------

CONTROL_HEADER = 4  # (new requests, aborted requests, payload length, flag), float64
REQUEST_FIELDS = 15  # per new request, before its stop ids, prompt and output: see _encode
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
    # pipeline parallelism (PipelineEngine): `plan` is the micro-batch that came back from the last stage this step
    entered: IterationPlan | None = None  # the micro-batch scheduled this step (it enters the first stage)
    ran: IterationPlan | None = None  # the micro-batch this rank's stage ran this step


class StepHook:
    """A check, a record or a hand-over run inside every LLMEngine step, on every rank; each does nothing here.
    serve/pd/'s prefill and decode sides are hooks too: they hand requests and their K,V from one group of
    ranks to another."""

    def before_schedule(self, engine: "LLMEngine") -> None:
        """Before iteration engine.index is planned, after the step's new requests were added (a decode side takes
        in the requests whose K,V have landed). Called again for each idle iteration skipped."""

    def before_forward(self, engine: "LLMEngine", plan: IterationPlan) -> None:
        """The plan about to run, its blocks reserved (a prefill side streaming K,V layer by layer needs to know it)."""

    def after_step(self, engine: "LLMEngine", step: StepRecord) -> None:
        """After the tokens are applied. Finished requests' blocks are free already, their contents intact until the
        next forward (step.plan.chunks still carries their block tables)."""

    def has_pending(self) -> bool:
        """Requests this hook will still add to the engine (a decode side's hand-overs still to come): a driver
        keeps stepping while any hook has some. The same on every rank at a step's boundary."""
        return False


def step_traffic(engine: "LLMEngine", step: StepRecord) -> tuple[list, list]:
    """The collectives the step's ledger saw, and the model's: the control message, and when a forward ran the plan
    check, the embedding, the blocks and the head's pick (tp/traffic_model.py)."""
    return engine.traffic(step)


class LedgerCheck(StepHook):
    """Every step's collectives against the model (step_traffic). A difference raises (on by default:
    EngineConfig.check_ledger). The record is the engine's last_iteration."""

    def after_step(self, engine: "LLMEngine", step: StepRecord) -> None:
        seen, predicted = step_traffic(engine, step)
        plan = step.plan
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
                                   blocks=BlockManager(self.num_blocks, c.block_size, c.prefix_cache),
                                   reserve_capacity=c.reserve_capacity)
        self.runner = ModelRunner(lm, ctx, self.num_blocks, c.block_size, c.attention)
        self.dtype = self.runner.dtype
        self.ledger = TrafficLedger(ctx.world_size, ctx.device, timing=c.comm_timing)
        self.index = 0  # the next step's iteration number
        self.stopped = False
        self.last_control = time.monotonic()  # when rank 0 last broadcast a control message (keep-alives read it)
        self.last_iteration: dict | None = None  # the record of the last step that ran a forward
        self.iterations = 0
        self.busy_s = 0.0  # wall time inside step() that ran a forward, summed (rank 0's clock)
        # running totals for a server's /metrics (stats())
        self.prefix_hit_tokens = 0  # prompt tokens whose K,V the prefix cache gave, at every admission
        self.prefix_queried_tokens = 0  # prompt tokens of every admission (the hit rate's denominator)
        self.collective_bytes_per_rank = 0.0  # sent by each rank in the steps' collectives (the ledger's count)
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

    def add(self, r: Request) -> None:
        """Queue a request built by the caller (rank 0): its id, arrival, stop ids, and any tokens it brings already
        computed (a P/D decode side's hand-over) are kept as they are; no RequestOutput is made for it (the caller
        reads the Request, which the scheduler updates in place). Engine, the offline driver, adds with this."""
        if not self.ctx.is_main:
            raise RuntimeError("add is called on rank 0; the other ranks receive requests in step()")
        self.scheduler.check_fits(r)
        if r.id in self.scheduler.by_id or any(q.id == r.id for q in self._new):
            raise ValueError(f"request {r.id} was added twice")
        self._next = max(self._next, r.id + 1)
        self._new.append(r)

    def add_computed(self, r: Request) -> None:
        """Every rank, at the same point of the same step (inside a hook's before_schedule, no control message: the
        ranks have agreed on it): a request whose first r.computed positions' K,V this rank holds already, from
        another group (serve/pd/'s decode side). It gets its blocks now (the caller writes its K,V at their
        slots: `self.scheduler.blocks.slots(r.id, 0, r.computed)`) and is admitted as a decode from this step on."""
        self.scheduler.add_computed(r, self.index)
        self._next = max(self._next, r.id + 1)

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

    def stats(self) -> dict:
        """Rank 0's view, cheap enough for every step: the pool, the queues, running totals, the last iteration's
        traffic record."""
        return {"num_blocks": self.num_blocks, "free_blocks": self.free_blocks,
                "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "iterations": self.iterations, "busy_s": self.busy_s, "preemptions": self.scheduler.preemptions,
                "prefix_hit_tokens": self.prefix_hit_tokens, "prefix_queried_tokens": self.prefix_queried_tokens,
                "collective_bytes_per_rank": self.collective_bytes_per_rank,
                "oracle": next((dict(h.verdicts) for h in self.hooks if hasattr(h, "verdicts")), None),
                "last_iteration": self.last_iteration}

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
            plan, self.index = next_plan(self.scheduler, self.index, self._before_schedule)
            if plan is not None:
                for hook in self.hooks:
                    hook.before_forward(self, plan)
                self._agree(plan.fingerprint(), f"iteration {plan.index}: ranks scheduled different rows")  # ★
                result, sampling = self.runner.run(plan, self.scheduler.by_id)
        if plan is None:  # nothing to run this step (nothing arrived, or all waiting requests were aborted)
            self._after(StepRecord(None, payload, None, ended=aborts))
            return self._outputs_of([], aborts)
        sampled = [c.request for c in plan.chunks if c.sample]
        rows = result.to_host()  # ★ the step's one wait for the device
        self.prefix_hit_tokens += plan.prefix_hits
        self.prefix_queried_tokens += sum(len(self.scheduler.by_id[rid].prompt) for rid in plan.admitted)
        self.collective_bytes_per_rank += sum(r.traffic().bytes_per_rank for r in self.ledger.records)
        finished = self.scheduler.update(plan, {rid: int(row[0]) for rid, row in zip(sampled, rows)})
        if result.logprob is not None:
            self._logprobs(sampled, rows, result.top_ids.shape[1])
        self._after(StepRecord(plan, payload, result.traffic(sampling), sampled, rows, aborts + finished))
        self.busy_s += time.perf_counter() - start
        self.index = plan.index + 1
        self.iterations += 1
        return self._outputs_of(sampled, aborts + finished)

    def traffic(self, step: StepRecord) -> tuple[list, list]:
        """step_traffic's two lists for this engine: one TP group, every collective over all of it."""
        seen = [r.traffic() for r in self.ledger.records]
        p, plan = self.ctx.world_size, step.plan
        predicted = predict_control(p, step.payload, CONTROL_HEADER)
        if plan is not None:
            predicted += predict_iteration(self.lm.cfg, p, plan.rows, len(plan.sample_rows), self.dtype,
                                           self.lm.variant, self.lm.vocab_parallel, FINGERPRINT_SIZE, step.sampler)
        return seen, predicted

    def _before_schedule(self, index: int) -> None:
        self.index = index  # an idle stretch skipped: hooks see the iteration about to be planned
        for hook in self.hooks:
            hook.before_schedule(self)

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
        """Each new request: REQUEST_FIELDS numbers (its seed is the one it samples with: every rank draws the same
        noise), its stop ids, its prompt, the tokens it already has; then the aborted ids. float64 holds ids and seeds
        below 2**53 exactly (SamplingParams refuses larger seeds, request_seed draws below 2**53)."""
        out: list[float] = []
        for r in new:
            q = r.params or SamplingParams(max_tokens=r.max_new_tokens)
            out += [r.id, r.arrival, r.max_new_tokens, len(r.prompt), len(r.stop_ids), len(r.output), r.computed,
                    r.params is not None, q.temperature, q.top_k, q.top_p, q.min_p, q.seed is not None,
                    r.sampling_seed or 0,
                    -1 if q.logprobs is None else q.logprobs]
            out += sorted(r.stop_ids) + r.prompt + r.output
        return out + aborts

    def _decode(self, payload: list[float], n_new: int, n_abort: int) -> tuple[list[Request], list[int]]:
        new, at = [], 0
        for _ in range(n_new):
            (rid, arrival, max_tokens, n_prompt, n_stop, n_output, computed, has_params, temp, top_k, top_p, min_p,
             has_seed, seed, logprobs) = payload[at:at + REQUEST_FIELDS]
            at += REQUEST_FIELDS
            stop = frozenset(int(t) for t in payload[at:at + int(n_stop)])
            at += int(n_stop)
            prompt = [int(t) for t in payload[at:at + int(n_prompt)]]
            at += int(n_prompt)
            output = [int(t) for t in payload[at:at + int(n_output)]]
            at += int(n_output)
            params = SamplingParams(int(max_tokens), temp, int(top_k), top_p, min_p, int(seed) if has_seed else None,
                                    logprobs=None if logprobs < 0 else int(logprobs)) if has_params else None
            new.append(Request(int(rid), prompt, int(max_tokens), int(arrival), output, int(computed), stop_ids=stop,
                               params=params, sampling_seed=None if params is None else int(seed)))
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
            if o is None or (n := self.scheduler.by_id[rid].params.logprobs) is None:
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


def new_engine(lm, ctx: TPContext, config: EngineConfig | None = None, eos_token_ids: tuple[int, ...] = (),
               seed: int = 0, hooks: list[StepHook] | None = None) -> LLMEngine:
    """An LLMEngine for a TP model; for a pipeline stage's model (layers/pipeline.py's PPLM, ctx the world's), the
    PipelineEngine of serve/pipeline.py."""
    if hasattr(lm, "forward_stage"):
        from serve.pipeline import PipelineEngine

        return PipelineEngine(lm, ctx, config, eos_token_ids, seed, hooks)
    return LLMEngine(lm, ctx, config, eos_token_ids, seed, hooks)


# ---- the offline driver: a workload known up front, every iteration recorded ---------------------------------------


class Recorder(StepHook):
    """Every iteration that ran, as a record (rows, collectives seen and predicted, blocks, times), and each request's
    token times and logits: what Engine.run returns in its ServeResult. on_iteration(record, scheduler): called with
    each record (launch/serve.py's progress lines)."""

    def __init__(self, result: ServeResult, on_iteration=None):
        self.result, self.on_iteration = result, on_iteration
        self.arrived_at: dict[int, float] = {}
        self.token_times: dict[int, list[float]] = {}
        self.logits: dict[int, list[float]] = {}
        self.t0 = 0.0
        self.before: dict[int, tuple[int, int, int]] = {}  # per plan: blocks used, positions held, running

    def before_schedule(self, engine: "LLMEngine") -> None:
        self.t0 = time.perf_counter()

    def before_forward(self, engine: "LLMEngine", plan: IterationPlan) -> None:
        sched = engine.scheduler
        for r in (*sched.waiting, *sched.running):  # arrived by now: its time to first token counts from here
            self.arrived_at.setdefault(r.id, self.t0)
        # this iteration's tables, before finishing requests give theirs back (kept per plan: in a pipeline the
        # plan comes back pp - 1 steps later)
        self.before[plan.index] = (sched.blocks.num_used, sched.positions_held(), len(sched.running))

    def after_step(self, engine: "LLMEngine", step: StepRecord) -> None:
        seen, predicted = step_traffic(engine, step)
        plan = step.plan
        if plan is None:  # a step that ran nothing (the control message alone)
            self.result.idle_steps_match &= seen == predicted
            return
        t1 = time.perf_counter()
        for rid, row in zip(step.sampled, step.rows):
            self.token_times.setdefault(rid, []).append(t1)
            self.logits.setdefault(rid, []).append(row[1])
        sched, ledger = engine.scheduler, engine.ledger
        blocks_used, positions_held, running = self.before.pop(plan.index)
        record = {
            "iteration": plan.index, "rows": plan.rows, "prefill_chunks": plan.prefill_chunks,
            "decodes": plan.decodes, "admitted": list(plan.admitted), "finished": list(step.ended),
            "preempted": list(plan.preempted),
            "triples": [[c.request, *c.triple] for c in plan.chunks],
            "sampled": len(plan.sample_rows),
            "control_payload": step.payload,  # float64 numbers of rank 0's control message past its header
            "collectives": dict(Counter(t.kind for t in seen)),
            "logical_bytes": sum(t.logical_bytes for t in seen),
            "bytes_per_rank": sum(t.bytes_per_rank for t in seen),
            "comm_time_s": sum(r.time_s for r in ledger.records) if ledger.timing else None,
            "ledger_matches_model": seen == predicted,
            "predicted_bytes_per_rank": sum(t.bytes_per_rank for t in predicted),
            "score_entries": plan.score_entries(), "cache_rows_read": plan.cache_rows_read(),
            "blocks_used": blocks_used, "kv_bytes_per_rank": blocks_used * engine.runner.cache.bytes_per_block,
            "time_s": t1 - self.t0,
            "prefix_hit_tokens": plan.prefix_hits,
            "positions_held": positions_held, "running": running,
            "start_s": self.t0 - self.result.started_at,  # when this iteration began, from the run's start
        }
        self.result.iterations.append(record)
        self.result.peak_blocks_used = max(self.result.peak_blocks_used, blocks_used)
        self.result.rows_computed += plan.rows
        if self.on_iteration is not None:
            self.on_iteration(record, sched)

    def request(self, r: Request, start: float) -> dict:
        times = self.token_times.get(r.id, [])
        gaps = [b - a for a, b in zip(times[:-1], times[1:])]
        return {
            "request": r.id, "arrival": r.arrival, "prompt_length": len(r.prompt),
            "generated": len(r.output), "output_ids": list(r.output), "logits": self.logits.get(r.id, []),
            "prefix_hit_tokens": r.prefix_hit, "preemptions": r.preemptions,
            "ttft_s": times[0] - self.arrived_at[r.id] if times else None,
            "mean_tbt_s": sum(gaps) / len(gaps) if gaps else None,
            "max_tbt_s": max(gaps) if gaps else None,
            "token_times_s": [t - start for t in times],  # when each token was ready, from the run's start
        }


class Engine:
    """A workload known up front, served by an LLMEngine on every rank of the group (SPMD: every rank calls run with
    the same requests): rank 0 adds each request before the step its `arrival` names (when nothing runs, the next
    arrivals at once: the engine skips the idle stretch without a forward) and steps until every request has
    finished; the other ranks step until rank 0 stops them. Every iteration is recorded (Recorder) and returned with
    the requests' tokens, logits and times in a ServeResult. launch/serve.py, the benchmarks and the oracle tests
    serve through this; LLM.generate (serve/llm.py) is the same loop over add_request with text in and out.

    eos_id (an id, or several) joins every request's stop ids; max_running None: as many as max_batched_tokens rows
    allow; kv_blocks None: enough for every request at its largest at once (such a run never preempts). hooks: more
    StepHooks (a P/D side, a capture in a test), run after the Recorder."""

    def __init__(self, lm: TPLM | TPLlamaLM, ctx: TPContext, *, chunk_size: int, max_batched_tokens: int,
                 max_running: int | None = None, eos_id: int | tuple[int, ...] | None = None,
                 block_size: int = EngineConfig.block_size, kv_blocks: int | None = None,
                 prefix_cache: bool = EngineConfig.prefix_cache, attention: str = EngineConfig.attention,
                 reserve_capacity: bool = EngineConfig.reserve_capacity,
                 comm_timing: bool = EngineConfig.comm_timing, chunk_pipelining: bool = EngineConfig.chunk_pipelining,
                 on_iteration=None,
                 hooks: StepHook | list[StepHook] | None = None, seed: int = 0):
        self.lm, self.ctx = lm, ctx
        self.settings = dict(chunk_size=chunk_size, max_batched_tokens=max_batched_tokens,
                             max_running=max_running or max_batched_tokens, block_size=block_size, kv_blocks=kv_blocks,
                             prefix_cache=prefix_cache, attention=attention, comm_timing=comm_timing,
                             reserve_capacity=reserve_capacity, chunk_pipelining=chunk_pipelining,
                             check_ledger=False)  # the Recorder compares instead
        try:
            EngineConfig(**self.settings)
        except ValueError as exc:
            raise SchedulerError(str(exc)) from None
        self.eos_id = eos_id
        self.on_iteration = on_iteration
        self.hooks = [] if hooks is None else [hooks] if isinstance(hooks, StepHook) else list(hooks)
        self.seed = seed  # sampled requests without a seed of their own: one drawn from this and the request's id
        self.engine: LLMEngine | None = None  # built by run(): its pool's size may depend on the requests
        self.cache = None

    @torch.no_grad()
    def run(self, requests: list[Request]) -> ServeResult:
        c = self.settings
        ids = [r.id for r in requests]  # every rank refuses what rank 0 alone would (before any collective)
        if len(set(ids)) != len(ids):
            raise SchedulerError(f"request ids {sorted({i for i in ids if ids.count(i) > 1})} are given twice")
        done = [r.id for r in requests if r.finished]
        if done:
            raise SchedulerError(f"requests {done} have finished already: give new Request objects")
        for r in requests:
            if r.params is not None and r.sampling_seed is None:
                r.sampling_seed = r.params.seed if r.params.seed is not None else request_seed(self.seed, r.id)
            r.stop_ids = r.stop_ids | eos_ids(self.eos_id)
        # every rank checks the workload against the settings (SchedulerError on every rank, before any collective)
        n_blocks = new_scheduler(requests, chunk_size=c["chunk_size"], max_batched_tokens=c["max_batched_tokens"],
                                 max_running=c["max_running"], reserve_capacity=c["reserve_capacity"],
                                 block_size=c["block_size"], kv_blocks=c["kv_blocks"],
                                 prefix_cache=c["prefix_cache"]).blocks.num_blocks
        config = EngineConfig(**{**c, "kv_blocks": n_blocks})
        result = ServeResult(kv_blocks=n_blocks, block_size=config.block_size)
        recorder = Recorder(result, self.on_iteration)
        engine = self.engine = new_engine(self.lm, self.ctx, config, seed=self.seed, hooks=[recorder, *self.hooks])
        self.cache = engine.runner.cache
        result.kv_pool_bytes_per_rank = self.cache.bytes
        engine._agree(self._fingerprint(requests, config), "requests or scheduler settings differ")
        wait_for_stream(self.ctx.device)  # the pool's zeroing is not billed to the first iteration
        start = result.started_at = time.perf_counter()
        if self.ctx.is_main:
            pending = sorted(requests, key=lambda q: (q.arrival, q.id))[::-1]  # the next arrival last
            while True:
                # add what has arrived; with nothing running, the next arrivals now (the step skips ahead to them)
                horizon = engine.index if engine.has_unfinished_requests() or not pending else \
                    max(engine.index, pending[-1].arrival)
                while pending and pending[-1].arrival <= horizon:
                    engine.add(pending.pop())
                if not engine.has_unfinished_requests() and not any(h.has_pending() for h in self.hooks):
                    break
                engine.step()
            engine.shutdown()
        else:
            while not engine.stopped:
                engine.step()
        wait_for_stream(self.ctx.device)
        result.time_s = time.perf_counter() - start
        sched = engine.scheduler
        sched.blocks.check()  # every count back to 0, every block free (or a bug in the block manager)
        result.free_blocks_at_end = sched.blocks.num_free
        result.kv_peak_bytes_per_rank = result.peak_blocks_used * self.cache.bytes_per_block
        result.preemptions = sched.preemptions
        # measured, not computed: the bytes the pool tensor holds per token position
        per_token = self.cache.measured_bytes_per_token()
        result.kv_bytes_per_token_per_rank = int(per_token) if per_token == int(per_token) else per_token
        for r in requests:
            served = sched.by_id[r.id]
            if served is not r:  # ranks other than 0 served the copies rank 0 sent: the caller's requests get the end
                for name in ("output", "computed", "finished", "prefix_hit", "num_cached_tokens", "preemptions",
                             "status", "arrival"):
                    setattr(r, name, getattr(served, name))
        given = {r.id for r in requests}
        served = requests + sorted((r for r in sched.by_id.values() if r.id not in given), key=lambda r: r.id)
        result.requests = [recorder.request(r, start) for r in served]  # and those hooks added (a decode side's)
        result.prefix_hit_tokens = sum(r.prefix_hit for r in served)
        return result

    def _fingerprint(self, requests: list[Request], config: EngineConfig) -> list[float]:
        """Four numbers from the scheduler settings and the requests: ranks given different ones disagree here."""
        knobs = [config.chunk_size, config.max_batched_tokens, config.max_running,
                 eos_key(self.eos_id), config.block_size, config.kv_blocks,
                 int(config.prefix_cache), ATTENTION_MODES.index(config.attention), int(config.reserve_capacity),
                 int(config.chunk_pipelining)]
        per_request = [(r.id, len(r.prompt), sum(r.prompt), r.max_new_tokens, r.arrival, r.computed) for r in requests]
        return [float(len(requests)), float(sum((i + 1) * k for i, k in enumerate(knobs))),
                float(sum((i + 1) * sum(x) for i, x in enumerate(per_request))),
                float(sum((i + 1) * (j + 1) * v for i, x in enumerate(per_request) for j, v in enumerate(x)))]
