"""Serve requests on the TP stack and check every token against a dense, cache-free oracle.

    torchrun --nproc_per_node=4 launch/serve.py                      # 8 random prompts, staggered arrivals
    torchrun --nproc_per_node=2 launch/serve.py prompts=[[464,3290,318],[40]] max_new_tokens=8
    torchrun --nproc_per_node=4 launch/serve.py chunk_size=1024 max_batched_tokens=2048   # whole prompts
    torchrun --nproc_per_node=2 launch/serve.py hf_checkpoint=DIR    # GPT2LMHeadModel or LlamaForCausalLM
    torchrun --nproc_per_node=4 launch/serve.py model=llama_tiny     # grouped-query attention, RoPE, SwiGLU
    torchrun --nproc_per_node=4 launch/serve.py shared_prefix=48     # a 48-token system prompt: prefix cache hits
    torchrun --nproc_per_node=2 launch/serve.py kv_blocks=6 block_size=4   # a small pool: requests are preempted

tp = WORLD_SIZE. Every rank validates the settings (and reads a checkpoint) before the first
collective, builds the same LM (GPT-2 or Llama) from `seed`, shards it (vocab-parallel embedding and
head, v1 or v2 blocks, a paged KV pool per rank of the rank's K,V heads) and serves the requests with
iteration-level batching, chunked prefill, prefix caching and preemption (serve/). Every iteration's collectives are compared with the analytic model;
with `check`, every request's tokens are compared with the dense oracle. Rank 0 prints the
per-iteration and per-request tables and writes report.json; the exit code is non-zero when a
check fails.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script by torchrun: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hydra
from hydra.core.config_store import ConfigStore
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from launch.serve_report import render, render_pd
from launch.loading import LoadMeter
from launch.settings import (LaunchSettings, boolean, check_memory, common_settings, fitted_lengths, integer, launch,
                             memory_need, publish, read_transient, refuse_bad_arguments)
from layers.attention_backends import choose
from layers.config import SERVING_VARIANTS, ModelConfig
from layers.dense import init_weights, weights_checksum
from layers.hf import CheckpointSource, checkpoint_eos, load_lm
from layers.lm import (NEAR_TIE, DenseLlamaLM, DenseLM, dense_lm, greedy_reference, oracle_verdict,
                       sampled_reference, shard_lm)
from layers.moe import validate_moe
from layers.pipeline import check_layout, new_pp_groups, shard_pp_lm, stage_layers
from serve.pd import Layout, check_pools, new_groups, serve_pd
from serve.pipeline import stage_report
from serve.engine import Engine, ServeResult, new_scheduler
from serve.kv_cache import kv_bytes_per_token
from serve.config import EngineConfig
from serve.sampling_params import SamplingParams
from serve.scheduler import Request, SchedulerError
from tp.cost_model import kv_bytes_per_token_per_rank
from tp.partition import kv_heads_per_rank
from tp.traffic_model import pair_count
from tp.dist import DEFAULT_TIMEOUT_S, ConfigError, context, env_world, same_on_every_rank
from tp.ledger import ring_bytes_per_rank

ORACLE_AUTO_ROWS = 200_000  # check=auto runs the oracle when it recomputes at most this many rows in all


@dataclass(frozen=True)
class Settings(LaunchSettings):
    requests: list[Request]
    chunk_size: int
    max_batched_tokens: int
    max_running: int | None
    eos_id: int | tuple[int, ...] | None  # the id(s) that finish a request
    variant: str
    vocab_parallel: bool
    check: bool
    pd: Layout | None = None  # prefill/decode disaggregation: the two groups' sizes
    streaming: bool = True
    pd_timeout_s: float = DEFAULT_TIMEOUT_S  # pd.timeout_s: the longest wait for one hand-over message
    decode_block_size: int | None = None  # pd.decode_block_size: the decode side's blocks (None: block_size)
    block_size: int = EngineConfig.block_size  # token positions per KV block
    kv_blocks: int | None = None  # blocks in each rank's pool; None: enough for every request at its largest
    prefix_cache: bool = EngineConfig.prefix_cache
    attention: str = EngineConfig.attention
    shared_prefix: int = 0
    comm_timing: bool = False  # per-collective times in the ledger: two waits for the compute stream per collective
    chunk_pipelining: bool = False  # pp > 1: a prompt's next chunk may enter while its previous one is in flight
    notes: tuple[str, ...] = ()  # what was changed from what was asked, said by rank 0 and kept in the report
    moe_parallel: str = "tp"  # MoE models: where the experts live (tp: split; ep: whole experts per rank)
    sampling: dict | None = None  # temperature, top_k, top_p, min_p, sampling_seed; None: greedy
    eos_from: str | None = None  # eos_id=auto: where the id(s) came from (printed beside them)
    pp: int = 1  # pipeline stages (serve/pipeline.py): pp stages of world / pp TP ranks
    pp_boundary: str = "whole"  # whole | scatter: what each TP rank sends across a stage boundary

    def engine_args(self) -> dict:
        return dict(chunk_size=self.chunk_size, max_batched_tokens=self.max_batched_tokens,
                    max_running=self.max_running, eos_id=self.eos_id, block_size=self.block_size,
                    kv_blocks=self.kv_blocks, prefix_cache=self.prefix_cache, attention=self.attention,
                    comm_timing=self.comm_timing, chunk_pipelining=self.chunk_pipelining,
                    seed=(self.sampling or {}).get("sampling_seed", 0))


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


def parse_pp(cfg: DictConfig, world_size: int, pd: Layout | None) -> tuple[int, str]:
    """pp (pipeline stages: a divisor of the world) and pp_boundary (whole | scatter)."""
    from layers.pipeline import BOUNDARIES

    pp, boundary = integer(cfg, "pp") if "pp" in cfg else 1, str(cfg.get("pp_boundary", "whole"))
    if pp < 1 or world_size % pp:
        raise ConfigError(f"pp={pp} must divide the world of {world_size} ranks (each stage is a TP group of "
                          f"world / pp ranks)")
    if boundary not in BOUNDARIES:
        raise ConfigError(f"pp_boundary={boundary!r}: choose {' or '.join(BOUNDARIES)}")
    if pp == 1 and boundary != "whole":
        raise ConfigError(f"pp_boundary={boundary} is for a pipeline: set pp > 1 (or leave pp_boundary at whole)")
    if pp > 1 and pd is not None:
        raise ConfigError(f"pp={pp} with pd.*: pipeline the prefill side with pd.prefill_pp instead (the decode "
                          f"side is one TP group)")
    return pp, boundary


def parse_settings(cfg: DictConfig, world_size: int, local_world_size: int) -> Settings:
    """Every check that needs no communication. Raises ConfigError; identical on every rank."""
    layout, streaming, pd_timeout_s, decode_block_size = parse_pd(cfg, world_size)
    pp, pp_boundary = parse_pp(cfg, world_size, layout)
    tp_sizes = None if layout is None else {"pd.prefill_ranks": layout.prefill_ranks // layout.prefill_pp,
                                            "pd.decode_ranks": layout.decode_ranks}
    if pp > 1:
        tp_sizes = {"tp": world_size // pp}
    common = common_settings(cfg, world_size, local_world_size, lm=True, tp_sizes=tp_sizes, dense=None)
    if layout is not None and common["backend"] == "gloo" and common["device"] == "cuda":
        raise ConfigError("pd with backend gloo needs device=cpu: gloo's point-to-point messages take CPU tensors "
                          "(on GPUs use backend=nccl)")
    model = common["model"]
    variant = str(cfg.variant)
    moe_parallel = parse_moe_parallel(cfg, model, world_size, layout)
    if model.family in ("llama", "mixtral") and (variant != "v2" or not boolean(cfg, "vocab_parallel")):
        raise ConfigError("Llama-family models are served with variant=v2 and vocab_parallel=true (the engine serves "
                          "their v2 blocks; the untied head is vocab-parallel)")
    if variant not in SERVING_VARIANTS:
        raise ConfigError(f"unknown variant {variant!r} for serving; choose v2 or v1 (intra_head and v2sp cut one "
                          f"forward, not a serving iteration: see run_block)")
    if layout is not None and layout.prefill_pp > 1:
        from layers.pipeline import check_layout

        try:
            check_layout(layout.prefill_ranks, layout.prefill_pp, model.n_layers, variant)
        except ValueError as exc:
            raise ConfigError(f"pd.prefill_pp={layout.prefill_pp}: {exc}") from None
    if pp > 1:
        from layers.pipeline import check_layout

        if model.family == "mixtral":
            raise ConfigError(f"pp={pp} with an MoE model is not built: its experts are placed over the world, not one "
                              f"stage (serve model=mixtral_tiny with pp=1)")
        if not boolean(cfg, "vocab_parallel"):
            raise ConfigError(f"pp={pp} with vocab_parallel=false is not built: a pipeline's first and last stages hold "
                              f"the embedding and the head vocabulary-parallel")
        try:
            check_layout(world_size, pp, model.n_layers, variant)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    engine = parse_engine(cfg)
    if engine.chunk_pipelining and pp == 1:
        raise ConfigError("chunk_pipelining=true is for a pipeline: set pp > 1 (or leave chunk_pipelining false)")
    paging = parse_paging(cfg, engine)
    notes: list[str] = []
    requests = parse_requests(cfg, model, common["seed"], paging["shared_prefix"], notes)
    chunk_size, budget = engine.chunk_size, engine.max_batched_tokens
    max_running = None if cfg.max_running is None else engine.max_running
    try:  # every request fits the pool alone
        new_scheduler(requests, chunk_size=chunk_size, max_batched_tokens=budget, max_running=max_running,
                      block_size=engine.block_size, kv_blocks=engine.kv_blocks, prefix_cache=engine.prefix_cache)
    except SchedulerError as exc:
        raise ConfigError(str(exc)) from None
    if layout is not None:  # each side's pool holds every request alone
        check_pools(requests, paging["kv_blocks"], paging["block_size"], decode_block_size or paging["block_size"])
    sampling = parse_sampling(cfg, requests, layout)
    eos_id, eos_from = parse_eos(cfg, model, common["hf_checkpoint"])
    check = str(cfg.check).lower()
    if check not in ("auto", "true", "false"):
        raise ConfigError(f"check={cfg.check!r} must be auto, true or false")
    check = check_and_memory(check, common, requests, tp_sizes, world_size, local_world_size, notes)
    return Settings(**common, requests=requests, chunk_size=chunk_size, max_batched_tokens=budget,
                    max_running=max_running, eos_id=eos_id, eos_from=eos_from, variant=variant,
                    vocab_parallel=boolean(cfg, "vocab_parallel"), check=check, pd=layout,
                    streaming=streaming, pd_timeout_s=pd_timeout_s, decode_block_size=decode_block_size,
                    notes=tuple(notes), moe_parallel=moe_parallel,
                    sampling=sampling, pp=pp, pp_boundary=pp_boundary, chunk_pipelining=engine.chunk_pipelining,
                    **paging)


def parse_eos(cfg: DictConfig, model: ModelConfig, hf_checkpoint: str | None) -> tuple[int | tuple | None, str | None]:
    """eos_id: an id, null (off), or auto: the checkpoint's eos_token_id (generation_config.json, else config.json;
    one id or several), off for random weights (every id is as likely as any other there). Returns (eos, where it
    came from: None when given)."""
    if str(cfg.eos_id) == "auto":
        ids = checkpoint_eos(hf_checkpoint, model.vocab_size)
        if not ids:
            return None, None
        return (ids[0] if len(ids) == 1 else ids), "auto: the checkpoint's eos_token_id"
    eos_id = None if cfg.eos_id is None else integer(cfg, "eos_id")
    if eos_id is not None and not 0 <= eos_id < model.vocab_size:
        raise ConfigError(f"eos_id={eos_id} is not a token id of the vocabulary [0, {model.vocab_size})")
    return eos_id, None


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
    if model.family != "mixtral":
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
    validate_moe(model, world_size, placement)
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


def parse_engine(cfg: DictConfig) -> EngineConfig:
    """The engine's settings, checked once by EngineConfig itself (its one-line ValueError becomes a ConfigError).
    max_running null: as many as max_batched_tokens rows allow; kv_blocks null: decided per workload by Engine
    (every request at its largest at once)."""
    budget = integer(cfg, "max_batched_tokens")
    try:
        return EngineConfig(chunk_size=integer(cfg, "chunk_size"), max_batched_tokens=budget,
                            max_running=budget if cfg.max_running is None else integer(cfg, "max_running"),
                            block_size=integer(cfg, "block_size"),
                            kv_blocks=None if cfg.kv_blocks is None else integer(cfg, "kv_blocks"),
                            prefix_cache=boolean(cfg, "prefix_cache"), attention=str(cfg.attention),
                            comm_timing=boolean(cfg, "comm_timing"),
                            chunk_pipelining=boolean(cfg, "chunk_pipelining"))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def parse_paging(cfg: DictConfig, engine: EngineConfig) -> dict:
    """block_size, kv_blocks, prefix_cache, attention, comm_timing (from the checked EngineConfig), shared_prefix."""
    shared_prefix = integer(cfg, "shared_prefix")
    if shared_prefix < 0:
        raise ConfigError(f"shared_prefix={shared_prefix} must be 0 or more (random tokens before every prompt)")
    return dict(block_size=engine.block_size, kv_blocks=engine.kv_blocks, prefix_cache=engine.prefix_cache,
                attention=engine.attention, shared_prefix=shared_prefix, comm_timing=engine.comm_timing)


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
        room = longest - max(new) + 1  # random prompts are clipped so that every request fits max_seq_len
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
        if len(prompt) + m - 1 > longest:
            raise ConfigError(f"prompt {i} ({len(prompt)} tokens) + max_new_tokens={m} needs {len(prompt) + m - 1} "
                              f"positions, more than model.max_seq_len={longest}; lower max_new_tokens")
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


# ---- what every rank does ---------------------------------------------------------------------


def prepare(s: Settings, ctx):
    """(weights, dense): what shard_lm cuts each rank's model from, and the dense oracle so far. A checkpoint: its
    per-rank source (each rank reads only its slices; no dense model yet). Random weights: the dense LM from seed,
    which is both."""
    if s.weights is not None:
        return CheckpointSource(s.weights, s.model, s.dtype, ctx.device), None
    dense = init_weights(dense_lm(s.model, s.dtype, ctx.device), s.seed)
    return dense, dense


def dense_oracle(s: Settings, ctx, dense) -> DenseLM | DenseLlamaLM | None:
    """With check, the dense model the oracle recomputes with (from a checkpoint: read one whole tensor at a time);
    None without."""
    if not s.check:
        return None
    if dense is None:
        dense = dense_lm(s.model, s.dtype, ctx.device)
        try:
            load_lm(dense, s.weights)
        except (KeyError, ValueError) as exc:
            raise ConfigError(f"hf_checkpoint={s.hf_checkpoint}: {exc}") from None
    return dense


def agree(s: Settings, ctx, dense) -> None:
    """Every rank holds the same weights and prompts: the checkpoint's index and headers (or the dense weights made
    from seed) and the prompts, compared across ranks; ConfigError on every rank if not."""
    prompts = torch.tensor([float(sum((j + 1) * t for j, t in enumerate(r.prompt))) for r in s.requests],
                           dtype=torch.float64)
    weights = (torch.tensor([float(s.weights.fingerprint)], dtype=torch.float64) if s.weights is not None
               else weights_checksum(dense))
    fingerprint = torch.cat([weights, prompts.sum()[None], (prompts * 1.5).cumsum(0).sum()[None]])
    if not same_on_every_rank(fingerprint.to(ctx.device), ctx.group):
        raise ConfigError("ranks built different weights or prompts: every rank needs the same settings and files")


def oracle_check(dense: DenseLM, s: Settings, result: ServeResult, ctx) -> list[dict]:
    """Each rank checks every p-th request against the dense oracle; every rank gets all verdicts."""
    mine = {}
    for r, served in zip(s.requests, result.requests):
        if r.id % ctx.world_size != ctx.rank:
            continue
        ref = (greedy_reference(dense, r.prompt, r.max_new_tokens, s.eos_id) if r.params is None else
               sampled_reference(dense, r.prompt, r.params, r.sampling_seed, s.eos_id))
        mine[r.id] = compare(served, ref, NEAR_TIE[s.dtype])
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, mine, group=ctx.group)
    return [next(g[r.id] for g in gathered if r.id in g) for r in s.requests]


def compare(served: dict, ref, near_tie: float) -> dict:
    return {"request": served["request"], **oracle_verdict(served["output_ids"], served["logits"], ref, near_tie)}


def run(cfg: DictConfig) -> int:
    return launch(cfg, parse_settings, serve_and_report)


def serve_and_report(s: Settings, out_dir: Path, ctx) -> int:
    if s.pd is not None:
        return serve_disaggregated(s, out_dir, ctx)
    meter = LoadMeter(s.weights)
    with meter:
        weights, dense = prepare(s, ctx)
        if s.pp > 1:  # this rank's stage: its layers' blocks over its stage's TP group (layers/pipeline.py)
            layout = check_layout(ctx.world_size, s.pp, s.model.n_layers, s.variant)
            stages, _ = new_pp_groups(layout)
            lm = shard_pp_lm(weights, s.variant, layout, ctx.rank, stages[layout.stage_of(ctx.rank)], s.pp_boundary)
        else:
            lm = shard_lm(weights, s.variant, ctx.group, s.vocab_parallel, s.moe_parallel)
    load = meter.report(ctx, lm)
    agree(s, ctx, dense)
    dense = dense_oracle(s, ctx, dense)  # after the load: neither in its peak nor in its bytes read
    engine = Engine(lm, ctx, **s.engine_args(), on_iteration=Progress(len(s.requests)) if ctx.is_main else None)
    result = engine.run(s.requests)
    checks = oracle_check(dense, s, result, ctx) if s.check else None
    report = build_report(s, ctx, result, checks)
    if s.pp > 1:
        report["pp"] = stage_report(engine.engine)
    if ctx.is_main:
        add_text(report["requests"], s.hf_checkpoint)
    report["load"] = load
    embed = getattr(lm, "lm", lm).embed  # a pipeline stage's LM holds it inside (or not at all: a middle stage)
    report["embedding_bytes_per_rank"] = 0 if embed is None else embed.weight.numel() * embed.weight.element_size()
    report["lm_head_tied"] = s.model.family == "gpt2" or s.model.tie_word_embeddings  # Llama: mostly a separate head
    publish(report, render, out_dir / s.report, ctx)
    ok = (report["ledger_matches_model"] and report["kv_cache"]["matches_formula"]
          and report["check"]["ok"] in (True, None))
    return 0 if ok else 1


def serve_disaggregated(s: Settings, out_dir: Path, ctx) -> int:
    """P/D: prefill on ranks [0, p_P), decode on the rest; then the same requests through the colocated engine
    on the decode group, and (with check) the dense oracle. Rank 0 prints the TTFT parts and the transfer table."""
    meter = LoadMeter(s.weights)
    with meter:
        weights, dense = prepare(s, ctx)
    agree(s, ctx, dense)
    groups = new_groups(s.pd)
    requests = lambda: [Request(r.id, list(r.prompt), r.max_new_tokens, r.arrival) for r in s.requests]  # noqa: E731
    result = serve_pd(weights, ctx, s.pd, requests(), chunk_size=s.chunk_size, max_batched_tokens=s.max_batched_tokens,
                      max_running=s.max_running, eos_id=s.eos_id, variant=s.variant, vocab_parallel=s.vocab_parallel,
                      streaming=s.streaming, groups=groups, block_size=s.block_size, prefix_cache=s.prefix_cache,
                      attention=s.attention, timeout_s=s.pd_timeout_s, meter=meter, kv_blocks=s.kv_blocks,
                      decode_block_size=s.decode_block_size)
    load = meter.report(ctx, result.lm)
    dense = dense_oracle(s, ctx, dense)  # after the load: neither in its peak nor in its bytes read
    colocated = None
    if ctx.rank >= s.pd.prefill_ranks:  # the colocated engine on the decode group's p_D ranks
        dctx = context(groups[1], ctx.backend, ctx.device)
        lm = shard_lm(weights, s.variant, dctx.group, s.vocab_parallel)
        colocated = Engine(lm, dctx, **s.engine_args()).run(requests())
        colocated = [r["output_ids"] for r in colocated.requests]
    every = [None] * ctx.world_size
    dist.all_gather_object(every, colocated, group=ctx.group)
    colocated = every[s.pd.prefill_ranks]
    checks = oracle_check(dense, s, result, ctx) if s.check else None
    report = build_pd_report(s, ctx, result, colocated, checks)
    report["load"] = load
    publish(report, render_pd, out_dir / s.report, ctx)
    ok = report["ledger_matches_model"] and report["same_as_colocated"] and report["check"]["ok"] in (True, None)
    return 0 if ok else 1


def build_pd_report(s: Settings, ctx, result, colocated: list[list[int]], checks: list[dict] | None) -> dict:
    m, layout = s.model, s.pd
    elem = s.dtype.itemsize
    k_tok = kv_bytes_per_token(m.n_layers, m.n_kv_heads, m.d_head, s.dtype)  # the dense cache's bytes per token
    per_decode_rank = kv_bytes_per_token_per_rank(m.n_layers, m.n_kv_heads, m.d_head, layout.decode_ranks, elem)
    requests = result.requests
    for req, ids in zip(requests, colocated):
        req["same_as_colocated"] = req["output_ids"] == ids
    if checks is not None:
        for req, chk in zip(requests, checks):
            req["match"] = chk["verdict"]
    sends = [t for t in result.transfers if t["kind"] == "send" and t["site"] == "pd/kv"]
    recvs = [t for t in result.transfers if t["kind"] == "recv" and t["site"] == "pd/kv"]
    pairs: dict[tuple[int, int], dict] = {}
    for t in sends:
        pair = pairs.setdefault((t["rank"], t["peer"]), {"prefill_rank": t["rank"], "decode_rank": t["peer"],
                                                         "heads": t["heads"], "messages": 0, "bytes": 0})
        pair["messages"] += 1
        pair["bytes"] += t["bytes"]
    handed_tokens = sum(r["prompt_length"] for r in requests if r["transfer_s"] is not None)
    total = sum(t["bytes"] for t in sends)
    per_decode = {rank: sum(t["bytes"] for t in recvs if t["rank"] == rank)
                  for rank in range(layout.prefill_ranks, layout.world_size)}
    return {
        "world_size": ctx.world_size, "backend": ctx.backend, "device": str(ctx.device),
        "pd": {"prefill_ranks": layout.prefill_ranks, "decode_ranks": layout.decode_ranks,
               "prefill_pp": layout.prefill_pp, "streaming": s.streaming},
        "config": {"model_name": s.model_name, "model": m.asdict(), "requests": len(s.requests),
                   "chunk_size": s.chunk_size, "max_batched_tokens": s.max_batched_tokens, "variant": s.variant,
                   "vocab_parallel": s.vocab_parallel, "dtype": str(s.dtype).removeprefix("torch."),
                   "dtype_from": s.dtype_from, "seed": s.seed,
                   "block_size": s.block_size, "prefix_cache": s.prefix_cache,
                   "attention": choose(s.attention, ctx.device), "attention_setting": s.attention,
                   "shared_prefix": s.shared_prefix},
        "notes": list(s.notes),
        "kv_cache": {"block_size": s.block_size, "decode_block_size": s.decode_block_size or s.block_size,
                     "kv_blocks": s.kv_blocks,  # each side's pool; null: enough for its workload at its largest
                     "prefix_hit_tokens": sum(it["prefix_hit_tokens"] for it in result.prefill_iterations),
                     "peak_blocks_used": {side: max((it["blocks_used"] for it in its), default=0) for side, its in
                                          (("prefill", result.prefill_iterations),
                                           ("decode", result.decode_iterations))}},
        "totals": {"preemptions": sum(len(it["preempted"]) for it in
                                      result.prefill_iterations + result.decode_iterations)},
        "requests": requests,
        "transfer": {"pairs": sorted(pairs.values(), key=lambda x: (x["prefill_rank"], x["decode_rank"])),
                     "pair_count": len(pairs),
                     "pair_count_formula": layout.prefill_pp * pair_count(
                         m.n_kv_heads, layout.prefill_ranks // layout.prefill_pp, layout.decode_ranks),
                     "handed_over_tokens": handed_tokens, "kv_bytes_per_token": k_tok,
                     "kv_bytes_per_token_per_decode_rank": per_decode_rank,
                     # each decode rank receives its own cache share: K_tok in all unless decode ranks replicate
                     "total_bytes": total, "total_formula": handed_tokens * per_decode_rank * layout.decode_ranks,
                     "received_per_decode_rank": per_decode, "messages": len(result.transfers),
                     "agreements": result.agreements,
                     "agreement_bytes_per_rank": result.agreements * ring_bytes_per_rank(
                         "all_reduce", 1, layout.decode_ranks, 8)},
        "llama2_7b": llama_table(),
        "prefill_iterations": len(result.prefill_iterations), "decode_iterations": len(result.decode_iterations),
        "time_s": result.time_s,
        "ledger_matches_model": result.ledger_matches_model,
        "same_as_colocated": all(r["same_as_colocated"] for r in requests),
        "check": {"ok": None if checks is None else all(c["ok"] for c in checks),
                  "verdicts": None if checks is None else {v: sum(c["verdict"] == v for c in checks)
                                                           for v in ("match", "near-tie", "MISMATCH")}},
    }


def llama_table(prompt_tokens: int = 4096) -> dict:
    """seeds/06's transfer table from the same formula: Llama-2-7B's K_tok, a 4k prompt, the seeds' fabrics."""
    from tp.cost_model import FABRICS, LLAMA2_7B, kv_transfer_time

    return {"kv_bytes_per_token": LLAMA2_7B.kv_bytes_per_token, "prompt_tokens": prompt_tokens,
            "bytes": prompt_tokens * LLAMA2_7B.kv_bytes_per_token,
            "ms": {name: kv_transfer_time(LLAMA2_7B, prompt_tokens, bw) * 1e3 for name, bw in FABRICS.items()}}


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


