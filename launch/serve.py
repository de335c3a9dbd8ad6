"""Serve requests on the TP stack and check every token against a dense, cache-free oracle.

    torchrun --nproc_per_node=4 launch/serve.py                      # 8 random prompts, staggered arrivals
    torchrun --nproc_per_node=2 launch/serve.py prompts=[[464,3290,318],[40]] max_new_tokens=8
    torchrun --nproc_per_node=4 launch/serve.py long_prefill_token_threshold=1024 max_num_batched_tokens=2048
    torchrun --nproc_per_node=2 launch/serve.py hf_checkpoint=DIR    # GPT2LMHeadModel or LlamaForCausalLM
    torchrun --nproc_per_node=4 launch/serve.py model=llama_tiny     # grouped-query attention, RoPE, SwiGLU
    torchrun --nproc_per_node=4 launch/serve.py shared_prefix=48     # a 48-token system prompt: prefix cache hits
    torchrun --nproc_per_node=2 launch/serve.py num_gpu_blocks_override=6 block_size=4   # a small pool: preemption

tp = WORLD_SIZE. Parse (launch/serve_settings.py: every rank validates the settings, and reads a checkpoint's
headers, before the first collective) -> build (serve/build.py: this rank's shard, or its pipeline stage) -> run
(serve/offline.py: iteration-level batching, chunked prefill, prefix caching and preemption over a paged KV pool,
every iteration's collectives compared with the analytic model; with `check`, every request against the dense
oracle) -> report (launch/serve_report.py: rank 0 prints the tables and writes report.json). The exit code is
non-zero when a check fails.
"""

from __future__ import annotations

import sys
import time
from contextlib import nullcontext
from pathlib import Path

if __package__ in (None, ""):  # run as a script by torchrun: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from launch.loading import LoadMeter
from launch.serve_report import add_text, build_pd_report, build_report, render, render_pd, weights_report
from launch.serve_settings import Settings, parse_settings
from launch.settings import launch, publish, script_main
from layers.attention.kv_quant import gather_scales, pseudo_quantized
from layers.models.dense import weights_checksum
from layers.models.families import of
from layers.models.lm import NEAR_TIE
from layers.models.pipeline import stage_layers
from serve.build import build_lm, build_rank, dense_model, prepare_weights, rank_weights
from serve.control import agree, digest
from serve.hooks import check_request, eviction_reference
from serve.offline import OfflineEngine, ServeResult
from serve.pd import new_groups, serve_pd
from serve.pipeline import stage_report
from serve.request import Request
from tp.dist import ConfigError, context
from tp.partition import kv_head_range


def run(cfg: DictConfig) -> int:
    return launch(cfg, parse_settings, serve_and_report)


def serve_and_report(s: Settings, out_dir: Path, ctx) -> int:
    if s.pd is not None:
        return serve_disaggregated(s, out_dir, ctx)
    meter = LoadMeter(s.weights)
    with meter:
        lm, dense, cp_group = build_rank(s, ctx)  # as every rank behind LLM builds its part (serve/worker.py)
    load = meter.report(ctx, lm)
    same_weights_and_prompts(s, ctx, dense)
    dense = oracle_model(s, ctx, dense, lm)  # after the load: neither in its peak nor in its bytes read
    engine = OfflineEngine(lm, ctx, s.engine, eos_token_ids=s.eos_token_ids, seed=s.sampling_seed,
                           on_iteration=Progress(len(s.requests)) if ctx.is_main else None, cp_group=cp_group)
    result = engine.run(s.requests)
    quant = engine.cache.quant  # kv_cache_dtype fp8/int8: the oracle round-trips K,V with every rank's scales
    scales = all_scales(quant, s, ctx) if quant is not None and s.check else None
    with nullcontext() if scales is None else pseudo_quantized(scales, quant.name):
        checks = oracle_check(dense, s, result, ctx) if s.check else None
    report = build_report(s, ctx, result, checks)
    if s.pp > 1:
        report["pp"] = stage_report(engine.engine)
    if ctx.is_main:
        add_text(report["requests"], s.hf_checkpoint)
    report["load"] = load
    embed = getattr(lm, "lm", lm).embed  # a pipeline stage's LM holds it inside (or not at all: a middle stage)
    report["embedding_bytes_per_rank"] = 0 if embed is None else embed.weight.numel() * embed.weight.element_size()
    report["lm_head_tied"] = not of(s.model).llama_lm or s.model.tie_word_embeddings  # Llama: mostly a separate head
    report["weights"] = weights_report(lm, s, ctx.world_size // s.pp // s.cp)
    publish(report, render, out_dir / s.report, ctx)
    ok = (report["ledger_matches_model"] and report["kv_cache"]["matches_formula"]
          and report["check"]["ok"] in (True, None))
    return 0 if ok else 1


def serve_disaggregated(s: Settings, out_dir: Path, ctx) -> int:
    """P/D: prefill on ranks [0, p_P), decode on the rest; then the same requests through the colocated engine
    on the decode group, and (with check) the dense oracle. Rank 0 prints the TTFT parts and the transfer table."""
    meter = LoadMeter(s.weights)
    with meter:
        weights, dense = rank_weights(s.model, s.weights, s.dtype, ctx.device, s.seed)
    same_weights_and_prompts(s, ctx, dense)
    groups = new_groups(s.pd)
    requests = lambda: [Request(r.id, list(r.prompt), r.max_new_tokens, r.arrival) for r in s.requests]  # noqa: E731
    result = serve_pd(weights, ctx, s.pd, requests(), s.engine, eos_token_ids=s.eos_token_ids, variant=s.variant,
                      vocab_parallel=s.vocab_parallel, streaming=s.streaming, groups=groups, timeout_s=s.pd_timeout_s,
                      meter=meter, decode_block_size=s.decode_block_size)
    load = meter.report(ctx, result.lm)
    dense = oracle_model(s, ctx, dense)  # after the load: neither in its peak nor in its bytes read
    colocated = None
    if ctx.rank >= s.pd.prefill_ranks:  # the colocated engine on the decode group's p_D ranks
        dctx = context(groups[1], ctx.backend, ctx.device)
        lm = prepare_weights(build_lm(weights, dctx, variant=s.variant, vocab_parallel=s.vocab_parallel), s.engine)
        served = OfflineEngine(lm, dctx, s.engine, eos_token_ids=s.eos_token_ids).run(requests())
        colocated = [r["output_ids"] for r in served.requests]
    every = [None] * ctx.world_size
    dist.all_gather_object(every, colocated, group=ctx.group)
    for r in s.requests:  # the oracle stops where the served requests stop
        r.stop_ids = r.stop_ids | frozenset(s.eos_token_ids)
    checks = oracle_check(dense, s, result, ctx) if s.check else None
    report = build_pd_report(s, ctx, result, every[s.pd.prefill_ranks], checks)
    report["load"] = load
    publish(report, render_pd, out_dir / s.report, ctx)
    ok = report["ledger_matches_model"] and report["same_as_colocated"] and report["check"]["ok"] in (True, None)
    return 0 if ok else 1


def oracle_model(s: Settings, ctx, dense, served=None):
    """With check, the dense model the oracle recomputes with (from a checkpoint: read one whole tensor at a time;
    int8 weights: what this rank's served model's stand for); None without."""
    if not s.check:
        return None
    try:
        return dense_model(s.model, s.checkpoint, s.dtype, ctx.device, dense, served)
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"hf_checkpoint={s.hf_checkpoint}: {exc}") from None


