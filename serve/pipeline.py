"""The online engine over pp pipeline stages × tp ranks (layers/models/pipeline.py's PPLM): up to pp micro-batches in
flight (docs/serving.md, "Serving through pipeline stages").

Every rank of the world runs the same steps (SPMD, as LLMEngine), and a step is one tick of the pipeline: rank 0's
control message to the world; a new micro-batch from the requests not in flight (Scheduler.microbatch_cap: 1/pp of
those that could run) and ★ its plan check; stage s runs the micro-batch that entered s ticks ago (received from the
stage before, its blocks over its own pool, posted to the next); and ★ the micro-batch that entered pp − 1 ticks ago
leaves the last stage, its tokens broadcast to every rank ("pp/tokens", the step's one wait), where every scheduler
applies them. Every rank's collectives and boundary messages of every step are compared with the model, as
LLMEngine's are. Each rank keeps its timeline: per step, which micro-batch its stage ran and for how long (host time:
on a GPU, without a wait for the stream, a stage's busy time is the time to launch its work, not the device's).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from layers.sampling.sampler import table_width
from serve.control import CONTROL_HEADER
from serve.engine import LLMEngine, Ran
from serve.hooks import StepRecord
from serve.model_runner import Prepared
from serve.plan import FINGERPRINT_SIZE, SchedulerOutput
from tp.ledger import Traffic
from tp.traffic_model import predict_control, predict_pp_stage, predict_sampler


TIMELINE_STEPS = 1 << 16  # the most recent steps each rank keeps in its timeline (a server runs for long)


@dataclass
class InFlight:
    plan: SchedulerOutput
    prepared: Prepared  # its tensors, built once when it was scheduled
    tick: int  # the step at which it entered the first stage


class PipelineEngine(LLMEngine):
    """LLMEngine's add_request / step / abort_request over a PPLM (this rank's stage); ctx is the world's context."""

    def __init__(self, lm, ctx, config=None, eos_token_ids=(), seed: int = 0, hooks=None, connector=None):
        super().__init__(lm, ctx, config, eos_token_ids, seed, hooks, connector=connector)
        self.pp, self.stage = lm.layout.pp, lm.index
        self.scheduler.stages = self.pp
        self.queue: deque[InFlight] = deque()
        # per step that had work: the micro-batch this rank's stage ran (None: idle) and its rows, the time in its
        # blocks (busy_s) and in the whole step (step_s), when its blocks began (start_s: time.perf_counter()), the
        # bytes it sent across the boundary
        self.timeline: deque[dict] = deque(maxlen=TIMELINE_STEPS)
        self._width = 2  # columns of the last token table broadcast
        self.stage_plan: SchedulerOutput | None = None  # the micro-batch this rank's stage is running
        self._incoming = None  # the receive posted for the next step's input (a stage after the first)
        self._ticked = False  # this step appended to the timeline

    @property
    def first_layer(self) -> int:
        return self.lm.layers.start  # the ledger labels this stage's blocks with the model's layer numbers

    def _flush(self) -> None:
        self.lm.flush()  # the stage's last sends: received by now, waited for

    def step(self):
        start = time.perf_counter()
        self._ticked = False
        out = super().step()
        if self._ticked:  # this step had work: its timeline entry gets the step's whole time
            self.timeline[-1]["step_s"] = time.perf_counter() - start
        return out

    def _run(self, entered: SchedulerOutput | None) -> Ran:
        """One tick: the new micro-batch enters the first stage, this rank's stage runs the micro-batch that entered
        `stage` ticks ago, and the one that entered pp - 1 ticks ago comes back (its tokens broadcast to every
        rank: pp/tokens)."""
        lm, sched = self.lm, self.scheduler
        if entered is not None:
            prepared = self.runner.prepare(entered, sched.by_id)  # before dispatch moves num_computed_tokens on
            sched.dispatch(entered)
            self.queue.append(InFlight(entered, prepared, self.index))
        if not self.queue:  # nothing in flight and nothing to run
            return Ran(None, None, None, {})
        mine = next((e for e in self.queue if e.tick == self.index - self.stage), None)
        table, picked, t0 = None, None, time.perf_counter()
        self.stage_plan = None if mine is None else mine.plan  # what this stage runs now (a hook may ask)
        if mine is not None:
            received, self._incoming = self._incoming, None
            x = self.runner.forward_stage(mine.prepared, mine.plan.index, received)
            if lm.last and mine.plan.sample_rows:
                table, picked = lm.sample(x, mine.prepared.step.sample_rows, mine.prepared.sampling)
        busy = time.perf_counter() - t0
        before = next((e for e in self.queue if e.tick == self.index - self.stage + 1), None)
        if not lm.first and before is not None:  # the stage before sent its rows this step: post their receive
            self._incoming = lm.link.post_receive(before.plan.rows, before.plan.index)  # before the broadcast
        done, result = None, None
        if self.queue[0].tick == self.index - (self.pp - 1):
            done = self.queue.popleft()
            self._width = table_width(done.prepared.sampling)
            result = lm.broadcast_tokens(table, len(done.plan.sample_rows), self._width, self.ctx.device)  # ★
        self.timeline.append({"tick": self.index, "microbatch": None if mine is None else mine.plan.index,
                              "rows": 0 if mine is None else mine.plan.rows, "busy_s": busy, "start_s": t0,
                              "sent_bytes": sum(t.bytes for t in self.ledger.transfers if t.kind == "send")})
        self._ticked = True
        ran = None if mine is None else mine.plan
        sampler = None if picked is None else picked.traffic(mine.prepared.sampling)
        self.index += 1
        return Ran(None if done is None else done.plan, result, sampler, {"entered": entered, "ran": ran})

    def traffic(self, step: StepRecord) -> tuple[list, list]:
        """This rank's collectives and boundary messages in the step, and the model's: the control message over the
        world; the new micro-batch's plan check; its stage's part of the micro-batch it ran (the embedding's
        all-reduce on the first stage, predict_pp_stage, the head's pick on the last); the returning micro-batch's
        tokens broadcast over the world."""
        lm, world, tp = self.lm, self.ctx.world_size, self.lm.layout.tp
        seen = [r.traffic() for r in self.ledger.records] + [t.transfer() for t in self.ledger.transfers]
        predicted = predict_control(world, step.payload, CONTROL_HEADER)
        messages = []

        def extra(sublayer, site, kind, shape, dtype, p):
            return Traffic.of(layer=None, sublayer=sublayer, site=site, phase="forward", kind=kind, shape=shape,
                              dtype=dtype, p=p)

        if step.entered is not None:
            predicted.append(extra("engine", "plan check", "all_gather", (1, FINGERPRINT_SIZE * world), torch.float64,
                                   world))
        if step.ran is not None:
            n, cfg = step.ran.rows, lm.model_cfg
            if lm.first and lm.vocab_parallel and tp > 1:
                predicted.append(extra("embed", "all-reduce", "all_reduce", (n, cfg.d_model), self.dtype, tp))
            collectives, sent = predict_pp_stage(cfg, lm.layout.pp, tp, lm.global_rank, n, self.dtype, lm.variant,
                                                 lm.link.mode)
            predicted += collectives
            messages = [replace(m, request=step.ran.index) for m in sent]  # numbered by the micro-batch
            sampled = len(step.ran.sample_rows)
            if lm.last and sampled and lm.vocab_parallel and tp > 1:
                predicted += predict_sampler(tp, sampled, step.sampler, cfg.vocab_size, self.dtype)
        if step.plan is not None and step.plan.sample_rows:
            predicted.append(extra("pp", "tokens", "broadcast", (len(step.plan.sample_rows), self._width),
                                   torch.float64, world))
        return seen, predicted + messages