def add_text(requests: list[dict], hf_checkpoint: str | None) -> None:
    """A checkpoint with tokenizer files: each request's generated ids decoded (requests[i].text); nothing otherwise."""
    from serve.llm import load_tokenizer

    tok = load_tokenizer(hf_checkpoint)
    if tok is not None:
        for req in requests:
            req["text"] = tok.decode(req["output_ids"], skip_special_tokens=True)


def build_report(s: Settings, ctx, result: ServeResult, checks: list[dict] | None) -> dict:
    m = s.model
    p = ctx.world_size // s.pp  # the TP group's size (a pipeline stage's)
    n_layers = len(stage_layers(m.n_layers, s.pp)[ctx.rank // p])  # the layers this rank caches: its stage's
    dense_per_token = kv_bytes_per_token(m.n_layers, m.n_kv_heads, m.d_head, s.dtype)
    requests = result.requests
    if checks is not None:
        for req, chk in zip(requests, checks):
            req["match"] = chk["verdict"]
            req["check"] = chk
    generated = sum(r["generated"] for r in requests)
    its = result.iterations
    return {
        "world_size": ctx.world_size, "tp": p, "backend": ctx.backend, "device": str(ctx.device),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "config": {"model_name": s.model_name, "model": m.asdict(), "hf_checkpoint": s.hf_checkpoint,
                   "requests": len(s.requests), "chunk_size": s.chunk_size,
                   "max_batched_tokens": s.max_batched_tokens, "max_running": s.max_running,
                   "eos_id": list(s.eos_id) if isinstance(s.eos_id, tuple) else s.eos_id, "eos_from": s.eos_from,
                   "variant": s.variant, "vocab_parallel": s.vocab_parallel,
                   "dtype": str(s.dtype).removeprefix("torch."), "dtype_from": s.dtype_from, "seed": s.seed,
                   "check": s.check,
                   "block_size": s.block_size, "kv_blocks": s.kv_blocks, "prefix_cache": s.prefix_cache,
                   "attention": choose(s.attention, ctx.device), "attention_setting": s.attention,
                   "shared_prefix": s.shared_prefix, "comm_timing": s.comm_timing, "pp": s.pp,
                   "pp_boundary": s.pp_boundary, "chunk_pipelining": s.chunk_pipelining,
                   "moe_parallel": s.moe_parallel if m.family == "mixtral" else None, "sampling": s.sampling},
        "notes": list(s.notes),
        "iterations": its,
        "requests": requests,
        "totals": {"iterations": len(its), "generated_tokens": generated, "time_s": result.time_s,
                   "tokens_per_s": generated / result.time_s if result.time_s else None,
                   "mixed_iterations": sum(1 for it in its if it["decodes"] and it["prefill_chunks"]),
                   "collectives": sum(sum(it["collectives"].values()) for it in its),
                   "bytes_per_rank": sum(it["bytes_per_rank"] for it in its),
                   "preemptions": result.preemptions, "rows_computed": result.rows_computed},
        "kv_cache": {"block_size": result.block_size, "blocks": result.kv_blocks,
                     "prefix_hit_tokens": result.prefix_hit_tokens, "peak_blocks_used": result.peak_blocks_used,
                     "pool_bytes_per_rank": result.kv_pool_bytes_per_rank,
                     "bytes_per_token_per_rank": result.kv_bytes_per_token_per_rank,
                     "formula_bytes_per_token_per_rank": kv_bytes_per_token_per_rank(n_layers, m.n_kv_heads,
                                                                                     m.d_head, p, s.dtype.itemsize),
                     "kv_heads_per_rank": kv_heads_per_rank(m.n_kv_heads, p), "n_kv_heads": m.n_kv_heads,
                     "bytes_per_token_dense": dense_per_token,
                     "ratio_to_dense": result.kv_bytes_per_token_per_rank / dense_per_token,
                     "peak_bytes_per_rank": result.kv_peak_bytes_per_rank,
                     # what the cache tensors held against the formula (no request admitted: nothing held)
                     "matches_formula": result.kv_bytes_per_token_per_rank in (0, kv_bytes_per_token_per_rank(
                         n_layers, m.n_kv_heads, m.d_head, p, s.dtype.itemsize))},
        "ledger_matches_model": result.ledger_matches_model,
        "check": {"ok": None if checks is None else all(c["ok"] for c in checks),
                  "verdicts": None if checks is None else {v: sum(c["verdict"] == v for c in checks)
                                                           for v in ("match", "near-tie", "MISMATCH")},
                  "max_logit_rel_err": None if checks is None else max(c["max_logit_rel_err"] for c in checks)},
    }


# The engine settings whose launcher default is the library's: conf/serve.yaml takes them from here, so each default
# is written once (serve/config.py). block_size: token positions per KV block; prefix_cache: share full blocks of
# identical prompt prefixes; attention: the attention backend (auto | cpu | batched | reference); comm_timing:
# per-collective times; chunk_pipelining: with pp > 1, a prompt's chunks may be in flight at once.
ENGINE_DEFAULTS = ("block_size", "prefix_cache", "attention", "comm_timing", "chunk_pipelining")
ConfigStore.instance().store(name="engine_defaults", node={k: getattr(EngineConfig, k) for k in ENGINE_DEFAULTS})


@hydra.main(version_base=None, config_path="../conf", config_name="serve")
def main(cfg: DictConfig) -> None:
    sys.exit(run(cfg))


if __name__ == "__main__":
    refuse_bad_arguments(sys.argv, env_world()[0], "serve")
    if env_world()[0] != 0:
        sys.argv.append("hydra.output_subdir=null")  # only rank 0 writes Hydra's .hydra/ record
    main()
