"""Run the tensor-parallel block on every rank and check it against the single-device block.

    torchrun --nproc_per_node=8 launch/run_block.py
    torchrun --nproc_per_node=2 launch/run_block.py model=gpt2_small n_tokens=128

tp = WORLD_SIZE. Every rank validates the settings before the first collective,
builds the same dense stack from `seed`, shards it, runs each variant and
compares every layer's output. Rank 0 prints and writes report.json; the exit
code is non-zero when any check fails.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script by torchrun: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hydra
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from torch.distributed.tensor.debug import CommDebugMode

from layers.config import ModelConfig, parse_dtype, parse_variants, validate_model, validate_tokens
from layers.dense import DenseStack, init_weights, weights_checksum
from layers.shard import heads_of_rank
from layers.tp_block import TPStack, shard_stack
from tp.dist import ConfigError, TPContext, env_world, init_from_env, resolve_backend, shutdown

DEFAULT_TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12}
DESCRIPTION = {"v1": "all column-parallel", "v2": "Megatron column->row"}


@dataclass(frozen=True)
class Settings:
    model: ModelConfig
    model_name: str
    n_tokens: int
    dtype: torch.dtype
    seed: int
    variants: list[str]
    backend: str
    tolerance: float
    report: str


def parse_settings(cfg: DictConfig, world_size: int, local_world_size: int) -> Settings:
    """Every check that needs no communication. Raises ConfigError; identical on every rank."""
    fields = OmegaConf.to_container(cfg.model, resolve=True)
    for key, value in fields.items():
        if key != "ln_eps" and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"model.{key}={value!r} must be an integer")
    try:
        model = ModelConfig(**fields)
    except TypeError as exc:
        raise ConfigError(f"bad model settings: {exc}") from None
    validate_model(model, world_size)
    n_tokens, seed = _integer(cfg, "n_tokens"), _integer(cfg, "seed")
    validate_tokens(model, n_tokens)
    dtype = parse_dtype(str(cfg.dtype))
    variants = parse_variants(OmegaConf.to_container(cfg.variants) if OmegaConf.is_list(cfg.variants) else cfg.variants)
    backend = resolve_backend(str(cfg.backend), local_world_size)
    tolerance = DEFAULT_TOLERANCE[dtype] if cfg.tolerance is None else _positive_float(cfg, "tolerance")
    model_name = HydraConfig.get().runtime.choices.get("model", "custom") if HydraConfig.initialized() else "custom"
    return Settings(model, model_name, n_tokens, dtype, seed, variants, backend, tolerance, str(cfg.report))


def _integer(cfg: DictConfig, key: str) -> int:
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}={value!r} must be an integer")
    return value


def _positive_float(cfg: DictConfig, key: str) -> float:
    try:
        value = float(cfg[key])
    except (TypeError, ValueError):
        raise ConfigError(f"{key}={cfg[key]!r} must be a number") from None
    if not value > 0:
        raise ConfigError(f"{key}={value} must be positive")
    return value


# ---- the check ------------------------------------------------------------------------------


def same_on_every_rank(values: torch.Tensor, ctx: TPContext) -> bool:
    """All-gather a small float64 vector and compare every rank's copy with rank 0's."""
    gathered = [torch.empty_like(values) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, values, group=ctx.group)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def collective_kind(op) -> str:
    name = str(op).rsplit(".", 1)[-1].strip("_")
    if "allreduce" in name or "all_reduce" in name:
        return "all_reduce"
    if "allgather" in name or "all_gather" in name:
        return "all_gather"
    return name


def run_variant(stack: TPStack, x: torch.Tensor, reference: list[torch.Tensor], ctx: TPContext, tol: float) -> dict:
    """Forward layer by layer, counting each layer's collectives and comparing its output."""
    layers = []
    with torch.no_grad():
        for i, block in enumerate(stack.blocks):
            with CommDebugMode() as comm:
                x = block(x)
            counts: dict[str, int] = {}
            for op, count in comm.get_comm_counts().items():
                counts[collective_kind(op)] = counts.get(collective_kind(op), 0) + count
            ref = reference[i]
            err = torch.stack([(x - ref).abs().max(), ref.abs().max()]).to(torch.float64)
            layers.append({"layer": i, "collectives": counts, "err": err})
    # Worst error over ranks, so that every rank reaches the same verdict.
    errs = torch.stack([layer.pop("err") for layer in layers]).to(ctx.device)
    dist.all_reduce(errs, op=dist.ReduceOp.MAX, group=ctx.group)
    for layer, (abs_err, scale) in zip(layers, errs.tolist()):
        layer["max_abs_err"] = abs_err
        layer["max_rel_err"] = abs_err / scale if scale else abs_err
        layer["equivalent"] = layer["max_rel_err"] <= tol
    return {
        "layers": layers,
        "max_abs_err": max(layer["max_abs_err"] for layer in layers),
        "max_rel_err": max(layer["max_rel_err"] for layer in layers),
        "equivalent": all(layer["equivalent"] for layer in layers),
    }


LINEARS = ("qkv", "attn_out", "mlp_up", "mlp_down")


def shard_rows(stack: TPStack, s: Settings, ctx: TPContext) -> list[dict]:
    """What each rank holds in one block, read off the modules themselves (all-gathered)."""
    block = stack.blocks[0]
    heads = heads_of_rank(s.model.n_heads, ctx.rank, ctx.world_size)
    mine = {"rank": ctx.rank, "heads": [heads.start, heads.stop - 1]}
    for name in LINEARS:
        linear = getattr(block, name)
        out_f, in_f = linear.weight.shape
        mine[name] = {"kind": type(linear).__name__, "weight_in_out": [in_f, out_f]}
    rows: list = [None] * ctx.world_size
    dist.all_gather_object(rows, mine, group=ctx.group)
    return rows


