"""P/D's plan, the same on every rank of the world: the two groups' layout, and which prompts complete in which
prefill iteration (computed by the engine's own scheduler), checked before anything is served. Host only."""

from __future__ import annotations

from dataclasses import dataclass

from layers.config import validate_model
from layers.llama import validate_llama
from serve.config import EngineConfig
from serve.engine import new_scheduler, schedule_loop
from serve.scheduler import Request
from tp.dist import ConfigError
from tp.partition import ceil_div


@dataclass(frozen=True)
class Layout:
    prefill_ranks: int
    decode_ranks: int
    prefill_pp: int = 1  # the prefill side as a pipeline: prefill_pp stages of prefill_ranks / prefill_pp TP ranks

    @property
    def world_size(self) -> int:
        return self.prefill_ranks + self.decode_ranks


def validate_layout(cfg, layout: Layout, world_size: int) -> None:
    """ConfigError unless the two groups fill the world and each can split the model's heads. Pure."""
    p_p, p_d = layout.prefill_ranks, layout.decode_ranks
    if p_p < 1 or p_d < 1:
        raise ConfigError(f"pd.prefill_ranks={p_p} and pd.decode_ranks={p_d} must both be at least 1")
    if p_p + p_d != world_size:
        raise ConfigError(f"pd.prefill_ranks={p_p} + pd.decode_ranks={p_d} = {p_p + p_d} must equal the world size "
                          f"{world_size} (torchrun --nproc_per_node)")
    pp = layout.prefill_pp
    if pp < 1 or p_p % pp:
        raise ConfigError(f"pd.prefill_pp={pp} must divide pd.prefill_ranks={p_p} (each prefill stage is a TP group "
                          f"of prefill_ranks / prefill_pp ranks)")
    if pp > cfg.n_layers:
        raise ConfigError(f"pd.prefill_pp={pp} is more stages than the model's {cfg.n_layers} layers")
    for name, p in (("pd.prefill_ranks", p_p // pp), ("pd.decode_ranks", p_d)):
        try:
            (validate_llama if cfg.family == "llama" else validate_model)(cfg, p)
        except ConfigError as exc:
            where = f"pd.prefill_ranks={p_p} / pd.prefill_pp={pp}" if name == "pd.prefill_ranks" and pp > 1 else \
                f"{name}={p}"
            raise ConfigError(f"{where}: {exc}") from None


def prefill_schedule(requests: list[Request], chunk_size: int, max_batched_tokens: int,
                     max_running: int | None = None, block_size: int = EngineConfig.block_size,
                     prefix_cache: bool = EngineConfig.prefix_cache,
                     kv_blocks: int | None = None, pp: int = 1) -> list[tuple[int, list[int]]]:
    """[(prefill iteration, ids of the requests whose prompt completes in it, in plan order)]: what the prefill side's
    engine will do, computed on every rank from the requests and settings alone, by the engine's own code (its
    scheduler, serve.engine.new_scheduler, and its planning, serve.engine.next_plan), so the two cannot differ.
    pp > 1: the prefill side is a pipeline (serve/pipeline.py's ticks, pipeline_schedule)."""
    mine = [Request(r.id, list(r.prompt), 1, r.arrival) for r in requests]
    sched = new_scheduler(mine, chunk_size=chunk_size, max_batched_tokens=max_batched_tokens,
                          max_running=max_running, block_size=block_size, prefix_cache=prefix_cache,
                          kv_blocks=kv_blocks)
    out = []
    if pp > 1:
        from serve.pipeline import pipeline_schedule

        for plan in pipeline_schedule(sched, pp):
            done = [c.request for c in plan.chunks if c.sample]
            if done:
                out.append((plan.index, done))
            sched.update(plan, {rid: 0 for rid in done})
        return out
    for plan in schedule_loop(sched):
        done = [c.request for c in plan.chunks if c.sample]
        if done:
            out.append((plan.index, done))
        sched.update(plan, {rid: 0 for rid in done})  # max_new_tokens = 1: the token's value changes nothing
    return out


def check_pools(requests: list[Request], kv_blocks: int | None, block_size: int, decode_block_size: int) -> None:
    """ConfigError unless each side's pool holds every request alone: the prefill side its prompt, the decode side
    its prompt and every generated token but the last. Pure: every rank finds the same answer."""
    if decode_block_size < 1:
        raise ConfigError(f"pd.decode_block_size={decode_block_size} must be at least 1")
    if kv_blocks is None:
        return
    for r in requests:
        for side, positions, bs in (("prefill", len(r.prompt), block_size), ("decode", r.capacity, decode_block_size)):
            if ceil_div(positions, bs) > kv_blocks:
                raise ConfigError(f"kv_blocks={kv_blocks} cannot hold request {r.id} on the {side} side: {positions} "
                                  f"positions need {ceil_div(positions, bs)} blocks of block_size={bs}; raise "
                                  f"kv_blocks to at least {ceil_div(positions, bs)}")
