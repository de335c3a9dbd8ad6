"""Reading Hydra settings, shared by the launchers: typed fields, the model, generated lengths.

Every function here is pure and raises tp.dist.ConfigError naming the setting to change, so
every rank reaches the same verdict before any process group exists.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
import os
import sys
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from layers.models.checkpoint import Checkpoint
from layers.models.config import ModelConfig
from layers.models.families import config_class, of
from layers.models.hf import check_state, read_config, read_state, resolve_dtype
from layers.models.llama import LlamaConfig
from layers.models.lm import dense_lm
from tp.dist import ConfigError, env_world, init_from_env, resolve_backend, resolve_device, shutdown


@dataclass(frozen=True)
class LaunchSettings:
    """What every launcher reads: the model and where its weights come from, dtype, seed, backend, report."""

    model: ModelConfig | LlamaConfig  # cfg.family: gpt2 or llama
    model_name: str
    hf_checkpoint: str | None
    weights: Checkpoint | None  # the checkpoint (headers read before any collective); None: random from seed
    dtype: torch.dtype
    seed: int
    backend: str
    device: str  # cpu or cuda (with gloo: ranks share the GPUs)
    report: str
    dtype_from: str | None  # dtype=auto: where the dtype came from (printed beside it); None: given


def common_settings(cfg: DictConfig, world_size: int, local_world_size: int, lm: bool = False,
                    tp_sizes: dict[str, int] | None = None, dense: bool | None = True) -> dict:
    """The LaunchSettings fields, as keywords for a launcher's own Settings. lm: the launcher needs the whole LM.
    tp_sizes: the tensor-parallel groups the model must split over, by setting name (default: the whole world).
    dense: every rank also builds the dense model (run_block's reference); None: the launcher checks the memory
    itself once it knows (serve: only with check, or random weights)."""
    model, model_name, hf_checkpoint = parse_model(cfg, world_size, tp_sizes)
    dtype, dtype_from = resolve_dtype(str(cfg.dtype), hf_checkpoint)
    where = placement(cfg, local_world_size)
    weights = None if hf_checkpoint is None else read_checkpoint(hf_checkpoint)  # the headers only
    p = min((tp_sizes or {"tp": world_size}).values())
    if dense is not None:
        check_memory(model, dtype, p, local_world_size, lm, where["device"], dense, read_transient(weights))
    if weights is not None:
        try:
            check_state(model, weights, lm)
        except ConfigError as exc:
            raise ConfigError(f"hf_checkpoint={hf_checkpoint}: {exc}") from None
    return dict(model=model, model_name=model_name, hf_checkpoint=hf_checkpoint, weights=weights,
                dtype=dtype, seed=integer(cfg, "seed"), **where, report=str(cfg.report), dtype_from=dtype_from)


def read_transient(weights) -> int:
    """Host bytes a read holds beyond the parameters it fills: one tensor (safetensors: mapped for one copy), or one
    mapped .bin file; 0 without a checkpoint."""
    if weights is None:
        return 0
    if weights.format == "bin":
        return max((weights.path / f).stat().st_size for f in weights.files)
    return max((math.prod(shape) * weights.dtypes[k].itemsize for k, shape in weights.shapes.items()), default=0)


def parameter_count(model, lm: bool) -> int:
    """The dense model's parameters: its blocks (built on the meta device: no memory) and, for the whole LM, what
    a build with no layers holds (embedding, final norm, head)."""
    outside = sum(t.numel() for t in dense_lm(dataclasses.replace(model, n_layers=0), torch.float32, "meta")
                  .parameters()) if lm else 0
    blocks = of(model).dense_blocks(model, torch.float32, "meta")
    return outside + sum(t.numel() for block in blocks for t in block.parameters())


def memory_need(model, dtype: torch.dtype, p: int, local_world_size: int, lm: bool, device: str, dense: bool,
                host_extra: int = 0) -> dict:
    """What each rank holds: its 1/p shard, the dense model too when `dense` (the reference it is checked against),
    and on the host what a read holds at once (host_extra); against what this machine (or GPU 0) has."""
    n = parameter_count(model, lm)
    per_rank = n * dtype.itemsize * ((1 if dense else 0) + 1 / p) + (host_extra if device != "cuda" else 0)
    if device == "cuda":
        gpus = torch.cuda.device_count()
        have, sharing = torch.cuda.get_device_properties(0).total_memory, max(1, -(-local_world_size // gpus))
        where = f"GPU 0 ({sharing} rank(s) per GPU)"
    else:
        have, sharing, where = available_host_memory(), local_world_size, f"this machine ({local_world_size} ranks)"
    return dict(parameters=n, per_rank=per_rank, sharing=sharing, have=have, where=where,
                fits=have is None or per_rank * sharing <= 0.9 * have)


def check_memory(model, dtype: torch.dtype, p: int, local_world_size: int, lm: bool, device: str, dense: bool = True,
                 host_extra: int = 0, hint: str | None = None) -> None:
    """Refuse, before any collective, a model that cannot fit (llama2_7b in full with its dense reference, say)
    instead of being killed."""
    need = memory_need(model, dtype, p, local_world_size, lm, device, dense, host_extra)
    if need["fits"]:
        return
    gib, n, per_rank, sharing = 2 ** 30, need["parameters"], need["per_rank"], need["sharing"]
    holds = f"the dense model and its 1/{p} shard" if dense else f"its 1/{p} shard"
    if hint is None:
        hint = ("lower model.n_layers (e.g. model.n_layers=1), " if not host_extra else "") + \
            "run fewer ranks, or a smaller dtype"
    raise ConfigError(f"model.n_layers={model.n_layers} at d_model={model.d_model}: {n / 1e9:.2f}B parameters; every "
                      f"rank holds {holds}"
                      + (f" (and {host_extra / gib:.1f} GiB of one read)" if host_extra > 2 ** 26 else "")
                      + f", {per_rank / gib:.1f} GiB in "
                      f"{str(dtype).removeprefix('torch.')}, {per_rank * sharing / gib:.1f} GiB on {need['where']}, "
                      f"more than the {need['have'] / gib:.1f} GiB available; {hint}")


def available_host_memory() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes; None where there is no such file."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def placement(cfg: DictConfig, local_world_size: int) -> dict:
    backend = resolve_backend(str(cfg.backend), local_world_size)
    return dict(backend=backend, device=resolve_device(str(cfg.get("device", "auto")), backend))


def parse_model(cfg: DictConfig, world_size: int,
                tp_sizes: dict[str, int] | None = None) -> tuple[ModelConfig | LlamaConfig, str, str | None]:
    """(model, its preset name, hf_checkpoint): `model.*` settings (model.family: gpt2 or llama), or a checkpoint's
    config.json (GPT-2 or Llama). The model is a ModelConfig or a LlamaConfig, valid for every TP size asked."""
    fields = OmegaConf.to_container(cfg.model, resolve=True)
    family = fields.pop("family", "gpt2")
    model = config_class(family).from_settings(fields)  # config_class: ConfigError naming the families
    model_name = HydraConfig.get().runtime.choices.get("model", "custom") if HydraConfig.initialized() else "custom"
    hf_checkpoint = None if cfg.hf_checkpoint is None else str(cfg.hf_checkpoint)
    if hf_checkpoint is not None:
        model, model_name = read_config(hf_checkpoint), "hf"
    # MoE models: the placement decides what p must divide (moe_parallel, checked by the launcher); here the shape
    family = of(model)
    source = f"hf_checkpoint={hf_checkpoint}: " if hf_checkpoint else ""  # the numbers came from its config.json
    for name, p in (tp_sizes or {"": world_size}).items():
        try:
            family.validate(model, 1 if family.moe else p)
        except ConfigError as exc:
            raise ConfigError(source + (f"{name}={p}: " if name else "") + str(exc)) from None
    return model, model_name, hf_checkpoint


def overridden(keys) -> set[str]:
    """Which of `keys` the command line set."""
    if not HydraConfig.initialized():
        return set()
    return {o.split("=", 1)[0].lstrip("+~") for o in HydraConfig.get().overrides.task} & set(keys)


def generate_lengths(dist_name: str, count: int, mean: int, max_len: int, seed: int,
                     setting: str = "request_dist") -> list[int]:
    """uniform: integers in [1, 2·mean-1]; lognormal: sigma 1, median mean/e^0.5 (so the mean is `mean`)."""
    gen = torch.Generator().manual_seed(seed + 2)
    if dist_name == "uniform":
        values = torch.randint(1, 2 * mean, (count,), generator=gen).double()
    elif dist_name == "lognormal":
        sigma = 1.0
        values = torch.exp(math.log(mean) - sigma**2 / 2 + sigma * torch.randn(count, generator=gen, dtype=torch.float64))
    else:
        raise ConfigError(f"unknown {setting} {dist_name!r}; choose uniform or lognormal"
                          + (" (or null)" if setting == "request_dist" else ""))
    return [int(v) for v in values.round().clamp(1, max_len).tolist()]


def fitted_lengths(dist_name: str, count: int, mean: int, max_len: int, seed: int, setting: str, mean_key: str,
                   what: str, why: str = "") -> tuple[list[int], str | None]:
    """generate_lengths, no silent change of what was asked: a mean longer than any length can be is refused, and
    the lengths drawn longer than max_len and clipped to it come back as a note (rank 0 prints it, the report
    keeps it)."""
    if mean > max_len:
        raise ConfigError(f"{mean_key}={mean} cannot be met: {what} have at most {max_len} tokens here{why}; use "
                          f"{mean_key} <= {max_len}")
    drawn = generate_lengths(dist_name, count, mean, 2**62, seed, setting)
    clipped = sum(n > max_len for n in drawn)
    note = (f"{clipped} of {count} {what} drawn longer than {max_len} tokens (the most that fit) were clipped to "
            f"{max_len}; their mean is {sum(min(n, max_len) for n in drawn) / count:.1f}, not {mean_key}={mean}"
            if clipped else None)
    return [min(n, max_len) for n in drawn], note


def print_notes(settings, ctx) -> None:
    """Rank 0 says what was changed from what was asked (settings.notes)."""
    if ctx.is_main:
        for note in getattr(settings, "notes", ()):
            print(f"note: {note}", flush=True)


def integer(cfg: DictConfig, key: str) -> int:
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}={value!r} must be an integer")
    return value


def positive_float(cfg: DictConfig, key: str) -> float:
    try:
        value = float(cfg[key])
    except (TypeError, ValueError):
        raise ConfigError(f"{key}={cfg[key]!r} must be a number") from None
    if not value > 0:
        raise ConfigError(f"{key}={value} must be positive")
    return value


def boolean(cfg: DictConfig, key: str) -> bool:
    if not isinstance(cfg[key], bool):
        raise ConfigError(f"{key}={cfg[key]!r} must be true or false")
    return cfg[key]


CONF = Path(__file__).resolve().parent.parent / "conf"


def script_main(run, config_name: str) -> None:
    """A launcher run as a script by torchrun: its command line checked before Hydra reads it (refuse_bad_arguments),
    Hydra's .hydra/ record written by rank 0 alone (the ranks share the run directory), then run(cfg) under
    hydra.main with conf/<config_name>.yaml, its return value the exit code."""
    rank = env_world()[0]
    refuse_bad_arguments(sys.argv, rank, config_name)
    if rank != 0:
        sys.argv.append("hydra.output_subdir=null")

    def main(cfg: DictConfig) -> None:
        sys.exit(run(cfg))

    hydra.main(version_base=None, config_path=str(CONF), config_name=config_name)(main)()


def refuse_bad_arguments(argv: list[str], rank: int, config_name: str) -> None:
    """Before Hydra sees the command line, each one line and exit 2 on every rank:
    - an unknown model preset (Hydra would print its own traceback and exit 1);
    - `+key=value` or `++key=value` naming a setting the launcher does not have: Hydra would add it to the config
      and the run would ignore it without a word (`+temperature=0.7` to run_block, a misspelt setting);
    - `+key=value` naming a setting it has: the '+' is not needed (Hydra would refuse it with a traceback).
    `++key=value` of an existing setting is an ordinary override, and Hydra's own `hydra.*` settings pass."""
    presets = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))
    chosen = [a.split("=", 1)[1] for a in argv[1:] if a.startswith("model=")]
    known = known_settings(config_name, chosen[-1] if chosen and chosen[-1] in presets else None)
    script = Path(argv[0]).name if argv else config_name
    for arg in argv[1:]:
        key, _, value = arg.lstrip("+").partition("=")
        message = None
        if arg.startswith("model=") and arg.split("=", 1)[1] not in presets:
            message = (f"unknown model preset {arg.split('=', 1)[1]!r}; choose one of {', '.join(presets)} (or set "
                       f"model.* fields, or hf_checkpoint=DIR)")
        elif arg.startswith("+") and key.split(".")[0] != "hydra":
            if key not in known:
                message = (f"unknown setting {key!r} ({arg}): {script} has no such setting and would ignore it; its "
                           f"settings are the keys of conf/{config_name}.yaml and conf/model/*.yaml")
            elif not arg.startswith("++"):
                message = f"{arg}: {key} is a setting already; write {key}={value}"
        if message is not None:
            print(f"[rank {rank}] error: {message}", file=sys.stderr, flush=True)
            sys.exit(2)


