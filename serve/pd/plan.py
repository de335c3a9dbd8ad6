"""P/D's plan, the same on every rank of the world: the two groups' layout, and which prompts complete in which
prefill iteration (computed by the engine's own scheduler), checked before anything is served. Host only."""

from __future__ import annotations

from dataclasses import dataclass

from layers.models.families import validate
from serve.config import EngineConfig, fits_alone
from serve.request import Request
from serve.scheduler import Scheduler, pipeline_schedule
from tp.dist import ConfigError


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
            validate(cfg, p)
        except ConfigError as exc:
            where = f"pd.prefill_ranks={p_p} / pd.prefill_pp={pp}" if name == "pd.prefill_ranks" and pp > 1 else \
                f"{name}={p}"
            raise ConfigError(f"{where}: {exc}") from None


def prefill_schedule(requests: list[Request], config: EngineConfig, pp: int = 1) -> list[tuple[int, list[int]]]:
    """[(prefill iteration, ids of the requests whose prompt completes in it, in plan order)]: what the prefill side's
    engine will do, computed on every rank from the requests and settings alone, by the engine's own code (its
    scheduler and its planning loops, serve/scheduler.py), so the two cannot differ. pp > 1: the prefill side is a
    pipeline (PipelineEngine's ticks: pipeline_schedule)."""
    mine = [Request(r.id, list(r.prompt), 1, r.arrival) for r in requests]
    sched = Scheduler.for_workload(mine, config)
    out = []
    for plan in pipeline_schedule(sched, pp):
        done = [c.request for c in plan.scheduled if c.sample]
        if done:
            out.append((plan.index, done))
        sched.update_from_output(plan, {rid: 0 for rid in done})  # max_new_tokens = 1: the token's value is moot
    return out


def check_pools(requests: list[Request], num_gpu_blocks_override: int | None, block_size: int,
                decode_block_size: int) -> None:
    """ConfigError unless each side's pool holds every request alone: the prefill side its prompt, the decode side
    its prompt and every generated token but the last. Pure: every rank finds the same answer."""
    if decode_block_size < 1:
        raise ConfigError(f"pd.decode_block_size={decode_block_size} must be at least 1")
    if num_gpu_blocks_override is None:
        return
    for r in requests:
        for side, positions, bs in (("prefill", len(r.prompt), block_size), ("decode", r.capacity, decode_block_size)):
            reason = fits_alone(positions, num_gpu_blocks_override, bs)
            if reason is not None:
                raise ConfigError(f"request {r.id} cannot be held on the {side} side: {reason}")
