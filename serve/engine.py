"""The serving loop on the TP stack: plan -> tensors -> one forward -> greedy tokens -> evict/admit.

Every rank runs this loop with the same requests and settings, so every rank's scheduler
makes the same plan; the engine checks that cheaply: once at the start (a fingerprint of the
requests and scheduler settings), before each forward (one all-gather of a four-number plan
fingerprint, in the iteration's ledger), and once when its loop ends (so a rank that thinks it
is done meets a rank that still plans in the same all-gather). Any difference raises
PlanMismatch on every rank. The traffic ledger records every collective of every iteration,
and each iteration is compared with the analytic model (tp/traffic_model.py: predict_iteration).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from layers.lm import TPLM, TPLlamaLM
from serve.kv_cache import KVCache
from serve.plan import FINGERPRINT_SIZE, IterationPlan
from serve.scheduler import Request, Scheduler
from tp.comm import gather_from_region
from tp.dist import TPContext, synchronize
from tp.ledger import TrafficLedger
from tp.traffic_model import predict_iteration


class PlanMismatch(RuntimeError):
    """Ranks scheduled different rows: their collectives would no longer describe the same tensors."""


@dataclass
class ServeResult:
    iterations: list[dict] = field(default_factory=list)
    requests: list[dict] = field(default_factory=list)
    kv_peak_bytes_per_rank: int = 0
    kv_bytes_per_token_per_rank: int | float = 0  # peak bytes / peak token capacity of this rank's cache
    time_s: float = 0.0
    started_at: float = 0.0  # time.perf_counter() when the loop started: start_s and token_times_s count from it

    @property
    def ledger_matches_model(self) -> bool:
        return all(it["ledger_matches_model"] for it in self.iterations)


class EngineHooks:
    """Steps a caller can add to the loop; each does nothing here. serve/disagg.py's prefill and decode
    sides use them to hand requests and their K,V from one group of ranks to another."""

    def before_schedule(self, index: int, sched: Scheduler, cache: KVCache) -> None:
        """Before iteration `index` is planned (a decode side receives the requests arriving now)."""

    def before_forward(self, plan: IterationPlan) -> None:
        """The plan about to run (a prefill side streaming K,V layer by layer needs to know it)."""

    def after_update(self, plan: IterationPlan, evicted: list[int], sched: Scheduler, cache: KVCache) -> None:
        """After the tokens are applied, before the evicted requests' cache regions are freed."""


