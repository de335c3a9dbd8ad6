"""This rank's part of a served model, and the engine that serves it: the one copy every entry point uses (the rank
processes behind LLM, launch/serve.py, serve/pd/, the benchmarks).

    weights, dense = rank_weights(model_cfg, checkpoint, dtype, ctx.device, seed)
    lm = build_lm(weights, ctx, pp=2)                       # a PPLM stage, or a TP model with pp = 1
    engine = new_engine(lm, ctx, EngineConfig(...), eos_token_ids, seed, hooks)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from layers.models.checkpoint import Checkpoint
from layers.models.dense import init_weights
from layers.models.hf import CheckpointSource, load_lm
from layers.models.lm import dense_lm, shard_lm
from layers.parallel import weight_format
from serve.config import EngineConfig
from serve.engine import LLMEngine
from serve.hooks import StepHook
from serve.pipeline import PipelineEngine
from tp.dist import TPContext


def rank_weights(model, checkpoint: Checkpoint | str | None, dtype: torch.dtype, device, seed: int):
    """(weights, dense): what build_lm cuts this rank's model from, and the dense model when this rank already holds
    it. A checkpoint: its per-rank source (each rank reads only its slices; no dense model). Random weights: the dense
    LM drawn from seed, which is both."""
    if checkpoint is not None:
        checkpoint = Checkpoint(checkpoint) if isinstance(checkpoint, str) else checkpoint
        return CheckpointSource(checkpoint, model, dtype, device), None
    dense = init_weights(dense_lm(model, dtype, device), seed)
    return dense, dense


def dense_model(model, checkpoint: Checkpoint | str | None, dtype: torch.dtype, device, dense=None, served=None):
    """The whole dense model (the oracle's): `dense` when rank_weights made it, else the checkpoint read whole. served:
    this rank's served model; where its weights are int8 the oracle's are what they stand for (a copy of `dense`,
    dequantized as the ranks quantized theirs: weight_format.dequantized)."""
    loaded = dense is None
    if loaded:
        checkpoint = Checkpoint(checkpoint) if isinstance(checkpoint, str) else checkpoint
        dense = load_lm(dense_lm(model, dtype, device), checkpoint)
    if served is not None and weight_format.quantized(served):
        import copy

        dense = weight_format.dequantized(dense if loaded else copy.deepcopy(dense), served)  # a given model: a copy
    return dense


def prepare_weights(lm, config: EngineConfig):
    """lm's matmul weights stored as the settings ask (layers/parallel/weight_format.py: quantization, weight_layout;
    enforce_eager: nothing compiled). In place; returns lm."""
    return weight_format.prepare(lm, config.quantization, config.weight_layout, compile=not config.enforce_eager,
                                 tile_rows=weight_format.TILE_ROWS if config.batch_invariant else None)


@torch.no_grad()
def build_lm(weights, ctx: TPContext, *, pp: int = 1, variant: str = "v2", vocab_parallel: bool = True,
             moe_parallel: str = "tp", pp_boundary: str = "whole", group: dist.ProcessGroup | None = None):
    """This rank's model: with pp = 1 its TP shard over `group` (default ctx.group; context parallelism's tp group)
    (shard_lm); with pp > 1 its stage's (the world is pp stages of world / pp TP ranks: layers/models/pipeline.py; every
    rank builds the stage groups, in the same order)."""
    if pp == 1:
        return shard_lm(weights, variant, ctx.group if group is None else group, vocab_parallel, moe_parallel)
    from layers.models.pipeline import check_layout, new_pp_groups, shard_pp_lm

    layout = check_layout(ctx.world_size, pp, weights.cfg.n_layers, variant)
    stages = new_pp_groups(layout)
    return shard_pp_lm(weights, variant, layout, ctx.rank, stages[layout.stage_of(ctx.rank)], pp_boundary)


def build_rank(spec, ctx: TPContext):
    """(lm, dense, cp_group) for a serve/worker.py RankSpec: this rank's model (its TP shard, its pipeline stage, or
    with context parallelism its shard over its tp group), the dense model when making the weights made it (random
    weights; None from a checkpoint), and this rank's cp group (None without context parallelism)."""
    weights, dense = rank_weights(spec.model, spec.checkpoint, spec.dtype, ctx.device, spec.seed)
    tp_group, cp_group = None, None
    if spec.cp > 1:  # every rank makes every group, in the same order
        from layers.attention.context_parallel import rank_groups

        tp_group, cp_group = rank_groups(ctx.world_size, spec.cp, ctx.rank)
    lm = build_lm(weights, ctx, pp=spec.pp, variant=spec.variant, vocab_parallel=spec.vocab_parallel,
                  moe_parallel=spec.moe_parallel, pp_boundary=spec.pp_boundary, group=tp_group)
    return prepare_weights(lm, spec.engine), dense, cp_group


def own_group(ctx: TPContext) -> dist.ProcessGroup:
    """A group of this rank alone (every rank creates every rank's, in the same order, as new_group requires): a
    model sharded over it is whole here and issues no collective (speculative decoding's draft, serve/draft.py)."""
    groups = [dist.new_group([r]) for r in range(ctx.world_size)]
    return groups[ctx.rank]


def new_engine(lm, ctx: TPContext, config: EngineConfig | None = None, eos_token_ids: tuple[int, ...] = (),
               seed: int = 0, hooks: list[StepHook] | None = None, draft_lm=None, cp_group=None,
               connector=None) -> LLMEngine:
    """An LLMEngine for a TP model (with speculative decoding's draft model, whole on this rank, if given; with
    context parallelism's cp group, lm being this rank's TP shard over its tp group); for a pipeline stage's model
    (layers/models/pipeline.py's PPLM, ctx the world's), the PipelineEngine. connector: a KV connector its driver
    built (P/D's), else the one config.kv_transfer_config names."""
    if hasattr(lm, "forward_stage"):
        return PipelineEngine(lm, ctx, config, eos_token_ids, seed, hooks, connector)
    return LLMEngine(lm, ctx, config, eos_token_ids, seed, hooks, draft_lm, cp_group, connector)
