"""launch/serve.py's settings: Hydra's config (conf/serve.yaml) read and checked on every rank, before any collective.

The engine's settings are EngineConfig's fields under their own names (vLLM's): conf/serve.yaml's `engine_defaults`
node is made from EngineConfig here, so each default is written once (serve/config.py), and the demo's changes are
the only engine values conf/serve.yaml states. Every function raises tp.dist.ConfigError naming the setting to
change, so every rank reaches the same verdict.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from launch.settings import (boolean, check_memory, common_settings, fitted_lengths, integer,
                             memory_need, read_transient)
from layers.models.config import SERVING_VARIANTS, ModelConfig
from layers.models.families import of, validate
from layers.models.hf import checkpoint_eos
from layers.models.pipeline import BOUNDARIES, check_pipeline, pp_layout
from serve.config import EngineConfig
from serve.pd import Layout, check_pools
from serve.request import Request, context_error
from serve.sampling_params import SamplingParams
from serve.scheduler import Scheduler, SchedulerError
from serve.worker import RankSpec
from tp.dist import DEFAULT_TIMEOUT_S, ConfigError

# The engine's settings as Hydra sees them: every EngineConfig field the launcher takes (serve/config.py setting's
# `launcher`), with its default, by its own name.
LAUNCHER_ENGINE = [f for f in dataclasses.fields(EngineConfig) if f.metadata["launcher"]]
ConfigStore.instance().store(name="engine_defaults", node={f.name: f.default for f in LAUNCHER_ENGINE})


@dataclass(frozen=True, kw_only=True)
class Settings(RankSpec):
    """serve/worker.py's RankSpec (what every rank builds, as LLM's ranks do) with the launcher's workload and report.
    checkpoint: the Checkpoint, its headers read (None: random weights from seed)."""

    requests: list[Request]
    model_name: str
    hf_checkpoint: str | None
    report: str
    dtype_from: str | None  # dtype=auto: where the dtype came from (printed beside it); None: given
    eos_from: str | None = None  # eos_id=auto: where the id(s) came from (printed beside them)
    pd: Layout | None = None  # prefill/decode disaggregation: the two groups' sizes
    streaming: bool = True
    pd_timeout_s: float = DEFAULT_TIMEOUT_S  # pd.timeout_s: the longest wait for one hand-over message
    decode_block_size: int | None = None  # pd.decode_block_size: the decode side's blocks (None: block_size)
    shared_prefix: int = 0
    notes: tuple[str, ...] = ()  # what was changed from what was asked, said by rank 0 and kept in the report
    sampling: dict | None = None  # temperature, top_k, top_p, min_p, sampling_seed; None: greedy

    @property
    def weights(self):
        """The checkpoint (its headers read), None with random weights."""
        return self.checkpoint

    @property
    def eos_id(self) -> int | list[int] | None:
        """eos_token_ids as the report writes them: one id, a list, or None."""
        ids = self.eos_token_ids
        return None if not ids else ids[0] if len(ids) == 1 else list(ids)

    @property
    def sampling_seed(self) -> int:
        return (self.sampling or {}).get("sampling_seed", 0)


def parse_settings(cfg: DictConfig, world_size: int, local_world_size: int) -> Settings:
    """Every check that needs no communication. Raises ConfigError; identical on every rank."""
    layout, streaming, pd_timeout_s, decode_block_size = parse_pd(cfg, world_size)
    pp, pp_boundary = parse_pp(cfg, world_size, layout)
    cp = integer(cfg, "cp") if "cp" in cfg else 1
    if cp < 1 or world_size % cp:
        raise ConfigError(f"cp={cp} must be a positive divisor of the world size {world_size} (world = cp x tp)")
    if cp > 1 and (pp > 1 or layout is not None):
        raise ConfigError(f"cp={cp} with {'pp' if pp > 1 else 'pd'} is not built: serve context parallelism alone")
    tp_sizes = None if layout is None else {"pd.prefill_ranks": layout.prefill_ranks // layout.prefill_pp,
                                            "pd.decode_ranks": layout.decode_ranks}
    if pp > 1:
        tp_sizes = {"tp": world_size // pp}
    if cp > 1:
        tp_sizes = {"tp": world_size // cp}
    common = common_settings(cfg, world_size, local_world_size, lm=True, tp_sizes=tp_sizes, dense=None)
    if layout is not None and common["backend"] == "gloo" and common["device"] == "cuda":
        raise ConfigError("pd with backend gloo needs device=cpu: gloo's point-to-point messages take CPU tensors "
                          "(on GPUs use backend=nccl)")
    model = common["model"]
    variant, vocab_parallel = str(cfg.variant), boolean(cfg, "vocab_parallel")
    moe_parallel = parse_moe_parallel(cfg, model, world_size, layout)
    if of(model).llama_lm and (variant != "v2" or not vocab_parallel):
        raise ConfigError(f"{model.family} models are served with variant=v2 and vocab_parallel=true (the engine "
                          f"serves their v2 blocks; the untied head is vocab-parallel)")
    if variant not in SERVING_VARIANTS:
        raise ConfigError(f"unknown variant {variant!r} for serving; choose v2 or v1 (intra_head and v2sp cut one "
                          f"forward, not a serving iteration: see run_block)")
    try:
        if layout is not None and layout.prefill_pp > 1:
            check_pipeline(model, layout.prefill_ranks, layout.prefill_pp, variant, vocab_parallel)
        engine = EngineConfig(**{f.name: OmegaConf.to_container(cfg[f.name]) if isinstance(cfg[f.name], DictConfig)
                                 else cfg[f.name] for f in LAUNCHER_ENGINE})  # kv_eviction: a dict
        if layout is not None and engine.kv_eviction is not None:
            raise ValueError("kv_eviction with pd is not built (the hand-over moves every block of a prompt): serve "
                             "it colocated, or drop it")
        if layout is not None and engine.quantization is not None:
            raise ValueError(f"quantization={engine.quantization} with pd is not built (a row-parallel weight's int8 "
                             f"groups follow each side's p, so the two sides would compute with different weights): "
                             f"serve it colocated, or drop it")
        if layout is not None and engine.kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype={engine.kv_cache_dtype} with pd is not built (the decode side would "
                             f"need the prefill side's scales with the codes): serve it colocated, or drop it")
    except ValueError as exc:
        where = f"pd.prefill_pp={layout.prefill_pp}: " if layout is not None and layout.prefill_pp > 1 and \
            "stages" in str(exc) else ""
        raise ConfigError(where + str(exc)) from None
    shared_prefix = integer(cfg, "shared_prefix")
    if shared_prefix < 0:
        raise ConfigError(f"shared_prefix={shared_prefix} must be 0 or more (random tokens before every prompt)")
    notes: list[str] = []
    requests = parse_requests(cfg, model, common["seed"], shared_prefix, notes)
    try:  # every request fits the pool alone
        Scheduler.for_workload(requests, engine)
    except SchedulerError as exc:
        raise ConfigError(str(exc)) from None
    if layout is not None:  # each side's pool holds every request alone
        check_pools(requests, engine.num_gpu_blocks_override, engine.block_size, decode_block_size or engine.block_size)
    sampling = parse_sampling(cfg, requests, layout)
    eos_token_ids, eos_from = parse_eos(cfg, model, common["hf_checkpoint"])
    check = str(cfg.check).lower()
    if check not in ("auto", "true", "false"):
        raise ConfigError(f"check={cfg.check!r} must be auto, true or false")
    check = check_and_memory(check, common, requests, tp_sizes, world_size, local_world_size, notes)
    common["checkpoint"] = common.pop("weights")
    settings = Settings(**common, requests=requests, engine=engine, eos_token_ids=eos_token_ids, eos_from=eos_from,
                    variant=variant, vocab_parallel=vocab_parallel, check=check, pd=layout, streaming=streaming,
                    pd_timeout_s=pd_timeout_s, decode_block_size=decode_block_size, shared_prefix=shared_prefix,
                    notes=tuple(notes), moe_parallel=moe_parallel, sampling=sampling, pp=pp, pp_boundary=pp_boundary,
                    cp=cp)
    try:
        settings.validate(world_size)  # the rules LLM checks too, in one place (serve/worker.py RankSpec)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return settings


def parse_pp(cfg: DictConfig, world_size: int, pd: Layout | None) -> tuple[int, str]:
    """pp (pipeline stages: a divisor of the world) and pp_boundary (whole | scatter)."""
    pp, boundary = integer(cfg, "pp") if "pp" in cfg else 1, str(cfg.get("pp_boundary", "whole"))
    try:
        pp_layout(world_size, pp)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if boundary not in BOUNDARIES:
        raise ConfigError(f"pp_boundary={boundary!r}: choose {' or '.join(BOUNDARIES)}")
    if pp == 1 and boundary != "whole":
        raise ConfigError(f"pp_boundary={boundary} is for a pipeline: set pp > 1 (or leave pp_boundary at whole)")
    if pp > 1 and pd is not None:
        raise ConfigError(f"pp={pp} with pd.*: pipeline the prefill side with pd.prefill_pp instead (the decode "
                          f"side is one TP group)")
    return pp, boundary


ORACLE_AUTO_ROWS = 200_000  # check=auto runs the oracle when it recomputes at most this many rows in all


def parse_pd(cfg: DictConfig, world_size: int) -> tuple[Layout | None, bool, float, int | None]:
    """pd.prefill_ranks / pd.decode_ranks (both or neither), pd.prefill_pp, pd.streaming, pd.timeout_s and
    pd.decode_block_size."""
    pd = cfg.get("pd") or {}
    decode_block_size = pd.get("decode_block_size")
    if decode_block_size is not None and (isinstance(decode_block_size, bool) or not isinstance(decode_block_size, int)
                                          or decode_block_size < 1):
        raise ConfigError(f"pd.decode_block_size={decode_block_size!r} must be a positive integer, or null (the "
                          f"decode side's blocks as block_size)")
    try:
        timeout_s = float(pd.get("timeout_s", DEFAULT_TIMEOUT_S))
    except (TypeError, ValueError):
        raise ConfigError(f"pd.timeout_s={pd.get('timeout_s')!r} must be a number of seconds") from None
    if not timeout_s > 0:
        raise ConfigError(f"pd.timeout_s={timeout_s} must be positive (seconds a hand-over message may take)")
    sizes = [pd.get("prefill_ranks"), pd.get("decode_ranks")]
    prefill_pp = pd.get("prefill_pp", 1)
    if isinstance(prefill_pp, bool) or not isinstance(prefill_pp, int) or prefill_pp < 1:
        raise ConfigError(f"pd.prefill_pp={prefill_pp!r} must be a positive integer (pipeline stages of the prefill "
                          f"side)")
    if sizes == [None, None]:
        for name, value, default in (("pd.decode_block_size", decode_block_size, None), ("pd.prefill_pp", prefill_pp, 1)):
            if value != default:
                raise ConfigError(f"{name}={value} without pd: set pd.prefill_ranks and pd.decode_ranks too (or drop "
                                  f"it)")
        return None, True, timeout_s, None
    if None in sizes:
        raise ConfigError(f"pd.prefill_ranks={sizes[0]} and pd.decode_ranks={sizes[1]}: set both (or neither)")
    for name, v in zip(("pd.prefill_ranks", "pd.decode_ranks"), sizes):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name}={v!r} must be a positive integer")
    layout = Layout(*sizes, prefill_pp)
    if sizes[0] % prefill_pp:
        raise ConfigError(f"pd.prefill_pp={prefill_pp} must divide pd.prefill_ranks={sizes[0]} (each prefill stage is "
                          f"a TP group of prefill_ranks / prefill_pp ranks)")
    if layout.world_size != world_size:
        raise ConfigError(f"pd.prefill_ranks={sizes[0]} + pd.decode_ranks={sizes[1]} = {layout.world_size} must equal "
                          f"the world size {world_size} (torchrun --nproc_per_node)")
    streaming = pd.get("streaming", True)
    if not isinstance(streaming, bool):
        raise ConfigError(f"pd.streaming={streaming!r} must be true or false")
    return layout, streaming, timeout_s, decode_block_size


def parse_eos(cfg: DictConfig, model: ModelConfig, hf_checkpoint: str | None) -> tuple[tuple[int, ...], str | None]:
    """eos_id: an id, null (off), or auto: the checkpoint's eos_token_id (generation_config.json, else config.json;
    one id or several), off for random weights (every id is as likely as any other there). Returns (the ids, where
    they came from: None when given)."""
    if str(cfg.eos_id) == "auto":
        ids = tuple(checkpoint_eos(hf_checkpoint, model.vocab_size))
        return ids, "auto: the checkpoint's eos_token_id" if ids else None
    eos_id = None if cfg.eos_id is None else integer(cfg, "eos_id")
    if eos_id is not None and not 0 <= eos_id < model.vocab_size:
        raise ConfigError(f"eos_id={eos_id} is not a token id of the vocabulary [0, {model.vocab_size})")
    return (() if eos_id is None else (eos_id,)), None


def parse_sampling(cfg: DictConfig, requests: list[Request], layout) -> dict | None:
    """temperature, top_k, top_p, min_p, sampling_seed: with temperature > 0 every request samples (its own seed drawn
    from sampling_seed and its id); None when decoding is greedy. Bad values: SamplingParams' one-line reason."""
    keys = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    values = {k: cfg.get(k, d) for k, d in keys.items()}
    try:
        for r in requests:
            r.params = SamplingParams(max_tokens=r.max_new_tokens, **values)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    seed = integer(cfg, "sampling_seed") if "sampling_seed" in cfg else 0
    if values["temperature"] == 0:
        for r in requests:
            r.params = None  # greedy: the head's own path, as before
        return None
    if layout is not None:
        raise ConfigError(f"temperature={values['temperature']} with pd: the prefill side's first token is greedy "
                          f"only; sample colocated (drop pd.*)")
    return {**values, "sampling_seed": seed}


