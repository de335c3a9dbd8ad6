"""The online engine on the TP stack: nano-vllm's spine with vLLM's names (docs/library.md, "How the ranks run").

    LLMEngine.step  ->  Scheduler.schedule  ->  KVCacheManager  ->  ModelRunner  ->  the TP model  ->  Sampler
                    ->  Scheduler.update_from_output

Every rank of the group runs the same steps (SPMD; LLMEngine lists the step's parts), each over its own paged KV pool
(docs/background.md, paged KV cache). Over pipeline stages the same step runs as serve/pipeline.py's PipelineEngine
(serve/build.py's new_engine picks the class); serve/offline.py's drive is the step loop.

What the host waits for, per step: one read of the sampled tokens and their logits (one device-to-host copy; it also
ends the iteration's clock). The inputs go over in one host-to-device copy (serve/model_runner.py's prepare_step),
the ledger counts without waiting, and per-collective times (comm_timing=True) add two waits per collective.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from layers.models.lm import TPLM, TPLlamaLM
from layers.sampling.sampler import SampleResult, request_seed
from serve.block_manager import KVCacheManager
from serve.config import EngineConfig
from serve.control import CONTROL_HEADER, IDLE, RUN, STOP, agree, broadcast_control
from serve.hooks import LedgerCheck, StepHook, StepRecord, overriding
from serve.model_runner import ModelRunner
from serve.outputs import CompletionOutput, RequestMetrics, RequestOutput, record_logprobs
from serve.plan import FINGERPRINT_SIZE, SchedulerOutput
from serve.request import Request, RequestStatus
from serve.sampling_params import SamplingParams
from serve.scheduler import Scheduler, check_request, next_plan
from serve.draft import DraftRunner, lm_vocab_slice
from serve.kv_connector.factory import make_connector
from serve.spec_decode import NgramProposer, SpecDecodeStats, Tuner
from tp.dist import TPContext
from tp.ledger import TrafficLedger
from tp.traffic_model import (predict_control, predict_eviction_scores, predict_iteration, predict_prompt_logprobs,
                              predict_tier_checks, predict_verify)


class Ran(NamedTuple):
    """What `_run` did this step: the plan whose tokens are ready (None: none came back), its sampled tokens on the
    device, what the head's pick moved, and the record's pipeline fields (entered, ran)."""

    done: SchedulerOutput | None
    result: SampleResult | None
    sampler: tuple | None
    extra: dict


class LLMEngine:
    """The online engine, on every rank of one TP group (SPMD): vLLM's add_request / step / abort_request.

    Requests arrive at rank 0 (`add_request`, `abort_request` queue them). Each `step`, on every rank:

        control   ★ rank 0 broadcasts what arrived and what was aborted since the last step (one message: a
                  header, then the payload when there is one), so that every rank's scheduler sees the same
                  requests at the same step
        schedule  Scheduler.schedule: finish, carry decodes, chunk, admit, preempt (host data, same on every rank)
        agree     ★ all-gather of the plan's fingerprint: a rank that planned otherwise raises PlanMismatch
        run       ModelRunner.run: the step's tensors, one forward through the TP model, the head's pick
        update    one read of the sampled ids (the step's wait), Scheduler.update_from_output: append, finish, free

    and rank 0 returns a RequestOutput for each request that produced a token or finished. The ranks other than 0
    call `step` in a loop until the control message says STOP (`shutdown`); while rank 0 has nothing to do it
    sends IDLE messages (`keep_alive`), so their wait in the broadcast never reaches the group's timeout. Every
    collective of a step goes into the traffic ledger, which a hook compares with the model (serve/hooks.py
    LedgerCheck; tp/traffic_model.py).
    """

    def __init__(self, lm: TPLM | TPLlamaLM, ctx: TPContext, config: EngineConfig | None = None,
                 eos_token_ids: tuple[int, ...] = (), seed: int = 0, hooks: list[StepHook] | None = None,
                 draft_lm=None, cp_group=None, connector=None):
        """hooks: run around every step; default LedgerCheck when config.check_ledger (an OracleCheck adds the dense
        oracle: LLM(check=True)). draft_lm: speculative decoding's draft model, whole on this rank (serve/draft.py),
        when config.speculative_config's method is draft_model."""
        self.lm, self.ctx, self.config = lm, ctx, config or EngineConfig()
        self.hooks = list(hooks) if hooks is not None else [LedgerCheck()] if self.config.check_ledger else []
        self._hook = {name: overriding(self.hooks, name) for name in ("before_schedule", "before_forward", "after_step")}
        self.seed = seed  # a request without a seed samples with one drawn from this and its id
        c, self.eos_token_ids = self.config, tuple(eos_token_ids)
        c.check_model_len(lm.cfg.max_seq_len)
        self.num_blocks = ModelRunner.pool_blocks(lm, c, cp_group)
        self.scheduler = Scheduler(c, KVCacheManager(self.num_blocks, c.block_size, c.enable_prefix_caching))
        self.cp = 1 if cp_group is None else cp_group.size()  # context parallelism: ctx is cp × tp ranks
        c.check_context_parallel(self.cp)
        self.runner = ModelRunner(lm, ctx, self.num_blocks, c, cp_group)
        # a KV connector (serve/kv_connector/; `connector`: one built by its driver, P/D's): its scheduler side in the
        # scheduler, its worker side in the runner and around each layer
        self.connector = self.runner.connector = connector or make_connector(c, ctx, self.runner.cache)
        self.scheduler.set_connector(self.connector)
        if self.connector is not None:
            self.connector.attach(self)
        self._on_schedule = self._before_schedule if self._hook["before_schedule"] or self.connector else None
        spec = c.speculative_config
        if (spec is not None and spec.method == "draft_model") != (draft_lm is not None):
            raise ValueError("speculative_config method='draft_model' and draft_lm go together: give both or neither")
        # speculative decoding's proposer (serve/spec_decode.py Proposer), or None
        self.proposer = None if spec is None else NgramProposer(spec) if draft_lm is None else DraftRunner(
            spec, draft_lm, self.num_blocks, c.block_size, self.runner.attention, ctx.device, lm_vocab_slice(lm))
        self.draft = self.proposer if draft_lm is not None else None
        self.dtype = self.runner.dtype
        self.ledger = TrafficLedger(ctx.world_size, ctx.device, timing=c.comm_timing)
        self.ledger.label_layers(self.lm.stack, self.first_layer)  # once: each step then only records
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
        self.spec_stats = SpecDecodeStats(0 if spec is None else spec.num_speculative_tokens)
        # rank 0's choice of proposals per step (speculative_config adaptive), and the slots each request was offered
        self.tuner = Tuner(spec.num_speculative_tokens) if spec is not None and spec.adaptive else None
        self._offered: dict[int, int] = {}
        # rank 0 only: what arrived since the last step, and the request ids users gave
        self._new: list[Request] = []
        self._aborts: list[int] = []
        self._ids: dict[str, int] = {}
        self._outputs: dict[int, RequestOutput] = {}
        self._next = 0

    # -- rank 0: requests in -----------------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    prompt: str | None = None, priority: int = 0) -> None:
        """Queue a request for the next step (rank 0). Bad input raises ValueError here, before any collective.
        priority: with scheduling_policy "priority", lower is admitted first and preempted last (vLLM's meaning)."""
        self._main_only("add_request")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, not {type(params).__name__}")
        if request_id in self._ids:
            raise ValueError(f"request_id {request_id!r} is already running")
        budget = check_request(self.config, self.lm.cfg, self.num_blocks, self.runner.block_bytes, prompt_token_ids,
                               params, priority)
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        seed = params.seed if params.seed is not None else request_seed(self.seed, self._next)
        r = Request(self._next, list(prompt_token_ids), budget, self.index, stop_ids=frozenset(stop),
                    params=params, sampling_seed=seed, priority=priority)
        self._next += 1
        self._ids[request_id] = r.id
        self._outputs[r.id] = RequestOutput(request_id, prompt, r.prompt, [CompletionOutput(0, "", r.output)], False,
                                            RequestMetrics(time.time()))
        if params is not None and params.prompt_logprobs is not None:  # filled as the prompt's rows are computed
            self._outputs[r.id].prompt_logprobs = [None] * len(r.prompt)
        self._new.append(r)

    def add(self, r: Request) -> None:
        """Queue a request built by the caller (rank 0): its id, arrival, stop ids, and any tokens it brings already
        computed (a P/D decode side's hand-over) are kept as they are; no RequestOutput is made for it (the caller
        reads the Request, which the scheduler updates in place). OfflineEngine adds with this."""
        self._main_only("add")
        self.scheduler.check_fits(r)
        if r.id in self.scheduler.by_id or any(q.id == r.id for q in self._new):
            raise ValueError(f"request {r.id} was added twice")
        self._next = max(self._next, r.id + 1)
        self._new.append(r)

    def add_computed(self, r: Request) -> None:
        """Every rank, at the same point of the same step (inside a hook's before_schedule, no control message: the
        ranks have agreed on it): a request whose first r.num_computed_tokens positions' K,V this rank holds already,
        from another group (serve/pd/'s decode side). It gets its blocks now (the caller writes its K,V at their
        slots: `self.scheduler.blocks.slots(r.id, 0, r.num_computed_tokens)`) and is admitted as a decode."""
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

    def _main_only(self, call: str) -> None:
        if not self.ctx.is_main:
            raise RuntimeError(f"{call} is called on rank 0; the other ranks receive requests in step()")

    @property
    def free_blocks(self) -> int:
        return self.scheduler.blocks.num_free

    def stats(self) -> dict:
        """Rank 0's view, cheap enough for every step: the pool, the queues, running totals, the last iteration's
        traffic record."""
        return {"num_blocks": self.num_blocks, "free_blocks": self.free_blocks, "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting), "iterations": self.iterations, "busy_s": self.busy_s,
                "preemptions": self.scheduler.preemptions, "kv_evicted_blocks": self.scheduler.blocks.evicted,
                "prefix_hit_tokens": self.prefix_hit_tokens, "prefix_queried_tokens": self.prefix_queried_tokens,
                "collective_bytes_per_rank": self.collective_bytes_per_rank,
                "oracle": next((dict(h.verdicts) for h in self.hooks if hasattr(h, "verdicts")), None),
                **(self.spec_stats.as_dict() if self.config.speculative_config is not None else {}),
                **(self.tuner.as_dict() if self.tuner else {}),
                **(self.connector.stats() if self.connector else {}), "last_iteration": self.last_iteration}

    # -- every rank: one step ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> list[RequestOutput]:
        """One iteration on every rank; rank 0 returns the outputs of the requests it moved (the others: [])."""
        start = time.perf_counter()
        self._begin()
        with self.ledger.recording():
            flag, new, aborts, payload, k = self._control(RUN, self._proposals())  # ★ broadcast: arrivals, aborts
            if flag != RUN:
                self.stopped = flag == STOP
                self._flush()
                return []
            for r in new:
                self.scheduler.add(r)
            for rid in aborts:
                self.scheduler.abort(rid)
            if self.proposer is not None:
                self._offered = self.proposer.prepare(self.scheduler.running, k)  # proposals, or placeholders
            plan, self.index = next_plan(self.scheduler, self.index, self._on_schedule)
            if plan is not None:
                plan = plan if self.proposer is None else self.proposer.fill(plan, self.scheduler.by_id)
                for call in self._hook["before_forward"]:
                    call(self, plan)
                agree(self.ctx, plan.fingerprint, f"iteration {plan.index}: ranks scheduled different rows")  # ★
            ran = self._run(plan)
        if ran.done is None:  # nothing came back this step (nothing to run, or a pipeline filling)
            self._after(StepRecord(None, payload, ran.sampler, ended=aborts, **ran.extra))
            return self._outputs_of([], aborts)
        plan, sched = ran.done, self.scheduler
        table, scored, scores = ran.result.read()  # ★ the step's one wait (host copy): sampled and scored rows, h2o's
        sampled, rows, finished = self._update(plan, table, scores)
        self.prefix_hit_tokens += plan.prefix_hits
        self.prefix_queried_tokens += sum(len(sched.by_id[rid].prompt) for rid in plan.admitted if rid in sched.by_id)
        self.collective_bytes_per_rank += sum(r.traffic().bytes_per_rank for r in self.ledger.records)
        record_logprobs(self._outputs, sched.by_id, sampled, rows, ran.result, scored)
        self._after(StepRecord(plan, payload, ran.sampler, sampled, rows, aborts + finished, **ran.extra))
        self._timed(plan, k, time.perf_counter() - start)
        self.iterations += 1
        return self._outputs_of(sampled, aborts + finished)

    # -- what a pipeline overrides (serve/pipeline.py) ---------------------------------------------------------------

    first_layer = 0  # the model's number of this rank's first block (a pipeline stage's is later)

    def _run(self, plan: SchedulerOutput | None) -> Ran:
        """The plan through this rank's model: its tokens are ready at once (one group, no pipeline)."""
        if plan is None:
            return Ran(None, None, None, {})
        if self.draft is not None and self.draft.verify is not None:  # the rejection sampler verifies a draft's rows
            result, sampling, verify = self.runner.run_verified(plan, self.scheduler.by_id, *self.draft.verify)
            self.draft.verify, extra = None, {"verify": verify}
        else:
            result, sampling = self.runner.run(plan, self.scheduler.by_id)
            extra = {} if result.prompt is None else {"prompt": (result.prompt.shape[0], result.prompt.shape[1] // 2)}
        self.index = plan.index + 1
        return Ran(plan, result, result.traffic(sampling), extra)

    def _begin(self) -> None:
        """A step's records start empty: the ledger's collectives, a pipeline's boundary messages, the connector's."""
        self.ledger.clear()
        self.ledger.transfers.clear()
        if self.connector is not None:
            self.connector.begin_step()

    def _flush(self) -> None:
        """A control message without a step (IDLE, STOP): what is in flight is waited for (a pipeline's sends)."""

    def traffic(self, step: StepRecord) -> tuple[list, list]:
        """The collectives the step's ledger saw, and the model's: the control message, and when a forward ran the
        plan check, the embedding, the blocks and the head's pick (tp/traffic_model.py); one group, every collective
        over all of it."""
        seen = [r.traffic() for r in self.ledger.records]
        p, plan = self.ctx.world_size, step.plan
        predicted = predict_control(p, step.payload, CONTROL_HEADER)
        if self.connector is not None:
            predicted += predict_tier_checks(p // self.cp, self.connector.step_checks())
        if plan is not None:
            verified = 0 if step.verify is None else step.verify[0]
            predicted += predict_iteration(self.lm.cfg, p // self.cp, plan.rows, len(plan.sample_rows) - verified,
                                           self.dtype, self.lm.variant, self.lm.vocab_parallel, FINGERPRINT_SIZE,
                                           step.sampler, self.cp)
            if step.verify is not None:
                predicted += predict_verify(p, *step.verify, self.lm.cfg.vocab_size, self.dtype)
            if step.prompt is not None and self.lm.vocab_parallel:
                predicted += predict_prompt_logprobs(p // self.cp, *step.prompt)
            predicted += predict_eviction_scores(p, sum(len(c.blocks) for c in plan.scheduled if c.scored), self.dtype)
        return seen, predicted

    # -- the pieces --------------------------------------------------------------------------------------------------

    def _update(self, plan: SchedulerOutput, rows: list[list[float]], scores=None) -> tuple[list[int], list, list[int]]:
        """The scheduler takes the step's tokens (and h2o's scores); (a request id per token a request got, its row of
        the table, the requests that finished). A verified chunk gives its rows up to its last accepted one (fewer if
        the request ended there); a token of a request aborted in flight is dropped."""
        sched = self.scheduler
        per_request = self._tokens_of(plan, rows)
        held = {rid: len(sched.by_id[rid].output) for rid in per_request if rid in sched.by_id}
        finished = sched.update_from_output(plan, {rid: tokens for rid, (tokens, _) in per_request.items()}, scores)
        live = [(rid, row) for rid, (_, its) in per_request.items() if rid in held
                and sched.by_id[rid].status is not RequestStatus.FINISHED_ABORTED
                for row in its[:len(sched.by_id[rid].output) - held[rid]]]
        return [rid for rid, _ in live], [row for _, row in live], finished

    def _tokens_of(self, plan: SchedulerOutput, rows: list[list[float]]) -> dict[int, tuple[list[int], list]]:
        """Each sampled request's new tokens and their rows of the table: a chunk's one token, or a verified chunk's
        accepted proposals and the target's own (the proposer's accept), counted in the acceptance stats."""
        out, i = {}, 0
        for c in plan.scheduled:
            if c.sample:
                its = rows[i:i + len(c.spec) + 1]
                i += len(its)
                tokens = self.proposer.accept(its, c.spec) if c.spec else [int(its[0][0])]
                if c.spec:
                    self.spec_stats.observe(len(c.spec), len(tokens) - 1)
                if self.tuner is not None and self._offered.get(c.request):
                    self.tuner.observe(self._offered[c.request], len(tokens) - 1)
                out[c.request] = (tokens, its)
        return out

    def _before_schedule(self, index: int) -> None:
        self.index = index  # an idle stretch skipped: hooks see the iteration about to be planned
        for call in self._hook["before_schedule"]:
            call(self)
        if self.connector is not None:
            self.connector.update_connector_output(self)

    def _after(self, step: StepRecord) -> None:
        for call in self._hook["after_step"]:
            call(self, step)

    def keep_alive(self) -> None:
        """Rank 0 with nothing to do: an IDLE control message, so the other ranks' wait never times out."""
        self._control(IDLE)

    def shutdown(self) -> None:
        """Rank 0: tell every rank to leave its step loop (they see STOP in their next control message)."""
        if not self.stopped:
            self._control(STOP)
            self.stopped = True
            self._flush()

    def _timed(self, plan: SchedulerOutput, k: int, took: float) -> None:
        """A step that ran a forward took `took` s; a decode-only one tells the Tuner what k proposals cost."""
        self.busy_s += took
        if self.tuner is not None and self.ctx.is_main and all(c.decode for c in plan.scheduled):
            self.tuner.observe_step(len(plan.scheduled), k, took)

    def _proposals(self) -> int:
        """Rank 0: speculative decoding's proposals per request for this step (the Tuner's choice, or K)."""
        spec = self.config.speculative_config
        if spec is None:
            return 0
        if self.tuner is None or not self.ctx.is_main:
            return spec.num_speculative_tokens
        decoding = [r for r in self.scheduler.running if r.decoding]
        return self.tuner.choose(len(decoding), all(r.params is None or r.params.greedy for r in decoding))

    def _control(self, flag: int, proposals: int = 0) -> tuple[int, list[Request], list[int], int, int]:
        """★ rank 0's control message (serve/control.py); a RUN message takes what arrived and what was aborted,
        and the step's proposals per request."""
        self.last_control = time.monotonic()
        new, aborts = (self._new, self._aborts) if flag == RUN and self.ctx.is_main else ([], [])
        out = broadcast_control(self.ctx, flag, new, aborts, proposals)
        if flag == RUN and self.ctx.is_main:
            self._new, self._aborts = [], []
        return out

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