class Engine:
    def __init__(self, lm: TPLM | TPLlamaLM, ctx: TPContext, *, chunk_size: int, max_batched_tokens: int,
                 max_running: int | None = None, eos_id: int | None = None, on_iteration=None,
                 hooks: EngineHooks | None = None):
        self.lm, self.ctx = lm, ctx
        self.sched_args = dict(chunk_size=chunk_size, max_batched_tokens=max_batched_tokens,
                               max_running=max_running, eos_id=eos_id)
        self.on_iteration = on_iteration  # called with each iteration's record (progress lines)
        self.hooks = hooks or EngineHooks()
        cfg = lm.cfg
        param = next(lm.parameters())
        self.dtype = param.dtype
        # K,V heads this rank caches: h/p (GPT-2), max(h_kv/p, 1) (Llama's grouped-query attention)
        self.cache = KVCache(cfg.n_layers, lm.cache_heads, cfg.d_head, self.dtype, ctx.device)

    @torch.no_grad()
    def run(self, requests: list[Request]) -> ServeResult:
        sched = Scheduler(requests, **self.sched_args)
        for r in sched.running:  # requests resumed mid-stream keep their cache rows
            self.cache.allocate(r.id, r.capacity)
        result = ServeResult()
        arrived_at: dict[int, float] = {}
        token_times: dict[int, list[float]] = {r.id: [] for r in requests}
        logits: dict[int, list[float]] = {r.id: [] for r in requests}
        ledger = TrafficLedger(self.ctx.world_size, self.ctx.device)
        self._agree(self._settings_fingerprint(requests), "requests or scheduler settings differ")
        synchronize(self.ctx.device)
        start = result.started_at = time.perf_counter()
        index = 0
        while sched.has_work():
            t0 = time.perf_counter()
            self.hooks.before_schedule(index, sched, self.cache)
            for r in requests:
                if r.arrival <= index and r.id not in arrived_at:
                    arrived_at[r.id] = t0
            plan = sched.schedule(index)
            if plan is None:  # nothing running, the next request arrives later: skip ahead, no forward
                index = sched.next_arrival() or index  # None: all finished, the loop ends
                continue
            for rid in plan.admitted:
                if rid not in self.cache.regions:  # a request handed over with its K,V already has its region
                    self.cache.allocate(rid, sched.by_id[rid].capacity)
            ledger.clear()
            with ledger.attach(self.lm.stack):
                self._check_plan(plan)
                self.hooks.before_forward(plan)
                tokens, token_logits = self._forward(plan, sched)
            synchronize(self.ctx.device)
            t1 = time.perf_counter()
            sampled_ids = [c.request for c in plan.chunks if c.sample]
            for rid, tok, lg in zip(sampled_ids, tokens.tolist(), token_logits.tolist()):
                token_times[rid].append(t1)
                logits[rid].append(lg)
            evicted = sched.update(plan, dict(zip(sampled_ids, tokens.tolist())))
            kv_bytes = self.cache.bytes()  # before this iteration's evictions free anything
            self.hooks.after_update(plan, evicted, sched, self.cache)
            for rid in evicted:
                self.cache.free(rid)
            record = self._record(plan, evicted, ledger, t1 - t0, kv_bytes)
            record["start_s"] = t0 - start  # when this iteration began, from the run's start (timelines)
            result.iterations.append(record)
            if self.on_iteration is not None:
                self.on_iteration(record, sched)
            index += 1
        self._check_plan(IterationPlan(index, ()))  # "done": differs from any plan a rank still running makes
        synchronize(self.ctx.device)
        result.time_s = time.perf_counter() - start
        result.kv_peak_bytes_per_rank = self.cache.peak_bytes
        # measured, not computed: the bytes the cache's tensors held per token position at their peak
        per_token = self.cache.measured_bytes_per_token()
        result.kv_bytes_per_token_per_rank = int(per_token) if per_token == int(per_token) else per_token
        for r in requests:
            times = token_times[r.id]
            gaps = [b - a for a, b in zip(times[:-1], times[1:])]
            result.requests.append({
                "request": r.id, "arrival": r.arrival, "prompt_length": len(r.prompt),
                "generated": len(r.output), "output_ids": list(r.output), "logits": logits[r.id],
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
        mine = torch.tensor([fingerprint], dtype=torch.float64, device=self.ctx.device)
        every = gather_from_region(mine, self.ctx.group, "engine/plan check").view(-1, FINGERPRINT_SIZE)
        if not bool((every == every[0]).all()):
            raise PlanMismatch(f"{what} (fingerprints {every.tolist()}); every rank must get the same requests "
                               f"and settings")

    def _settings_fingerprint(self, requests: list[Request]) -> list[float]:
        a = self.sched_args
        knobs = [a["chunk_size"], a["max_batched_tokens"], a["max_running"] or -1,
                 -1 if a["eos_id"] is None else a["eos_id"]]
        per_request = [(r.id, len(r.prompt), sum(r.prompt), r.max_new_tokens, r.arrival, r.computed) for r in requests]
        return [float(len(requests)), float(sum((i + 1) * k for i, k in enumerate(knobs))),
                float(sum((i + 1) * sum(x) for i, x in enumerate(per_request))),
                float(sum((i + 1) * (j + 1) * v for i, x in enumerate(per_request) for j, v in enumerate(x)))]

    def _forward(self, plan: IterationPlan, sched: Scheduler) -> tuple[torch.Tensor, torch.Tensor]:
        dev = self.ctx.device
        ids, positions = [], []
        for c in plan.chunks:
            ids.extend(sched.by_id[c.request].tokens[c.q_start:c.q_end])
            positions.extend(range(c.q_start, c.q_end))
        layers = self.cache.layers(plan.spans, [c.q_start for c in plan.chunks], [c.request for c in plan.chunks])
        return self.lm.step(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), layers,
                            plan.sample_rows)

    def _record(self, plan: IterationPlan, evicted: list[int], ledger: TrafficLedger, elapsed: float,
                kv_bytes: int) -> dict:
        seen = [r.traffic() for r in ledger.records]
        predicted = predict_iteration(self.lm.cfg, self.ctx.world_size, plan.rows, len(plan.sample_rows), self.dtype,
                                      self.lm.variant, self.lm.vocab_parallel, FINGERPRINT_SIZE)
        return {
            "iteration": plan.index, "rows": plan.rows, "prefill_chunks": plan.prefill_chunks,
            "decodes": plan.decodes, "admitted": list(plan.admitted), "evicted": evicted,
            "triples": [[c.request, *c.triple] for c in plan.chunks],
            "sampled": len(plan.sample_rows),
            "collectives": dict(Counter(t.kind for t in seen)),
            "logical_bytes": sum(t.logical_bytes for t in seen),
            "bytes_per_rank": sum(t.bytes_per_rank for t in seen),
            "comm_time_s": sum(r.time_s for r in ledger.records),
            "ledger_matches_model": seen == predicted,
            "predicted_bytes_per_rank": sum(t.bytes_per_rank for t in predicted),
            "score_entries": plan.score_entries(), "cache_rows_read": plan.cache_rows_read(),
            "kv_bytes_per_rank": kv_bytes, "time_s": elapsed,
        }