def same_weights_and_prompts(s: Settings, ctx, dense) -> None:
    """Every rank holds the same weights and prompts: the checkpoint's index and headers (or the dense weights made
    from seed) and the prompts, compared across ranks; ConfigError on every rank if not."""
    weights = [float(s.weights.fingerprint)] if s.weights is not None else weights_checksum(dense).tolist()
    prompts = [(sum((j + 1) * t for j, t in enumerate(r.prompt)),) for r in s.requests]
    agree(ctx, digest([tuple(weights)] + prompts),
          "ranks built different weights or prompts: every rank needs the same settings and files", ConfigError)


def all_scales(quant, s: Settings, ctx):
    """A quantized cache's scales of the whole model [L, planes, h_kv] on every rank: each rank's stage layers and
    K,V heads (MLA: its one latent, whole on every rank), gathered."""
    tp = ctx.world_size // s.pp // s.cp  # rank = stage·tp + t, or c·tp + t
    heads = of(s.model).cache_layout(s.model, 1)[1]  # h_kv, or MLA's one latent
    return gather_scales(quant.scales, stage_layers(s.model.n_layers, s.pp)[ctx.rank // (ctx.world_size // s.pp)],
                         kv_head_range(heads, ctx.rank % tp, tp), s.model.n_layers, heads, ctx.group)


def oracle_check(dense, s: Settings, result: ServeResult, ctx) -> list[dict]:
    """Each rank checks every p-th request against the dense oracle (serve/hooks.check_request); every rank gets all
    verdicts."""
    mine = {}
    with torch.no_grad():
        for r, served in zip(s.requests, result.requests):
            if r.id % ctx.world_size == ctx.rank:  # kv_eviction: masked as the engine read
                with eviction_reference(s.engine.kv_eviction, r, s.engine.block_size):
                    verdict = check_request(dense, r, served["output_ids"], served["logits"], NEAR_TIE[s.dtype])
                mine[r.id] = {"request": served["request"], **verdict}
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, mine, group=ctx.group)
    return [next(g[r.id] for g in gathered if r.id in g) for r in s.requests]


class Progress:
    """A line every 10 s on long runs (rank 0 only)."""

    def __init__(self, n_requests: int):
        self.n, self.last = n_requests, time.monotonic()

    def __call__(self, record: dict, sched) -> None:
        if time.monotonic() - self.last >= 10:
            self.last = time.monotonic()
            done = sum(r.finished for r in sched.by_id.values())
            tokens = sum(len(r.output) for r in sched.by_id.values())
            print(f"progress: iteration {record['iteration']}, {done}/{self.n} requests finished, "
                  f"{tokens} tokens generated", flush=True)


if __name__ == "__main__":
    script_main(run, "serve")