def parse_moe_parallel(cfg: DictConfig, model, world_size: int, layout) -> str:
    """moe_parallel for MoE models: tp (default) or ep; ep_a2a is run_block's (see the error)."""
    value = cfg.get("moe_parallel")
    if not of(model).moe:
        if value is not None:
            raise ConfigError(f"moe_parallel={value} is for MoE models (model=mixtral_tiny); this model's FFN is dense")
        return "tp"
    placement = "tp" if value is None else str(value)
    if placement == "ep_a2a":
        raise ConfigError("moe_parallel=ep_a2a is not served: data-parallel attention needs a scheduler per rank and "
                          "every rank joining each layer's all-to-alls even in iterations where it holds no request "
                          "(empty dispatches); serve with moe_parallel=tp or ep, or check ep_a2a with run_block")
    if layout is not None:
        raise ConfigError("pd with an MoE model is not built: serve it colocated (drop pd.*)")
    validate(model, world_size, placement)
    return placement


def check_and_memory(check: str, common: dict, requests: list[Request], tp_sizes: dict | None, world_size: int,
                     local_world_size: int, notes: list[str]) -> bool:
    """Whether the dense oracle runs, and the memory check for what each rank then holds. Every rank holds its 1/p
    shard; the dense model as well with random weights (they are made dense, then cut) or with check. check=auto
    runs the oracle when its work is small and the dense model fits beside the shards; check=true insists."""
    model, dtype, device, weights = common["model"], common["dtype"], common["device"], common["weights"]
    p = min((tp_sizes or {"tp": world_size}).values())
    need = lambda dense: memory_need(model, dtype, p, local_world_size, True, device, dense,  # noqa: E731
                                     read_transient(weights) if dense else 0)
    if check == "auto":
        check = "true" if oracle_rows(requests) <= ORACLE_AUTO_ROWS else "false"
        if check == "true" and weights is not None and not need(True)["fits"]:
            check = "false"
            notes.append(f"check=auto is off: the dense oracle would hold {need(True)['per_rank'] / 2**30:.1f} GiB "
                         f"per rank, more than fits on {need(True)['where']}; each rank loads only its slices "
                         f"({need(False)['per_rank'] / 2**30:.1f} GiB)")
    dense = check == "true" or weights is None
    check_memory(model, dtype, p, local_world_size, True, device, dense, read_transient(weights) if dense else 0,
                 hint=("set check=false (each rank then reads only its slices), " if weights is not None and dense
                       else "lower model.n_layers (e.g. model.n_layers=1), " if weights is None else "")
                 + "run fewer ranks, or a smaller dtype")
    return check == "true"


