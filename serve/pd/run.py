"""serve_pd: both groups' engines on one world, and the per-request result assembled from every rank."""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.distributed as dist

from layers.models.lm import shard_lm
from layers.models.pipeline import check_layout, new_pp_groups, shard_pp_lm
from layers.parallel.weight_format import model_dtype
from serve.build import prepare_weights
from serve.config import EngineConfig
from serve.control import agree, digest, request_rows, settings_row
from serve.kv_connector.config import KVTransferConfig
from serve.offline import OfflineEngine
from serve.pd.handover import DecodeSide, PrefillSide, warm_up_pairs
from serve.pd.plan import Layout, check_pools, prefill_schedule, validate_layout
from serve.request import Request
from tp.dist import DEFAULT_TIMEOUT_S, TPContext, context
from tp.ledger import TrafficLedger
from tp.traffic_model import predict_transfers


# each side's connector, as its engine's settings record it (serve/pd/handover.py builds them)
PRODUCER = KVTransferConfig("PDConnector", "kv_producer")
CONSUMER = KVTransferConfig("PDConnector", "kv_consumer")


@dataclass
class PDResult:
    requests: list[dict] = field(default_factory=list)  # per request: ids, and time to token 1 / token 2 in parts
    transfers: list[dict] = field(default_factory=list)  # every message, from every rank
    prefill_iterations: list[dict] = field(default_factory=list)
    decode_iterations: list[dict] = field(default_factory=list)
    ledger_matches_model: bool = False  # every rank's transfers == predict_transfers, and each side's collectives
    time_s: float = 0.0
    kv: dict[int, torch.Tensor] = field(default_factory=dict)  # keep_kv: this decode rank's received K,V
    agreements: int = 0  # the decode group's all-reduces of one int64 count, one per iteration boundary
    lm: object = None  # this rank's model (on its side's group)


def new_groups(layout: Layout) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """The prefill and decode groups; every rank of the world must call this, in the same order."""
    return (dist.new_group(list(range(layout.prefill_ranks))),
            dist.new_group(list(range(layout.prefill_ranks, layout.world_size))))


