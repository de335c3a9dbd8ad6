"""What runs inside every engine step besides the step itself, on every rank: checks and records as hooks around the
loop (StepHook), so that LLMEngine.step stays a few lines and every check still runs every iteration where it is on.

    LedgerCheck   every step's collectives against the model (on by default: EngineConfig.check_ledger)
    OracleCheck   rank 0: each finished request against the dense model recomputed with no cache (LLM(check=True))
    Recorder      every iteration as a record, each request's token times and logits (serve/offline.py's ServeResult)
"""

from __future__ import annotations

import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from layers.attention.eviction import logged_reference, streaming_reference
from layers.models.lm import greedy_reference, oracle_verdict, sampled_reference
from serve.plan import SchedulerOutput
from serve.request import Request, RequestStatus

# Annotations name LLMEngine (serve/engine.py) and ServeResult (serve/offline.py) as strings: those modules import
# this one, not the other way round.
@dataclass
class StepRecord:
    """What one LLMEngine step did, for its hooks (the same on every rank)."""

    plan: SchedulerOutput | None  # None: nothing ran (nothing to schedule)
    payload: int  # the control message's payload length
    sampler: tuple | None  # what the head's pick moved (SampleResult.traffic); None: greedy
    sampled: list[int] = field(default_factory=list)  # requests that got a token, in row order
    rows: list[list[float]] = field(default_factory=list)  # their host rows: id, logit[, logprobs]
    ended: list[int] = field(default_factory=list)  # requests that finished or were aborted this step
    # pipeline parallelism (PipelineEngine): `plan` is the micro-batch that came back from the last stage this step
    entered: SchedulerOutput | None = None  # the micro-batch scheduled this step (it enters the first stage)
    ran: SchedulerOutput | None = None  # the micro-batch this rank's stage ran this step
    verify: tuple | None = None  # a draft's verified rows: (rows, rounds, normalisers) of the rejection sampler
    prompt: tuple | None = None  # prompt logprobs: (rows scored, top N)


@torch.no_grad()
def check_request(dense, r: Request, output: list[int], logits: list[float], near_tie: float) -> dict:
    """The oracle: one request's tokens and their logits against the dense model recomputed with no cache at every
    step (greedy_reference, or sampled_reference with the request's noise), until the request's stop ids;
    oracle_verdict's dict (verdict "match", "near-tie" or "MISMATCH", ok, max_logit_rel_err, ...)."""
    ref = (greedy_reference(dense, r.prompt, r.max_new_tokens, r.stop_ids) if r.params is None or r.params.greedy
           else sampled_reference(dense, r.prompt, r.params, r.sampling_seed, r.stop_ids))
    return oracle_verdict(output, logits, ref, near_tie)


def eviction_reference(eviction, r: Request, block_size: int):
    """What the oracle masks for request r under kv_eviction (serve/eviction.py): streaming's window, or h2o's log of
    what went when (r.evictions); nothing without eviction."""
    if eviction is None:
        return nullcontext()
    if eviction.scored:
        return logged_reference(r.evictions, len(r.prompt), block_size)
    return streaming_reference(eviction.window)


class StepHook:
    """A check or a record run inside every LLMEngine step, on every rank; each does nothing here. (What moves K,V
    in or out of the engine is a KV connector, serve/kv_connector/: P/D's hand-over is one.)"""

    def before_schedule(self, engine: "LLMEngine") -> None:
        """Before iteration engine.index is planned, after the step's new requests were added. Called again for each
        idle iteration skipped."""

    def before_forward(self, engine: "LLMEngine", plan: SchedulerOutput) -> None:
        """The plan about to run, its blocks reserved."""

    def after_step(self, engine: "LLMEngine", step: StepRecord) -> None:
        """After the tokens are applied. Finished requests' blocks are free already, their contents intact until the
        next forward (step.plan.scheduled still carries their block tables)."""


def overriding(hooks: list[StepHook], name: str) -> list:
    """The hooks' `name` methods that do something: those a hook's class overrides (StepHook's own do nothing), so
    that a step calls only them."""
    return [getattr(h, name) for h in hooks if getattr(type(h), name) is not getattr(StepHook, name)]


class LedgerCheck(StepHook):
    """Every step's collectives against the model (engine.traffic: tp/traffic_model.py). A difference raises (on by default:
    EngineConfig.check_ledger). The record is the engine's last_iteration."""

    def after_step(self, engine: "LLMEngine", step: StepRecord) -> None:
        seen, predicted = engine.traffic(step)
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
    """Rank 0: each request that finishes (aborted ones aside) against the oracle (check_request); the verdict
    ("match", "near-tie", "MISMATCH") goes into its RequestOutput.oracle."""

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
            if engine.draft is not None and not engine.draft.shared_noise and r.params is not None \
                    and not r.params.greedy:
                # the rejection sampler draws p's distribution by another coupling than plain sampling: its tokens
                # are not plain sampling's (tests/test_spec_decode.py checks the distribution)
                verdict = {"verdict": "unchecked", "ok": True, "reason": "sampled with the rejection sampler"}
            else:
                with eviction_reference(engine.config.kv_eviction, r, engine.config.block_size):
                    verdict = check_request(self.dense, r, r.output, logits, self.near_tie)
            self.verdicts[verdict["verdict"]] += 1
            if rid in engine._outputs:
                engine._outputs[rid].oracle = verdict



class Recorder(StepHook):
    """Every iteration that ran, as a record (rows, collectives seen and predicted, blocks, times), and each request's
    token times and logits: what OfflineEngine.run returns in its ServeResult. on_iteration(record, scheduler): called with
    each record (launch/serve.py's progress lines)."""

    def __init__(self, result: "ServeResult", on_iteration=None):
        self.result, self.on_iteration = result, on_iteration
        self.arrived_at: dict[int, float] = {}
        self.token_times: dict[int, list[float]] = {}
        self.logits: dict[int, list[float]] = {}
        self.t0 = 0.0
        self.before: dict[int, tuple[int, int, int]] = {}  # per plan: blocks used, positions held, running

    def before_schedule(self, engine: "LLMEngine") -> None:
        self.t0 = time.perf_counter()

    def before_forward(self, engine: "LLMEngine", plan: SchedulerOutput) -> None:
        sched = engine.scheduler
        for r in (*sched.waiting, *sched.running):  # arrived by now: its time to first token counts from here
            self.arrived_at.setdefault(r.id, self.t0)
        # this iteration's tables, before finishing requests give theirs back (kept per plan: in a pipeline the
        # plan comes back pp - 1 steps later)
        self.before[plan.index] = (sched.blocks.num_used, sched.positions_held(), len(sched.running))

    def after_step(self, engine: "LLMEngine", step: StepRecord) -> None:
        seen, predicted = engine.traffic(step)
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
            "triples": [[c.request, *c.triple] for c in plan.scheduled],
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
