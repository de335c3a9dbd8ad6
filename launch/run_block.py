"""Run the tensor-parallel block on every rank and check it against the single-device block.

    torchrun --nproc_per_node=8 launch/run_block.py                    # requests [10, 30] (seeds/04)
    torchrun --nproc_per_node=2 launch/run_block.py model=gpt2_small n_tokens=128   # one sequence
    torchrun --nproc_per_node=4 launch/run_block.py request_dist=lognormal request_count=16 request_mean=100

    torchrun --nproc_per_node=4 launch/run_block.py model=llama_tiny                 # Llama blocks, GQA (v2, v2sp)
    torchrun --nproc_per_node=8 launch/run_block.py pp=2 microbatches=2              # 2 pipeline stages x tp 4

tp = WORLD_SIZE / pp (pp = 1 by default; pp > 1: launch/pp_check.py). Every rank validates the settings before
the first collective, builds the same dense stack from `seed` (or hf_checkpoint), shards it, runs each
variant (v1, v2, intra_head; Llama-family blocks: v2 and v2sp) and compares every layer's
output with the dense stack's. The traffic
ledger then records every collective of a forward and a backward; it must equal
the analytic model and CommDebugMode's counts (and, with profile=true, what a
torch.profiler trace shows). Rank 0 prints and writes report.json; the exit code
is non-zero when any check fails.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path

if __package__ in (None, ""):  # run as a script by torchrun: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from omegaconf import DictConfig, OmegaConf

from launch.check import run_check
from launch.cp_check import render_cp, run_cp_check
from launch.moe_check import render_moe, run_moe_check
from launch.pp_check import render_pp, run_pp_check
from launch.report import render_tp
from launch.settings import (LaunchSettings, boolean, common_settings, fitted_lengths, integer, launch, overridden,
                             positive_float, publish, script_main)
from layers.attention.varlen import score_entries
from layers.models.config import DEFAULT_TOLERANCE, ModelConfig, parse_variants, validate_tokens, validate_variants
from layers.models.families import FAMILIES, family, of
from layers.models.llama import LlamaConfig
from layers.models.moe import MOE_PARALLEL, validate_moe
from layers.models.pipeline import BOUNDARIES, PP_VARIANTS, check_layout, pp_layout
from tp.dist import ConfigError



@dataclass(frozen=True)
class Settings(LaunchSettings):
    lengths: list[int]  # the requests; one entry: a single sequence
    variants: list[str]
    tolerance: float
    repeats: int
    profile: bool
    notes: tuple[str, ...] = ()  # what was changed from what was asked, said by rank 0
    moe_parallel: tuple[str, ...] = ()  # MoE models: the placements to check (tp, ep, ep_a2a)
    pp: int = 1  # pipeline stages (tp = world / pp); 1: the plain TP check
    microbatches: int = 1
    pp_boundary: str = "whole"
    cp: int = 1  # context-parallel ranks (tp = world / cp): one request's positions split over them
    cp_decode: int = 0  # cp > 1: new tokens decoded over the split cache after the ring-attention prefill


def parse_settings(cfg: DictConfig, world_size: int, local_world_size: int) -> Settings:
    """Every check that needs no communication. Raises ConfigError; identical on every rank."""
    pp, cp = parse_pp(cfg, world_size), parse_cp(cfg, world_size)
    if pp > 1 and cp > 1:
        raise ConfigError(f"pp={pp} with cp={cp} is not built: run context parallelism with pp=1")
    common = common_settings(cfg, world_size, local_world_size, tp_sizes={"tp": world_size // pp // cp})
    model = common["model"]
    if not of(model).block_check:
        raise ConfigError(f"run_block checks {', '.join(f for f in FAMILIES if family(f).block_check)} blocks; "
                          f"{of(model).title} blocks are checked by serving them (launch/serve.py)")
    notes: list[str] = []
    lengths = request_lengths(cfg, model, common["seed"], notes)
    if cp > 1:
        return parse_context_parallel(cfg, common, lengths, notes, cp)
    if pp > 1:
        return parse_pipeline(cfg, common, lengths, notes, pp, world_size)
    moe = parse_moe_parallel(cfg, model, world_size)
    if moe:  # MoE blocks: placements of the routed FFN, not the dense FFN's variants
        if "variants" in overridden(("variants",)):
            raise ConfigError("variants= cuts a dense FFN; MoE blocks take moe_parallel=tp, ep or ep_a2a (or null "
                              "for all three)")
        return finish_settings(cfg, common, lengths, [], notes, moe)
    variants = parse_variants(OmegaConf.to_container(cfg.variants) if OmegaConf.is_list(cfg.variants) else cfg.variants)
    built = of(model).variants  # Llama-family blocks: v2 (the Megatron pattern) and v2sp only
    if set(variants) - set(built):
        kept = [v for v in variants if v in built]
        if "variants" in overridden(("variants",)):
            raise ConfigError(f"variants={variants}: {of(model).title}-family blocks are built as "
                              f"{' or '.join(built)} only (column -> row, 2 all-reduces per layer, or their "
                              f"sequence-parallel cut); drop variants= or set variants=[{','.join(built)}]")
        variants = kept or ["v2"]
    validate_variants(model, world_size, variants)
    if "v2sp" in variants and sum(lengths) < world_size:
        raise ConfigError(f"variant v2sp splits the {sum(lengths)} tokens by rows over p={world_size} ranks and needs "
                          f"at least one per rank; use at least {world_size} tokens or drop v2sp from variants")
    return finish_settings(cfg, common, lengths, variants, notes)


def parse_cp(cfg: DictConfig, world_size: int) -> int:
    cp = integer(cfg, "cp")
    if cp < 1 or world_size % cp:
        raise ConfigError(f"cp={cp} must be a positive divisor of the world size {world_size} (world = cp x tp)")
    return cp


def parse_context_parallel(cfg: DictConfig, common: dict, lengths: list[int], notes: list[str], cp: int) -> Settings:
    """cp > 1: one request (n_tokens, or the requests' total as one sequence), prefilled by ring attention and then
    decoded cp_decode tokens over the split cache; v2 blocks of GPT-2 or Llama."""
    model = common["model"]
    if not of(model).context_parallel:
        raise ConfigError(f"cp={cp} runs GPT-2 and Llama blocks; {model.family} blocks are not built for context "
                          f"parallelism")
    if "variants" in overridden(("variants",)) and parse_variants(
            OmegaConf.to_container(cfg.variants) if OmegaConf.is_list(cfg.variants) else cfg.variants) != ["v2"]:
        raise ConfigError(f"cp={cp} runs variant v2 (each cp rank a v2 TP group): set variants=[v2] or drop it")
    if cfg.get("moe_parallel") is not None:
        raise ConfigError(f"moe_parallel is for MoE models; cp={cp} runs GPT-2 and Llama blocks")
    n, decode = sum(lengths), integer(cfg, "cp_decode")
    if len(lengths) > 1:
        notes.append(f"cp={cp}: the {len(lengths)} requests run as one sequence of {n} tokens")
    if n < 2 * cp:
        raise ConfigError(f"cp={cp} cuts the prompt into 2·cp = {2 * cp} chunks: give at least {2 * cp} tokens "
                          f"(n_tokens=...), not {n}")
    if decode < 0 or n + decode > model.max_seq_len:
        raise ConfigError(f"cp_decode={decode} must be at least 0, with n_tokens + cp_decode <= model.max_seq_len="
                          f"{model.max_seq_len} (got {n} + {decode})")
    settings = finish_settings(cfg, common, [n], ["v2"], notes)
    return replace(settings, cp=cp, cp_decode=decode)


def parse_pp(cfg: DictConfig, world_size: int) -> int:
    pp = integer(cfg, "pp")
    try:
        pp_layout(world_size, pp)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if pp == 1:
        for key, default in (("microbatches", 1), ("pp_boundary", "whole")):
            if cfg.get(key) != default:
                raise ConfigError(f"{key}={cfg.get(key)} is for a pipeline: set pp > 1 (or leave {key} at {default})")
    return pp


def parse_pipeline(cfg: DictConfig, common: dict, lengths: list[int], notes: list[str], pp: int,
                   world_size: int) -> Settings:
    """pp > 1: variants v1 and v2 only (v2sp and intra_head cut what crosses the boundary differently: refused when
    asked for, dropped with a note from the default list), dense FFNs only, micro-batches of whole requests."""
    model = common["model"]
    if not of(model).pipeline:
        raise ConfigError(f"pp={pp} with MoE blocks is not built: run model=mixtral_tiny with pp=1")
    try:
        check_layout(world_size, pp, model.n_layers, "v2")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    asked = parse_variants(OmegaConf.to_container(cfg.variants) if OmegaConf.is_list(cfg.variants) else cfg.variants)
    variants = [v for v in asked if v in PP_VARIANTS and v in of(model).variants]
    if "variants" in overridden(("variants",)) and variants != asked:
        raise ConfigError(f"variants={asked}: pp={pp} runs {' and '.join(PP_VARIANTS)} (Llama-family blocks: v2); "
                          f"v2sp and intra_head cut the rows or the heads' scores across the TP ranks in a way the "
                          f"stage boundary does not model")
    if variants != asked:
        notes.append(f"pp={pp}: variants {', '.join(v for v in asked if v not in variants)} left out (not pipelined)")
    validate_variants(model, world_size // pp, variants)
    microbatches = integer(cfg, "microbatches")
    if not 1 <= microbatches <= len(lengths):
        raise ConfigError(f"microbatches={microbatches} must be between 1 and the {len(lengths)} request(s) of the "
                          f"input (each micro-batch is a group of whole requests)")
    boundary = str(cfg.pp_boundary)
    if boundary not in BOUNDARIES:
        raise ConfigError(f"pp_boundary={boundary!r}: choose {' or '.join(BOUNDARIES)}")
    if boolean(cfg, "profile"):
        raise ConfigError(f"profile=true is not built for pp={pp}")
    settings = finish_settings(cfg, common, lengths, variants, notes)
    return replace(settings, pp=pp, microbatches=microbatches, pp_boundary=boundary)


def parse_moe_parallel(cfg: DictConfig, model, world_size: int) -> tuple[str, ...]:
    """moe_parallel: tp | ep | ep_a2a, or null for all three (MoE models only), checked against p."""
    value = cfg.get("moe_parallel")
    if not of(model).moe:
        if value is not None:
            raise ConfigError(f"moe_parallel={value} is for MoE models (model=mixtral_tiny); this model's FFN is dense")
        return ()
    placements = MOE_PARALLEL if value is None else (str(value),)
    for placement in placements:
        validate_moe(model, world_size, placement)
    return tuple(placements)


def finish_settings(cfg: DictConfig, common: dict, lengths: list[int], variants: list[str], notes: list[str],
                    moe: tuple[str, ...] = ()) -> Settings:
    dtype = common["dtype"]
    repeats = integer(cfg, "repeats")
    if repeats < 1:  # the report's per-collective times are medians over the timed repeats
        raise ConfigError(f"repeats={repeats} must be at least 1 (timed forwards per variant)")
    tolerance = DEFAULT_TOLERANCE[dtype] if cfg.tolerance is None else positive_float(cfg, "tolerance")
    return Settings(**common, lengths=lengths, variants=variants, tolerance=tolerance, repeats=repeats,
                    profile=boolean(cfg, "profile"), notes=tuple(notes), moe_parallel=moe)


def request_lengths(cfg: DictConfig, model: ModelConfig | LlamaConfig, seed: int, notes: list[str]) -> list[int]:
    """The requests of this run: one sequence (n_tokens), generated (request_dist), or listed (requests). What had to
    change from what was asked is appended to `notes`."""
    given = overridden(("n_tokens", "requests", "request_dist"))
    if cfg.n_tokens is not None:
        if {"requests", "request_dist"} & given:
            raise ConfigError("give either n_tokens (one sequence) or requests/request_dist (many), not both")
        lengths = [integer(cfg, "n_tokens")]
    elif cfg.request_dist is not None:
        count, mean = integer(cfg, "request_count"), integer(cfg, "request_mean")
        if count < 1 or mean < 1:
            raise ConfigError(f"request_count={count} and request_mean={mean} must be at least 1")
        lengths, note = fitted_lengths(str(cfg.request_dist), count, mean, model.max_seq_len, seed,
                                       setting="request_dist", mean_key="request_mean", what="requests",
                                       why=f" (model.max_seq_len={model.max_seq_len})")
        notes.extend([note] if note else [])
    else:
        if not OmegaConf.is_list(cfg.requests) or len(cfg.requests) == 0:
            raise ConfigError(f"requests={cfg.requests!r} must be a non-empty list of lengths, e.g. requests=[10,30]")
        lengths = list(cfg.requests)
        for i, n in enumerate(lengths):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ConfigError(f"requests[{i}]={n!r}: every request needs a whole number of tokens, at least 1 "
                                  f"(an empty request is an error)")
    for i, n in enumerate(lengths):
        validate_tokens(model, n, "n_tokens" if cfg.n_tokens is not None else f"request {i} length")
    return lengths


# ---- entry point ------------------------------------------------------------------------------


def run(cfg: DictConfig) -> int:
    return launch(cfg, parse_settings, check_and_report)


def check_and_report(s: Settings, out_dir: Path, ctx) -> int:
    """The check the settings ask for (cp > 1, pp > 1, MoE placements, or the TP variants); rank 0 prints it and
    writes report.json. Exit code 1 when any check fails."""
    if s.cp > 1:
        res = run_cp_check(s.model, n=s.lengths[0], new_tokens=s.cp_decode, dtype=s.dtype, seed=s.seed,
                           tolerance=s.tolerance, cp=s.cp, ctx=ctx, weights=s.weights)
        report = block_report(s, ctx, {"n_tokens": s.lengths[0], "cp": s.cp, "cp_decode": s.cp_decode},
                              {"cp_check": res}, [res["equivalent"]], [res["ledger_matches_model"]])
        render_report = render_cp
    elif s.pp > 1:
        res = run_pp_check(s.model, lengths=s.lengths, dtype=s.dtype, seed=s.seed, variants=s.variants,
                           tolerance=s.tolerance, pp=s.pp, microbatches=s.microbatches, boundary=s.pp_boundary,
                           ctx=ctx, weights=s.weights)
        checked = res["variants"].values()
        report = block_report(s, ctx, {"requests": s.lengths, "variants": s.variants, "pp": s.pp,
                                       "microbatches": s.microbatches, "pp_boundary": s.pp_boundary}, res,
                              [v["equivalent"] for v in checked], [v["ledger_matches_model"] for v in checked])
        render_report = render_pp
    elif s.moe_parallel:
        res = run_moe_check(s.model, lengths=s.lengths, dtype=s.dtype, seed=s.seed, placements=list(s.moe_parallel),
                            tolerance=s.tolerance, repeats=s.repeats, ctx=ctx, weights=s.weights)
        checked = res["placements"].values()
        report = block_report(s, ctx, {"requests": s.lengths, "moe_parallel": list(s.moe_parallel),
                                       "repeats": s.repeats}, res,
                              [v["equivalent"] for v in checked], [v["ledger_matches_model"] for v in checked])
        render_report = render_moe
    else:
        variants = run_check(s.model, lengths=s.lengths, dtype=s.dtype, seed=s.seed, variants=s.variants,
                             tolerance=s.tolerance, repeats=s.repeats, weights=s.weights,
                             profile_dir=out_dir / "traces" if s.profile else None, ctx=ctx)
        checked = variants.values()
        report = block_report(s, ctx, {"n_tokens": sum(s.lengths), "requests": s.lengths, "variants": s.variants,
                                       "repeats": s.repeats, "profile": s.profile},
                              {"attention_work": {layout: score_entries(s.lengths, layout)
                                                  for layout in ("varlen", "flat_masked", "padded")},
                               "variants": variants},
                              [v["equivalent"] and all(r["equivalent"] for r in v["requests"]) for v in checked],
                              [v["ledger_matches_model"] and v["counts_agree"]
                               and v.get("profile", {}).get("trace_matches_ledger", True)
                               and v["activation_memory"].get("matches_formula", True) for v in checked])
        render_report = render_tp
    publish(report, render_report, out_dir / s.report, ctx)
    return 0 if report["equivalent"] and report["traffic_ok"] else 1


def block_report(s: Settings, ctx, config: dict, results: dict, equivalent: list[bool],
                 traffic_ok: list[bool]) -> dict:
    """report.json: the group, the settings (every check's and this check's own), the results and the two
    verdicts: every part equivalent to the single-device block, every traffic check agreeing."""
    return {"world_size": ctx.world_size, "backend": ctx.backend, "device": str(ctx.device),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "config": {"model_name": s.model_name, "family": s.model.family, "model": s.model.asdict(),
                       "hf_checkpoint": s.hf_checkpoint, "dtype": str(s.dtype).removeprefix("torch."),
                       "dtype_from": s.dtype_from, "seed": s.seed, "tolerance": s.tolerance, **config},
            "notes": list(s.notes), **results, "equivalent": all(equivalent), "traffic_ok": all(traffic_ok)}


if __name__ == "__main__":
    script_main(run, "config")
