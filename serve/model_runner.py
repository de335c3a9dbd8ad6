"""Turns one iteration's plan into tensors and runs it through this rank's TP model: nano-vllm's ModelRunner.

    runner = ModelRunner(lm, ctx, num_blocks, config)   # this rank's KV pool, once; the attention backend
    result, sampling = runner.run(plan, requests)       # the sampled rows' ids and logits, on every rank

It owns the rank's KV pool (serve/kv_cache.py), builds the step's inputs once per iteration (prepare_step, below) and
calls the model's `step` (layers/models/lm.py: embedding, the stack over the paged cache, the vocab-parallel head's
pick). The results stay on the device: reading them is the engine's one wait per step.

One iteration's plan -> the tensors the model reads, built once per iteration (not per layer), in one place:

    ids [T]            the token of every row, decodes first (the plan's order)
    positions [T]      each row's position in its request: q_start, q_start + 1, ...
    slot_mapping [T]   where each row's K,V go: blocks[t // block_size] · block_size + t % block_size
    sample_rows [S]    the rows whose logits give a token
    batch              what the attention backend reads (layers/attention/backends.py): block tables, groups, masks

Everything integer, the attention backend's lists included (its build; its finish reads them back), goes over in one
host-to-device copy (pinned and non-blocking on a GPU); masks are then built on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from layers.attention.attention import PagedLayer
from layers.attention.backends import FlashBackend, PagedBatch, backend, choose, score_slots
from layers.attention.context_parallel import SplitCacheBackend
from layers.models.lm import TPLM, TPLlamaLM
from layers.parallel.weight_format import model_dtype
from layers.sampling.prompt_logprobs import score_rows
from layers.sampling.rejection_sampler import filtered_logprobs, rejection_sample
from layers.sampling.sampler import SampleResult, SamplingBatch
from serve.config import EngineConfig
from serve.block_manager import slot_mapping
from serve.kv_cache import KVPool
from serve.plan import SchedulerOutput
from serve.request import Request
from serve.sampling_params import GREEDY
from tp.comm import all_reduce_values
from tp.dist import TPContext


class ModelRunner:
    def __init__(self, lm: TPLM | TPLlamaLM, ctx: TPContext, num_blocks: int, config: EngineConfig, cp_group=None):
        """config: block_size, attention, kv_cache_dtype and calculate_kv_scales are read. cp_group: context
        parallelism's group (layers/attention/context_parallel.SplitCacheBackend): this rank keeps 1/cp of every block's
        positions, block_size/cp slots per block."""
        self.lm, self.ctx, self.block_size = lm, ctx, config.block_size
        self.attention = choose(config.attention, ctx.device)  # the backend's name: auto resolved for this device
        self.dtype = model_dtype(lm)
        self.split = None if cp_group is None else SplitCacheBackend(cp_group)
        if self.split is not None:
            self.attention = self.split.name
        # what prepare_step attends with, resolved once: the backend itself (the split cache's holds its group;
        # batch_invariant: the flash backend's fixed padded tiles)
        self.backend = backend(self.attention, ctx.device) if self.split is None else self.split
        if config.batch_invariant:
            check_invariant(lm, config, ctx, 1 if cp_group is None else cp_group.size())
            self.attention, self.backend = "flash", FlashBackend(invariant=True)
        slots = config.block_size // (1 if self.split is None else self.split.cp)
        # K,V heads this rank caches: h/p (GPT-2), max(h_kv/p, 1) (Llama's grouped-query attention); the layers of a
        # pipeline stage's model are its own (cfg.n_layers is the stage's)
        self.cache = KVPool.for_model(lm, num_blocks, slots, self.dtype, ctx.device, config.kv_cache_dtype,
                                      config.calculate_kv_scales)
        # what sized the pool, where kv_cache_memory_bytes did (a request too large for it is told so)
        self.block_bytes = None if config.kv_cache_memory_bytes is None else self.cache.bytes_per_block
        self.connector = None  # a KV connector's worker side (serve/kv_connector/), set by the engine

    @staticmethod
    def pool_blocks(lm, config: EngineConfig, cp_group=None) -> int:
        """Blocks in this rank's pool (EngineConfig.pool_blocks; kv_cache_memory_bytes over this rank's block: 1/cp
        of its positions, in the cache's dtype)."""
        slots = config.block_size // (1 if cp_group is None else cp_group.size())
        return config.pool_blocks(lm.cfg.max_seq_len, None, KVPool.block_bytes(
            lm, slots, model_dtype(lm), config.kv_cache_dtype))

    def prepare(self, plan: SchedulerOutput, requests: dict[int, Request], sampled: bool = True) -> Prepared:
        """The iteration's tensors (one host-to-device copy) and, unless not `sampled`, its sampling batch.
        requests: id -> Request (its tokens so far, its sampling parameters)."""
        step = prepare_step(plan, {c.request: requests[c.request].tokens + list(c.spec) for c in plan.scheduled},
                            self.block_size, self.ctx.device, self.backend, self.cache)
        if self.connector is not None:  # before the forward: spills read the pool, loads start (each layer waits)
            self.connector.start_load_kv(plan.kv_connector_metadata)
        return Prepared(step, sampling_batch(plan.scheduled, requests, self.ctx.device) if sampled else None)

    @torch.no_grad()
    def run(self, plan: SchedulerOutput, requests: dict[int, Request]) -> tuple[SampleResult, SamplingBatch | None]:
        """Returns the sampled rows' tokens and their logits (and logprobs when asked), on the device, and the sampling
        batch (None: every row greedy)."""
        step, sampling = self.prepare(plan, requests)
        scored = prompt_rows(plan, requests)
        if scored is None:
            out = self.lm.step(step.ids, step.positions, step.layers, step.sample_rows, sampling)
        else:
            x = self.lm.hidden(step.ids, step.positions, step.layers)
            out = self.lm.pick(x, step.sample_rows, sampling)
            rows, targets, out.prompt_where, n = scored  # prompt logprobs: the rows' next prompt tokens, scored
            at, targets = torch.tensor([rows, targets], device=self.ctx.device)  # one host-to-device copy for both
            out.prompt = score_rows(*self.lm.head_logits(x, at), targets, n, self.lm.cfg.vocab_size)
        if self.connector is not None:
            self.connector.wait_for_save()
        if step.batch.scores is not None:  # kv_eviction h2o: every rank's heads' attention per block, summed
            out.scores = all_reduce_values(step.batch.scores[:-1], self.ctx.group, "sum",
                                           "engine/eviction scores")  # ★ all-reduce [blocks]
        return out, sampling

    @torch.no_grad()
    def run_verified(self, plan: SchedulerOutput, requests: dict[int, Request], proposal: torch.Tensor,
                     q: torch.Tensor) -> tuple[SampleResult, SamplingBatch | None, tuple]:
        """A plan with a draft's proposals (serve/draft.py): the rows of chunks without proposals are picked as in
        run(); the verified rows go through the rejection sampler (layers/sampling/rejection_sampler.py) with q, the
        draft's distribution on this rank's ids. One SampleResult for every sampled row in plan order (tokens, logits,
        and `accepted`: the row's proposal taken), the plain rows' sampling batch, and what the verifier moved
        (rows, rounds, normalisers: tp/traffic_model.predict_verify)."""
        step = self.prepare(plan, requests, sampled=False).step
        lm, dev = self.lm, self.ctx.device
        x = lm.hidden(step.ids, step.positions, step.layers)
        verified = [bool(c.spec) for c in plan.scheduled if c.sample for _ in range(len(c.spec) + 1)]
        where = torch.tensor(verified, dtype=torch.bool, device=dev)
        plain_chunks = [c for c in plan.scheduled if not c.spec]
        sampling = sampling_batch(plain_chunks, requests, dev)
        plain = lm.pick(x, step.sample_rows[~where], sampling)
        local, start, group = lm.head_logits(x, step.sample_rows[where])
        batch = SamplingBatch.build(sampling_rows([c for c in plan.scheduled if c.spec], requests)[0], -1, dev)
        p_logp, rounds, normalisers = filtered_logprobs(local, start, group, batch)
        accepted, token, logit = rejection_sample(p_logp, q, proposal, local, start, group, batch)
        S = len(verified)
        out = SampleResult(torch.empty(S, dtype=torch.long, device=dev), torch.empty(S, dtype=torch.float64, device=dev),
                           rounds=plain.rounds, race=plain.race, accepted=torch.zeros(S, dtype=torch.float64, device=dev))
        out.tokens[~where], out.logits[~where] = plain.tokens, plain.logits
        out.tokens[where], out.logits[where], out.accepted[where] = token, logit, accepted.double()
        return out, sampling, (sum(verified), rounds, normalisers)

    @torch.no_grad()
    def forward_stage(self, prepared: Prepared, microbatch: int, received=None) -> torch.Tensor:
        """A pipeline stage's part of a micro-batch (layers/models/pipeline.py's PPLM): its hidden states [T, d].
        received: its input's receive, posted earlier (None on the first stage)."""
        step = prepared.step
        return self.lm.forward_stage(step.ids, step.positions, step.layers, microbatch, received)