@torch.no_grad()
def serve_pd(weights, world: TPContext, layout: Layout, requests: list[Request], config: EngineConfig, *,
             eos_token_ids: tuple[int, ...] = (), variant: str = "v2", vocab_parallel: bool = True,
             streaming: bool = True, groups=None, keep_kv: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S,
             meter=None, decode_block_size: int | None = None) -> PDResult:
    """Serve `requests` with prefill on ranks [0, p_P) and decode on [p_P, p_P + p_D). Every rank of the world
    calls this with the same arguments (checked first: a mismatch raises PlanMismatch on every rank).
    weights: a dense LM, or a per-rank source (layers/models/hf.CheckpointSource), that shard_lm cuts this rank's model
    from on its side's group (under `meter`, launch/loading.LoadMeter, when given).
    timeout_s bounds every wait for a hand-over message (HandoverTimeout, naming the message and the pair).
    config: both sides' engine settings; its num_gpu_blocks_override bounds each side's pool (None: enough for its
    workload at its largest); its block_size is the prefill side's blocks, decode_block_size the decode side's
    (None: the same; docs/pd.md, "Bounded pools")."""
    if config.kv_transfer_config is not None:  # every rank, before any collective
        raise ValueError(f"kv_transfer_config {config.kv_transfer_config.kv_connector} with P/D disaggregation is "
                         f"not built: the hand-over is P/D's own connector (PDConnector); serve the tiers colocated")
    if config.batch_invariant:
        raise ValueError("batch_invariant with P/D disaggregation is not built: serve it colocated")
    if config.speculative_config is not None:
        raise ValueError("speculative_config with P/D disaggregation is not built yet: serve without it")
    if any(r.params is not None and r.params.prompt_logprobs is not None for r in requests):
        raise ValueError("prompt_logprobs with P/D disaggregation is not built: serve the request colocated")
    if config.quantization is not None:
        raise ValueError(f"quantization={config.quantization} with P/D disaggregation is not built (a row-parallel "
                         f"weight's int8 groups follow each side's p): serve it colocated, or drop it")
    if config.kv_eviction is not None:
        raise ValueError("kv_eviction with P/D disaggregation is not built (the hand-over moves every block of a "
                         "prompt): serve it colocated, or drop it")
    if config.kv_cache_dtype != "auto":  # the hand-over moves the model dtype's K,V, and the scales would not follow
        raise ValueError(f"kv_cache_dtype={config.kv_cache_dtype} with P/D disaggregation is not built (the decode side "
                         f"would need the prefill side's scales with the codes): serve it colocated, or drop it")
    decode_block_size = config.block_size if decode_block_size is None else decode_block_size
    cfg = weights.cfg
    validate_layout(cfg, layout, world.world_size)
    check_pools(requests, config.num_gpu_blocks_override, config.block_size, decode_block_size)  # before collectives
    layout_row = (layout.prefill_ranks, layout.decode_ranks, layout.prefill_pp, int(streaming), decode_block_size)
    agree(world, digest([layout_row, settings_row(config, eos_token_ids)] + request_rows(requests)),
          "the prefill and decode ranks got different requests or settings (pd.*, long_prefill_token_threshold, "
          "max_num_batched_tokens, max_num_seqs, eos_id): every rank needs the same")
    prefill_group, decode_group = groups or new_groups(layout)
    is_prefill = world.rank < layout.prefill_ranks
    ctx = context(prefill_group if is_prefill else decode_group, world.backend, world.device)
    stages = None
    if layout.prefill_pp > 1:  # every rank of the world makes the prefill stages' groups, in the same order
        pp_layout = check_layout(layout.prefill_ranks, layout.prefill_pp, cfg.n_layers, variant)
        stages = new_pp_groups(pp_layout)
    with meter or contextlib.nullcontext():
        if is_prefill and stages is not None:  # this rank's stage of the pipelined prefill side
            lm = shard_pp_lm(weights, variant, pp_layout, world.rank, stages[pp_layout.stage_of(world.rank)],
                             world=ctx.group)
        else:
            lm = shard_lm(weights, variant, ctx.group, vocab_parallel)
        prepare_weights(lm, config)  # the layout its device reads fastest (quantization is refused above)
    by_id = {r.id: r for r in requests}
    schedule = prefill_schedule(requests, config, layout.prefill_pp)
    handed = [rids for rids in ([rid for rid in done if by_id[rid].max_new_tokens > 1] for _, done in schedule) if rids]
    ledger = TrafficLedger(world.world_size, world.device)
    start = time.perf_counter()
    warm_up_pairs(cfg, layout, world.rank, ledger, world.device, timeout_s)  # set-up, before any forward
    if is_prefill:  # every request as if max_new_tokens were 1; no eos: each ends at its first token anyway
        side = PrefillSide(lm, layout, world.rank, streaming, ledger, {rid for rids in handed for rid in rids},
                           timeout_s)
        mine = [Request(r.id, list(r.prompt), 1, r.arrival) for r in requests]
        engine = OfflineEngine(lm, ctx, replace(config, kv_transfer_config=PRODUCER), connector=side)
    else:  # the handed-over requests, arriving with their prompts cached
        stop = frozenset(eos_token_ids)
        coming = {rid: Request(rid, list(by_id[rid].prompt), by_id[rid].max_new_tokens,
                               num_computed_tokens=len(by_id[rid].prompt), stop_ids=stop)
                  for rids in handed for rid in rids}
        side = DecodeSide(cfg, layout, world.rank, streaming, ledger, ctx.group, handed, coming, stop, keep_kv,
                          timeout_s=timeout_s)
        mine = []  # the decode side adds each request as its K,V land (DecodeSide._place)
        decoding = replace(config, block_size=decode_block_size)
        pool = decoding.pool_blocks(0, [r.capacity for r in coming.values()])
        engine = OfflineEngine(lm, ctx, replace(decoding, num_gpu_blocks_override=pool, kv_transfer_config=CONSUMER),
                               eos_token_ids=eos_token_ids, connector=side)
    try:
        res = engine.run(mine)
    except BaseException:
        side.finish(join=False)  # do not wait on messages a failed peer will never complete
        raise
    side.finish()
    times = ({"done_at": side.done_at} if is_prefill
             else {"received_at": side.received_at, "agreements": side.agreements})
    elapsed = time.perf_counter() - start
    predicted = predict_transfers(cfg, layout.prefill_ranks, layout.decode_ranks,
                                  [(rid, len(by_id[rid].prompt)) for rids in handed for rid in rids],
                                  model_dtype(lm), streaming, world.rank, layout.prefill_pp)
    seen = [t.transfer() for t in ledger.transfers]
    local = {"rank": world.rank, "prefill": is_prefill, "started_at": res.started_at, "requests": res.requests,
             "iterations": res.iterations, "times": times, "transfers": [asdict(t) for t in ledger.transfers],
             "ok": Counter(seen) == Counter(predicted) and res.ledger_matches_model, "time_s": elapsed}
    every = [None] * world.world_size
    dist.all_gather_object(every, local, group=world.group)
    result = _combine(every, layout, requests)
    if keep_kv and not is_prefill:
        result.kv = side.kept
    result.lm = lm
    return result


def _combine(every: list[dict], layout: Layout, requests: list[Request]) -> PDResult:
    pre, dec = every[0], every[layout.prefill_ranks]
    # times across the groups compare time.perf_counter() of processes on one host (CLOCK_MONOTONIC).
    # when a prompt was done: on the rank that sends its first token (a pipelined prefill side's last stage streams
    # its K,V before the first stage's clock sees the micro-batch come back)
    sender = every[layout.prefill_ranks - layout.prefill_ranks // layout.prefill_pp]
    pre_req = {r["request"]: r for r in pre["requests"]}
    dec_req = {r["request"]: r for r in dec["requests"]}
    out = PDResult(transfers=[t for e in every for t in e["transfers"]], prefill_iterations=pre["iterations"],
                   decode_iterations=dec["iterations"], ledger_matches_model=all(e["ok"] for e in every),
                   time_s=max(e["time_s"] for e in every), agreements=dec["times"]["agreements"])
    for r in requests:
        p = pre_req[r.id]
        row = {"request": r.id, "prompt_length": len(r.prompt), "max_new_tokens": r.max_new_tokens,
               "output_ids": p["output_ids"], "logits": p["logits"], "prefill_s": p["ttft_s"], "transfer_s": None,
               "first_decode_s": None,
               "kv_bytes": sum(t["bytes"] for t in out.transfers if t["request"] == r.id and t["kind"] == "send"
                               and t["site"] == "pd/kv")}
        received = dec["times"]["received_at"].get(r.id)  # every handed-over request, even one token 1 ended
        if received is not None:
            row["transfer_s"] = received - sender["times"]["done_at"][r.id]
        d = dec_req.get(r.id)  # None: never handed over, or ended at token 1 (never added to the decode engine)
        if d is not None:
            row["output_ids"], row["logits"] = d["output_ids"], p["logits"] + d["logits"]
            if d["token_times_s"]:
                row["first_decode_s"] = dec["started_at"] + d["token_times_s"][0] - received
        out.requests.append(row)
    return out
