"""GET /metrics: Prometheus text, vLLM's metric names under the `tpref:` prefix (the table: docs/server.md, "Metrics").

The engine's numbers are rank 0's stats() after the last step (serve/api/async_engine.py keeps them); the times are
taken in the server's process, so they include the HTTP side's queueing.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

WINDOW_S = 10.0
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    def __init__(self):
        disable_created_metrics()  # no *_created sample beside each counter and histogram (as vLLM)
        self.registry = CollectorRegistry()
        self.ttft = Histogram("tpref:time_to_first_token_seconds", "Time to first token (s)", buckets=TTFT_BUCKETS,
                              registry=self.registry)
        self.tpot = Histogram("tpref:time_per_output_token_seconds", "Time per output token after the first (s)",
                              buckets=TPOT_BUCKETS, registry=self.registry)
        self.prompt_tokens = Counter("tpref:prompt_tokens", "Prompt tokens of finished requests",
                                     registry=self.registry)
        self.generation_tokens = Counter("tpref:generation_tokens", "Tokens generated", registry=self.registry)
        self.success = Counter("tpref:request_success", "Requests ended, by finish reason", ["finished_reason"],
                               registry=self.registry)
        self._window: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()
        self.engine = None  # the AsyncEngine whose stats the gauges read
        self.registry.register(_EngineCollector(self))

    # called by the engine thread
    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def generated(self, n: int) -> None:
        if n:
            self.generation_tokens.inc(n)
            with self._lock:
                self._window.append((time.monotonic(), n))

    def finished(self, reason: str | None, prompt_tokens: int, tokens: int, tpot: float | None) -> None:
        self.success.labels(finished_reason=reason or "abort").inc()
        self.prompt_tokens.inc(prompt_tokens)
        if tpot is not None:
            self.tpot.observe(tpot)

    def tokens_per_second(self) -> float:
        with self._lock:
            cut = time.monotonic() - WINDOW_S
            while self._window and self._window[0][0] < cut:
                self._window.popleft()
            return sum(n for _, n in self._window) / WINDOW_S

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """The gauges and counters read off the engine at each scrape."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self):
        engine = self.metrics.engine
        if engine is None:
            return
        s = engine.stats

        def gauge(name, doc, value):
            return GaugeMetricFamily(name, doc, value=value)

        def counter(name, doc, value):
            return CounterMetricFamily(name, doc, value=value)

        llm = engine.llm
        if hasattr(llm, "config"):  # vLLM's cache_config_info: the pool's settings as labels, value 1
            info = GaugeMetricFamily("tpref:cache_config_info", "The KV cache's settings (labels)",
                                     labels=["cache_dtype", "block_size", "num_gpu_blocks"])
            info.add_metric([llm.config.kv_cache_dtype, str(llm.config.block_size), str(llm.num_blocks)], 1)
            yield info
        yield gauge("tpref:num_requests_running", "Requests running in the engine", s["running"])
        yield gauge("tpref:num_requests_waiting", "Requests waiting in the engine", s["waiting"])
        yield gauge("tpref:kv_blocks_used", "KV blocks in use (each rank's pool)", s["num_blocks"] - s["free_blocks"])
        yield gauge("tpref:kv_blocks_free", "KV blocks free (each rank's pool)", s["free_blocks"])
        queried = s["prefix_queried_tokens"]
        yield gauge("tpref:prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / prompt tokens admitted",
                    s["prefix_hit_tokens"] / queried if queried else 0.0)
        yield counter("tpref:prefix_cache_hits", "Prompt tokens found in the prefix cache", s["prefix_hit_tokens"])
        yield counter("tpref:prefix_cache_queries", "Prompt tokens admitted", queried)
        yield counter("tpref:num_preemptions", "Requests preempted", s["preemptions"])
        yield counter("tpref:kv_evicted_blocks", "KV blocks given back by kv_eviction", s.get("kv_evicted_blocks", 0))
        if "kv_offloaded_blocks" in s:  # kv_transfer_config's OffloadingConnector (docs/kv_tiers.md)
            yield counter("tpref:kv_offloaded_blocks", "KV blocks spilled from the pool to the CPU tier",
                          s["kv_offloaded_blocks"])
            yield counter("tpref:kv_demoted_blocks", "KV blocks moved from the CPU tier to the disk tier",
                          s["kv_demoted_blocks"])
            hits = CounterMetricFamily("tpref:kv_tier_hit_blocks", "KV blocks loaded back from a tier, by tier",
                                       labels=["tier"])
            held = GaugeMetricFamily("tpref:kv_tier_blocks", "KV blocks each tier holds", labels=["tier"])
            for tier in ("cpu", "disk"):
                hits.add_metric([tier], s["kv_tier_hit_blocks"][tier])
                held.add_metric([tier], s["kv_tier_blocks"][tier])
            yield hits
            yield held
            yield counter("tpref:kv_disk_unreadable_blocks", "Disk-tier blocks some rank could not read (recomputed)",
                          s["kv_disk_unreadable_blocks"])
            yield counter("tpref:kv_disk_write_errors", "Disk-tier writes that failed on rank 0 (recomputed)",
                          s["kv_disk_write_errors"])
        yield counter("tpref:collective_bytes_per_rank", "Bytes each rank sent in collectives",
                      s["collective_bytes_per_rank"])
        yield counter("tpref:engine_steps", "Engine steps run", engine.steps)
        if "spec_decode_num_drafts" in s:  # speculative decoding on: vLLM's counters
            yield counter("tpref:spec_decode_num_drafts", "Verified requests with at least one proposal",
                          s["spec_decode_num_drafts"])
            yield counter("tpref:spec_decode_num_draft_tokens", "Proposed tokens", s["spec_decode_num_draft_tokens"])
            yield counter("tpref:spec_decode_num_accepted_tokens", "Proposed tokens accepted",
                          s["spec_decode_num_accepted_tokens"])
            per_pos = CounterMetricFamily("tpref:spec_decode_num_accepted_tokens_per_pos",
                                          "Proposed tokens accepted, by position", labels=["position"])
            for j, n in enumerate(s["spec_decode_num_accepted_tokens_per_pos"]):
                per_pos.add_metric([str(j)], n)
            yield per_pos
            if "spec_decode_steps_by_num_proposals" in s:  # the Tuner's choices (speculative_config adaptive)
                by_k = CounterMetricFamily("tpref:spec_decode_steps_by_num_proposals",
                                           "Engine steps by proposals per request (0: speculation off)", labels=["k"])
                for k, n in enumerate(s["spec_decode_steps_by_num_proposals"]):
                    by_k.add_metric([str(k)], n)
                yield by_k
        yield gauge("tpref:generation_tokens_per_second", f"Tokens generated per second over the last {WINDOW_S:g} s",
                    self.metrics.tokens_per_second())