def stage_report(engine: PipelineEngine) -> dict:
    """Every rank's timeline gathered (a collective over the world: every rank calls it). Per stage: its ranks and
    layers, the steps it had and the micro-batches it ran, its busy time (inside its blocks; the slowest TP rank's)
    and idle time, the bytes each of its ranks sent across the boundary; the bubble, the idle share of all
    stage-steps (host times); and each stage's timeline (its TP rank 0's steps, start_s on the host's clock)."""
    lm, ctx = engine.lm, engine.ctx
    mine = {"rank": ctx.rank, "stage": lm.index, "layers": [lm.layers.start, lm.layers.stop],
            "timeline": list(engine.timeline)}
    every = [None] * ctx.world_size
    dist.all_gather_object(every, mine, group=ctx.group)
    stages = []
    for stage in range(lm.layout.pp):
        ranks = [e for e in every if e["stage"] == stage]
        line = ranks[0]["timeline"]
        busy = max(sum(t["busy_s"] for t in e["timeline"]) for e in ranks)
        wall = sum(t["step_s"] for t in line)
        stages.append({"stage": stage, "ranks": [e["rank"] for e in ranks], "layers": ranks[0]["layers"],
                       "steps": len(line), "microbatches": sum(t["microbatch"] is not None for t in line),
                       "busy_s": busy, "wall_s": wall, "idle_s": max(wall - busy, 0.0),
                       "sent_bytes_per_rank": max(sum(t["sent_bytes"] for t in e["timeline"]) for e in ranks),
                       "timeline": line})
    wall = sum(x["wall_s"] for x in stages)
    return {"pp": lm.layout.pp, "tp": lm.layout.tp, "boundary": lm.link.mode, "stages": stages,
            "bubble": 1 - sum(x["busy_s"] for x in stages) / wall if wall else None}