def check(s: Settings, ctx: TPContext) -> dict:
    cfg = s.model
    dense = init_weights(DenseStack(cfg, s.dtype, ctx.device), s.seed)
    gen = torch.Generator().manual_seed(s.seed + 1)
    x = torch.randn(s.n_tokens, cfg.d_model, generator=gen, dtype=torch.float64).to(ctx.device, s.dtype)
    fingerprint = torch.cat([weights_checksum(dense), x.detach().to("cpu", torch.float64).sum().reshape(1)])
    if not same_on_every_rank(fingerprint.to(ctx.device), ctx):
        raise RuntimeError("ranks hold different dense weights or inputs (seed or library mismatch); "
                           "every rank must build the same model")
    with torch.no_grad():
        reference = dense(x)
    stacks = {v: shard_stack(dense, v, ctx.group) for v in s.variants}
    variants = {v: run_variant(stacks[v], x, reference, ctx, s.tolerance) for v in s.variants}
    for v in s.variants:
        variants[v]["shards"] = shard_rows(stacks[v], s, ctx)
    return {
        "world_size": ctx.world_size,
        "backend": ctx.backend,
        "device": str(ctx.device),
        "config": {"model_name": s.model_name, "model": cfg.asdict(), "n_tokens": s.n_tokens,
                   "dtype": str(s.dtype).removeprefix("torch."), "seed": s.seed, "variants": s.variants,
                   "tolerance": s.tolerance},
        "variants": variants,
        "equivalent": all(v["equivalent"] for v in variants.values()),
    }


# ---- what rank 0 prints ----------------------------------------------------------------------


def format_table(header: list[str], rows: list[list]) -> str:
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
                     for row in cells)


def _span(first: int, last: int) -> str:
    return str(first) if first == last else f"{first}-{last}"


def render(report: dict) -> str:
    c, m = report["config"], report["config"]["model"]
    p = report["world_size"]
    out = [
        f"tpref: tensor-parallel block check  (tp = {p}, backend {report['backend']}, device {report['device']})",
        f"model {c['model_name']}: d={m['d_model']} h={m['n_heads']} d_head={m['d_head']} "
        f"k={m['n_heads'] * m['d_head']} ffn={m['d_ffn']} L={m['n_layers']}; "
        f"n_tokens={c['n_tokens']} dtype={c['dtype']} seed={c['seed']}",
    ]
    for v, res in report["variants"].items():
        kinds = sorted({k for layer in res["layers"] for k in layer["collectives"]}) or ["all_reduce", "all_gather"]
        out += ["", f"{v} ({DESCRIPTION[v]}): what each rank holds, W as [in x out] with y = x @ W, every layer alike"]
        out.append(format_table(
            ["rank", "heads"] + [f"{n} ({res['shards'][0][n]['kind'].replace('ParallelLinear', '').lower()})"
                                 for n in LINEARS],
            [[r["rank"], _span(*r["heads"])] + ["[{}x{}]".format(*r[n]["weight_in_out"]) for n in LINEARS]
             for r in res["shards"]]))
        out += ["", f"{v} vs single-device block, tolerance {c['tolerance']:g} "
                    f"(max |tp - dense| / max |dense|):"]
        rows = [[layer["layer"]] + [layer["collectives"].get(k, 0) for k in kinds]
                + [f"{layer['max_abs_err']:.3e}", f"{layer['max_rel_err']:.3e}",
                   "PASS" if layer["equivalent"] else "FAIL"] for layer in res["layers"]]
        rows.append(["all"] + [sum(layer["collectives"].get(k, 0) for layer in res["layers"]) for k in kinds]
                    + [f"{res['max_abs_err']:.3e}", f"{res['max_rel_err']:.3e}",
                       "PASS" if res["equivalent"] else "FAIL"])
        out.append(format_table(["layer"] + kinds + ["max_abs_err", "max_rel_err", "check"], rows))
    out.append("")
    per_layer = "; ".join(
        f"{v}: " + ", ".join(f"{n} {k}" for k, n in sorted(res["layers"][0]["collectives"].items()))
        + " per layer" if res["layers"][0]["collectives"] else f"{v}: no collectives"
        for v, res in report["variants"].items())
    verdict = "PASS" if report["equivalent"] else "FAIL"
    failed = [v for v, res in report["variants"].items() if not res["equivalent"]]
    out.append(f"{verdict}: {', '.join(report['variants'])} at tp={p} "
               + ("match the single-device block" if not failed else f"differ from the single-device block ({', '.join(failed)})")
               + f" ({per_layer})")
    return "\n".join(out)


# ---- entry point ------------------------------------------------------------------------------


def run(cfg: DictConfig) -> int:
    rank, _, world_size = env_world()
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    try:
        settings = parse_settings(cfg, world_size, local_world_size)
    except ConfigError as exc:
        print(f"[rank {rank}] error: {exc}", file=sys.stderr, flush=True)
        return 2
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads()))))
    ctx = init_from_env(settings.backend)
    try:
        report = check(settings, ctx)
    finally:
        shutdown()
    if ctx.is_main:
        print(render(report))
        path = Path(HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else ".") / settings.report
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"report: {path}")
    return 0 if report["equivalent"] else 1


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    sys.exit(run(cfg))


if __name__ == "__main__":
    if env_world()[0] != 0:
        # Only rank 0 writes Hydra's .hydra/ record into the shared run directory.
        sys.argv.append("hydra.output_subdir=null")
    main()