def known_settings(config_name: str, preset: str | None = None) -> set[str]:
    """Every setting a launcher's config can hold, dotted (`long_prefill_token_threshold`, `pd.timeout_s`, `model.d_ffn`): the keys of
    conf/<config_name>.yaml, of the structured nodes its defaults list names (ConfigStore), and of the model preset
    (`preset`, or the config's default one)."""
    from hydra.core.config_store import ConfigStore

    keys: set[str] = set()

    def walk(node, prefix: str = "") -> None:
        for k, v in node.items():
            if not prefix and k in ("defaults", "hydra"):
                continue
            keys.add(prefix + str(k))
            if isinstance(v, (dict, DictConfig)):
                walk(v, f"{prefix}{k}.")

    base = OmegaConf.load(CONF / f"{config_name}.yaml")
    walk(base)
    for entry in base.get("defaults", []):
        if isinstance(entry, str):
            stored = ConfigStore.instance().repo.get(f"{entry}.yaml")
            if stored is not None:
                walk(stored.node)
        elif preset is None and "model" in entry:
            preset = entry["model"]
    if preset is not None:
        walk(OmegaConf.load(CONF / "model" / f"{preset}.yaml"), "model.")
    return keys


def read_checkpoint(path: str):
    """The checkpoint's index and headers (layers/models/checkpoint.Checkpoint), read in the settings phase: a missing,
    truncated or corrupt file is a setting error, not a crash later. No tensor is read here."""
    try:
        return read_state(path)
    except ConfigError:
        raise
    except Exception as exc:  # a corrupt file: the reader's own message says what is wrong
        raise ConfigError(f"hf_checkpoint={path}: cannot read the weights ({type(exc).__name__}: {exc})") from None