def parse_requests(cfg: DictConfig, model: ModelConfig, seed: int, shared_prefix: int = 0,
                   notes: list[str] | None = None) -> list[Request]:
    """The prompts (listed, or random, after `shared_prefix` random tokens common to all), each with its
    max_new_tokens and arrival iteration. What had to change from what was asked is appended to `notes`."""
    notes = [] if notes is None else notes
    V, longest = model.vocab_size, model.max_seq_len
    if cfg.prompts is not None and shared_prefix:
        raise ConfigError(f"shared_prefix={shared_prefix} applies to random prompts; with prompts=... write the "
                          f"shared tokens into the prompts")
    if cfg.prompts is not None:
        if not OmegaConf.is_list(cfg.prompts) or len(cfg.prompts) == 0:
            raise ConfigError(f"prompts={cfg.prompts!r} must be a non-empty list of token-id lists, e.g. [[464,3290],[40]]")
        prompts = []
        for i, prompt in enumerate(OmegaConf.to_container(cfg.prompts)):
            if not isinstance(prompt, list):
                raise ConfigError(f"prompts[{i}]={prompt!r} is not a list of token ids: prompts is a list of lists, "
                                  f"e.g. prompts=[[464,3290]] for one prompt")
            if len(prompt) == 0:
                raise ConfigError(f"prompts[{i}]=[]: every prompt needs at least one token id "
                                  f"(an empty prompt is an error)")
            for t in prompt:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < V:
                    raise ConfigError(f"prompts[{i}] holds {t!r}, not a token id of the vocabulary [0, {V})")
            prompts.append(prompt)
        new = per_request(cfg, "max_new_tokens", len(prompts))
    else:
        count, mean = integer(cfg, "prompt_count"), integer(cfg, "prompt_mean")
        if count < 1 or mean < 1:
            raise ConfigError(f"prompt_count={count} and prompt_mean={mean} must be at least 1")
        new = per_request(cfg, "max_new_tokens", count)
        room = longest - max(new)  # random prompts are clipped so that prompt + max_new_tokens <= max_seq_len
        if room < 1:
            raise ConfigError(f"max_new_tokens={max(new)} leaves no room for a prompt in model.max_seq_len={longest}")
        if shared_prefix >= room:
            raise ConfigError(f"shared_prefix={shared_prefix} is too long: with max_new_tokens={max(new)} a prompt "
                              f"has at most {room} positions in model.max_seq_len={longest}, and needs one token of "
                              f"its own; use shared_prefix <= {room - 1}")
        lengths, note = fitted_lengths(str(cfg.prompt_dist), count, mean, room - shared_prefix, seed,
                                       setting="prompt_dist", mean_key="prompt_mean", what="random prompts",
                                       why=f" (model.max_seq_len={longest}, max_new_tokens={max(new)}, "
                                           f"shared_prefix={shared_prefix})")
        notes.extend([note] if note else [])
        gen = torch.Generator().manual_seed(seed + 3)
        prompts = [torch.randint(0, V, (n,), generator=gen).tolist() for n in lengths]
        if shared_prefix:  # a system prompt: drawn once, from its own stream, so the prompts after it do not change
            prefix = torch.randint(0, V, (shared_prefix,), generator=torch.Generator().manual_seed(seed + 5)).tolist()
            prompts = [prefix + p for p in prompts]
    arrivals = per_request(cfg, "arrivals", len(prompts), spacing=True)
    requests = []
    for i, (prompt, m, a) in enumerate(zip(prompts, new, arrivals)):
        if m < 1:
            raise ConfigError(f"max_new_tokens={m} (request {i}) must be at least 1")
        if a < 0:
            raise ConfigError(f"arrivals: request {i} arrives at iteration {a}; iterations start at 0")
        if len(prompt) > longest:
            raise ConfigError(f"prompt {i} has {len(prompt)} tokens, more than model.max_seq_len={longest}")
        if (error := context_error(len(prompt), m, longest)) is not None:  # the library's and the server's rule
            raise ConfigError(f"prompt {i} with max_new_tokens={m}: {error} (model.max_seq_len={longest})")
        requests.append(Request(i, prompt, m, a))
    return requests


def per_request(cfg: DictConfig, key: str, n: int, spacing: bool = False) -> list[int]:
    """One integer per request: a list of n, or one number (for arrivals: request i at i * number)."""
    value = cfg[key]
    if OmegaConf.is_list(value):
        values = list(value)
        if len(values) != n:
            raise ConfigError(f"{key} lists {len(values)} values for {n} requests")
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int):
                raise ConfigError(f"{key}={values} must hold integers")
        return values
    number = integer(cfg, key)
    return [i * number for i in range(n)] if spacing else [number] * n


def oracle_rows(requests: list[Request]) -> int:
    """Rows the cache-free oracle pushes through the model: the whole sequence, every step."""
    return sum(sum(len(r.prompt) + t for t in range(r.max_new_tokens)) for r in requests)