def check_invariant(lm, config: EngineConfig, ctx: TPContext, cp: int) -> None:
    """batch_invariant's rules where the engine is built (every entry point, the library's included): the TP size;
    a model whose every matmul is a linear the mode tiles, prepared with its tiles (serve/build.prepare_weights); a
    CPU, one intra-op thread (PyTorch splits element-wise ops and some reductions across threads at points that
    depend on the number of rows; a GPU's norms and sums reduce in an order set by the number of rows too)."""
    from layers.models.families import of
    from layers.parallel.weight_format import TILE_ROWS, matmul_modules

    config.check_batch_invariant(ctx.world_size // cp)
    if not of(lm.cfg).quantization:
        raise ValueError(f"batch_invariant with {lm.cfg.family} models is not built (not every matmul is a linear the "
                         f"mode tiles): serve a GPT-2, Llama or Qwen3 model")
    if any(getattr(m, "tile_rows", None) != TILE_ROWS for _, m in matmul_modules(lm)):
        raise ValueError("batch_invariant: the model's products are not tiled; prepare its weights with the settings "
                         "(serve/build.prepare_weights)")
    if torch.device(ctx.device).type != "cpu":
        raise ValueError("batch_invariant on a GPU is not built (its norms and sums reduce in an order set by the "
                         "number of rows): run it on a CPU")
    if torch.get_num_threads() != 1:
        raise ValueError(f"batch_invariant runs each rank on one intra-op thread (this rank has "
                         f"{torch.get_num_threads()}: PyTorch splits element-wise ops and some reductions across "
                         f"threads where the number of rows says): threads_per_rank=1, or torch.set_num_threads(1)")


class Prepared(NamedTuple):
    step: StepInputs
    sampling: SamplingBatch | None


def prompt_rows(plan: SchedulerOutput, requests: dict[int, Request]
                ) -> tuple[list[int], list[int], list[tuple[int, int]], int] | None:
    """The rows a step scores for prompt logprobs: each row of a prompt chunk of a request asking for them whose next
    token is in its prompt. (rows in the step, the token each scores, (request id, that token's position), the most
    top-N asked), or None."""
    rows, targets, where, n, offset = [], [], [], -1, 0
    for c in plan.scheduled:
        r = requests[c.request]
        if r.params is not None and r.params.prompt_logprobs is not None:
            for pos in range(c.q_start, min(c.q_end, len(r.prompt) - 1)):
                rows.append(offset + pos - c.q_start)
                targets.append(r.prompt[pos + 1])
                where.append((c.request, pos + 1))
            n = max(n, r.params.prompt_logprobs)
        offset += c.q_end - c.q_start
    return (rows, targets, where, n) if rows else None


def sampling_rows(chunks, requests: dict[int, Request], ahead: int = 0) -> tuple[list[tuple], int]:
    """The sampled rows' parameters (temperature, top_k, top_p, min_p, seed, output position) and the most logprobs
    asked: a chunk's last row, or each row of a verified chunk (row j gives output position len(output) + j; a
    draft's proposal `ahead` tokens past the output, len(output) + ahead)."""
    rows, logprobs = [], -1
    for c in chunks:
        if c.sample:
            r = requests[c.request]
            q = r.params or GREEDY  # no params: a request of the launcher's greedy runs
            for j in range(ahead, ahead + len(c.spec) + 1):
                rows.append((q.temperature, q.top_k, q.top_p, q.min_p, r.sampling_seed or 0, len(r.output) + j))
            logprobs = max(logprobs, -1 if q.logprobs is None else q.logprobs)
    return rows, logprobs


def sampling_batch(chunks, requests: dict[int, Request], device) -> SamplingBatch | None:
    """The sampled rows' parameters as tensors, built once per step; None when every row is greedy (the head's own
    greedy path, bit for bit)."""
    rows, logprobs = sampling_rows(chunks, requests)
    if all(row[0] == 0 for row in rows) and logprobs < 0:
        return None
    return SamplingBatch.build(rows, logprobs, device)


@dataclass(frozen=True)
class StepInputs:
    ids: torch.Tensor
    positions: torch.Tensor
    batch: PagedBatch
    sample_rows: torch.Tensor
    layers: list | None = None  # each layer's PagedLayer: the batch and that layer's pool (when one was given)


def prepare_step(plan: SchedulerOutput, tokens: dict[int, list[int]], block_size: int, device,
                 attention, pool: KVPool | None = None) -> StepInputs:
    """tokens: request id -> its tokens (prompt + generated). attention: a backend's name, or auto (by device), or a
    backend itself (context parallelism's SplitCacheBackend, which holds its group). pool: the KV pool the step's
    layers read (StepInputs.layers).
    Returns the iteration's tensors on `device`."""
    chosen = attention if hasattr(attention, "build") else backend(attention, device)  # a name, or a backend
    flat: list[int] = []
    sizes: list[int] = []

    def put(values: list[int]) -> None:
        flat.extend(values)
        sizes.append(len(values))

    spans = plan.spans
    put([t for c in plan.scheduled for t in tokens[c.request][c.q_start:c.q_end]])
    put([t for c in plan.scheduled for t in range(c.q_start, c.q_end)])
    put([s for c in plan.scheduled for s in slot_mapping(c.blocks, block_size, c.q_start, c.q_end)])
    put(plan.sample_rows)
    finish = chosen.build(plan.scheduled, spans, block_size, lambda c, s, e: slot_mapping(c.blocks, block_size, s, e),
                          put)
    host = torch.tensor(flat, dtype=torch.int64)
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    parts = iter(host.to(device, non_blocking=True).split(sizes))  # ★ the iteration's one host-to-device copy
    ids, positions, slots, sample_rows = (next(parts) for _ in range(4))
    fresh = tuple(span for c, span in zip(plan.scheduled, spans) if c.q_start == 0)  # prompt chunks from position 0
    starts = score_slots(plan.scheduled)  # kv_eviction h2o: every layer adds each block's attention here
    scores = None if starts is None else torch.zeros(
        starts[-1] + 1, device=device, dtype=torch.promote_types(pool.dtype if pool else torch.float32, torch.float32))
    batch = PagedBatch(chosen, positions, slots, finish(parts), fresh=fresh, scores=scores)
    return StepInputs(ids, positions, batch, sample_rows,
                      None if pool is None else [PagedLayer(batch, layer) for layer in pool.pools])