def start(cfg: DictConfig, parse):
    """Validate on this rank (before any process group exists), then join the group.

    Returns (settings, run directory, TPContext), or None after printing the one-line
    `[rank r] error: ...` of a bad setting (the caller exits 2).
    """
    rank, _, world_size = env_world()
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    try:
        settings = parse(cfg, world_size, local_world_size)
    except ConfigError as exc:
        print_error(exc)
        return None
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads()))))
    # The checks compare float32 against float32: no TF32 matmuls on GPUs (reported as float32_matmul_precision).
    torch.set_float32_matmul_precision("highest")
    return settings, run_dir(), init_from_env(settings.backend, device=settings.device)


def print_error(exc: Exception) -> None:
    print(f"[rank {env_world()[0]}] error: {exc}", file=sys.stderr, flush=True)


def run_dir() -> Path:
    """The one run directory every rank shares (hydra.run.dir)."""
    return Path(HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else ".")


def publish(report: dict, render, path: Path, ctx) -> None:
    """Rank 0 prints the rendered report and writes it as JSON; the other ranks stay quiet."""
    if ctx.is_main:
        print(render(report))
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"report: {path}")


def launch(cfg: DictConfig, parse, work) -> int:
    """A launcher's whole life: validate on every rank (exit 2 on a bad setting, before any collective), join the
    group, return work(settings, run directory, ctx)'s exit code, leave the group. A ConfigError that only the ranks
    together can find (e.g. ranks holding different weights) exits 2 as well."""
    started = start(cfg, parse)
    if started is None:
        return 2
    print_notes(started[0], started[2])
    try:
        return work(*started)
    except ConfigError as exc:
        print_error(exc)
        return 2
    finally:
        del started  # the last reference to the group (the context) goes, so shutdown() can end its threads
        left = shutdown()
        if left:
            print(f"[rank {env_world()[0]}] warning: the process group's threads outlived shutdown ({', '.join(left)}): "
                  f"something still refers to the group", file=sys.stderr, flush=True)
