"""The engine's settings in one frozen object: each default written once, each rule checked once, vLLM's names.

    EngineConfig()                                   # the defaults
    EngineConfig(max_num_seqs=8, enable_prefix_caching=False)

Each field carries its meaning (`help`) and whether the command lines take it (`flag`): `python -m serve --help`
prints them, and the flags (FLAGS, add_engine_flags) are derived from the fields, so a new setting is described once.

Every entry point makes one EngineConfig and passes it whole: `LLM(**kwargs)` (its keyword arguments are these
fields), `python -m serve` and `python -m serve.api` (FLAGS: vLLM's flag names), launch/serve.py (Hydra's node
`engine_defaults` is made from this class, conf/serve.yaml changes what the demo changes), P/D and the benchmarks.
The scheduler and the block manager assert; the rules live here. A bad value is a ValueError with one line that
names the setting, raised where the object is made, before any process starts or any collective runs.

Plain Python, no torch.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from serve.eviction import KVEvictionConfig
from serve.kv_connector.config import KVTransferConfig
from serve.spec_decode import SpeculativeConfig
from tp.partition import ceil_div

KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2", "int8")  # layers/attention/kv_quant.py: model dtype, or one byte
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}  # vLLM's name: fp8 is e4m3 (as on CUDA)
ATTENTION_MODES = ("auto", "cpu", "batched", "reference", "flash")  # layers/attention/backends.py: auto by device
SCHEDULING_POLICIES = ("fcfs", "priority")  # serve/scheduler.py POLICIES
QUANTIZATIONS = (None, "int8")  # layers/parallel/weight_format.py: the weights as loaded, or weight-only int8
WEIGHT_LAYOUTS = ("auto", "out_in", "in_out")  # layers/parallel/weight_format.py: auto picks by device
COUNTS = ("long_prefill_token_threshold", "max_num_batched_tokens", "max_num_seqs", "block_size")
SWITCHES = ("enable_prefix_caching", "comm_timing", "check_ledger", "reserve_capacity", "chunk_pipelining",
            "calculate_kv_scales", "enforce_eager", "batch_invariant")


def setting(default, help: str, flag: bool = True, launcher: bool = True):
    """An EngineConfig field: its default, its meaning (the command lines' --help), whether `python -m serve` and
    `python -m serve.api` take it as a flag (vLLM's name, --max-num-seqs), and whether launch/serve.py takes it as a
    Hydra key (its own name, max_num_seqs=8). A None default's meaning says what None does; the others' defaults are
    shown beside it. The ranks must hold every field the same (serve/control.py settings_row digests them all)."""
    return dataclasses.field(default=default, metadata={"help": help, "flag": flag, "launcher": launcher})


@dataclass(frozen=True)
class EngineConfig:
    long_prefill_token_threshold: int = setting(256, "most prompt rows one request gets in one iteration (its chunk)")
    max_num_batched_tokens: int = setting(512, "rows per iteration (decodes first, then prompt chunks)")
    max_num_seqs: int = setting(16, "requests running at once (at most max_num_batched_tokens: one decode row each)")
    block_size: int = setting(16, "token positions per KV block")
    num_gpu_blocks_override: int | None = setting(
        None, "blocks in each rank's pool (default: the engine sizes it, max_num_seqs requests at the full context)")
    enable_prefix_caching: bool = setting(True, "share full blocks of identical prompt prefixes")
    attention: str = setting("auto", "the attention backend (layers/attention/backends.py): auto (cpu on a CPU, "
                             "batched on CUDA), cpu (one call per request, nothing padded), batched (one cache write "
                             "and a few calls per layer, as a GPU runs it), reference (the readable loop), flash "
                             "(FlashAttention-2's tiles and FlashDecoding's key chunks in plain PyTorch, "
                             "layers/attention/flash.py)")
    comm_timing: bool = setting(False, "per-collective wall times in the ledger (two waits each)", flag=False)
    check_ledger: bool = setting(True, "compare every iteration's collectives with the model (raise on a difference)",
                                 flag=False, launcher=False)  # the launcher records every step's comparison
    reserve_capacity: bool = setting(False, "the pre-paging rule, kept to measure what paging frees: a request takes "
                                     "blocks for its whole capacity when admitted (needs enable_prefix_caching off)",
                                     flag=False)
    chunk_pipelining: bool = setting(False, "pipeline stages (pp > 1): a prompt's next chunk may enter the pipeline "
                                     "while its previous chunk is in flight (off: one micro-batch in flight per "
                                     "request, vLLM V1's rule)", flag=False)
    # the launcher fits its prompts to the model's context itself
    max_model_len: int | None = setting(None, "vLLM's: a request's prompt + output tokens at most (default: the "
                                        "model's context; no more than it); the online pool is sized for "
                                        "max_num_seqs requests this long", launcher=False)
    kv_cache_dtype: str = setting("auto", "the KV cache's storage (layers/attention/kv_quant.py): auto (the model's "
                                  "dtype), or one byte per value with float32 scales per layer, K|V and head: "
                                  "fp8_e4m3 (vLLM's fp8), fp8_e5m2, int8")
    calculate_kv_scales: bool = setting(False, "a quantized cache's scales from the first prefill each layer sees "
                                        "(off, vLLM's default: 1.0; int8 needs them calculated)")
    # the launcher sizes its pool for its workload
    kv_cache_memory_bytes: int | None = setting(None, "each rank's pool at this many bytes, blocks = bytes // a "
                                                "block's bytes, which kv_cache_dtype halves against 16-bit values "
                                                "(default: off)", launcher=False)
    speculative_config: SpeculativeConfig | None = setting(
        None, "speculative decoding (serve/spec_decode.py), vLLM's JSON: '{\"method\": \"ngram\", "
              "\"num_speculative_tokens\": 3}' (default: off)", launcher=False)  # not in the launcher
    kv_eviction: KVEvictionConfig | None = setting(
        None, "KV cache eviction (serve/eviction.py): '{\"policy\": \"streaming\", \"sink_tokens\": 4, "
              "\"window_tokens\": 256}' keeps the first sink_tokens and the last window_tokens positions for each "
              "query and frees the blocks between (default: off)")
    quantization: str | None = setting(None, "vLLM's setting: the weights' storage (layers/parallel/weight_format.py):"
                                       " None (as loaded) or int8 (weight-only, per output channel of each rank's "
                                       "shard; activations, the KV cache and collectives keep the model's dtype)")
    weight_layout: str = setting("auto", "how each rank stores its float matmul weights (layers/parallel/"
                                 "weight_format.py): auto (per weight: row-major where decode's fused kernel reads it, "
                                 "else column-major on a CPU; row-major elsewhere), out_in (nn.Linear's row-major "
                                 "[out, in]) or in_out (the same [out, in] tensor stored column-major)")
    enforce_eager: bool = setting(False, "vLLM's: never compile (off: on a CPU, decode's matmuls of large weights, "
                                  "float and int8, run compiled fused kernels)")
    batch_invariant: bool = setting(False, "every request's logits bitwise the same whatever shares its steps, its "
                                    "chunking and its place in the batch (docs/flash.md): matmuls in fixed tiles of "
                                    "rows, attention by the flash backend's fixed padded tiles, nothing compiled; "
                                    "tensor_parallel_size 1 or 2")
    kv_transfer_config: KVTransferConfig | None = setting(
        None, "vLLM's KV connector (serve/kv_connector/): '{\"kv_connector\": \"OffloadingConnector\", \"kv_role\": "
              "\"kv_both\", \"kv_connector_extra_config\": {\"cpu_bytes\": N, \"disk_path\": DIR, \"disk_bytes\": M}}' "
              "spills blocks leaving the pool to a CPU tier, then a disk tier, and loads a prefix hit back from them "
              "(default: off)", launcher=False)
    scheduling_policy: str = setting("fcfs", "who is admitted first and preempted last (serve/scheduler.py): fcfs "
                                     "(first come, first served) or priority (each request's priority, lower first, "
                                     "ties by arrival; vLLM's)")

    def __post_init__(self):
        object.__setattr__(self, "speculative_config", SpeculativeConfig.of(self.speculative_config))
        object.__setattr__(self, "kv_eviction", KVEvictionConfig.of(self.kv_eviction))
        object.__setattr__(self, "kv_transfer_config", KVTransferConfig.of(self.kv_transfer_config))
        optional = ("num_gpu_blocks_override", "max_model_len", "kv_cache_memory_bytes")
        for name in COUNTS + optional:
            v = getattr(self, name)
            if name in optional and v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be an integer of at least 1")
        for name in SWITCHES:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be true or false")
        if self.attention not in ATTENTION_MODES:
            raise ValueError(f"attention={self.attention!r}: choose {', '.join(ATTENTION_MODES[:-1])} or "
                             f"{ATTENTION_MODES[-1]}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization={self.quantization!r}: choose None (null in the launcher: the weights as "
                             f"loaded) or "
                             f"{', '.join(repr(q) for q in QUANTIZATIONS if q)}")
        if self.weight_layout not in WEIGHT_LAYOUTS:
            raise ValueError(f"weight_layout={self.weight_layout!r}: choose {', '.join(WEIGHT_LAYOUTS)}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy={self.scheduling_policy!r}: choose {' or '.join(SCHEDULING_POLICIES)}")
        object.__setattr__(self, "kv_cache_dtype", KV_CACHE_DTYPE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype))
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r}: choose {', '.join(KV_CACHE_DTYPES)}")
        if self.kv_cache_dtype == "int8" and not self.calculate_kv_scales:
            raise ValueError("kv_cache_dtype='int8' needs calculate_kv_scales=True: at scale 1.0 (vLLM's default "
                             "without calculated scales) every value would be stored as an integer; let the scales "
                             "be calculated")
        if self.num_gpu_blocks_override is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError("num_gpu_blocks_override and kv_cache_memory_bytes both size the pool: give one")
        if self.reserve_capacity and self.enable_prefix_caching:
            raise ValueError("reserve_capacity (the pre-paging rule) shares nothing: set enable_prefix_caching=False")
        if self.kv_eviction is not None:
            self.kv_eviction.check(self.block_size)
            if self.speculative_config is not None:
                raise ValueError("kv_eviction with speculative_config is not built: a verified chunk's rejected rows "
                                 "would move the window back; use one or the other")
            if self.reserve_capacity:
                raise ValueError("kv_eviction with reserve_capacity (the pre-paging rule) frees nothing the rule "
                                 "reserved: use one or the other")
        if self.kv_transfer_config is not None:
            self.check_connector()
        if self.batch_invariant:
            self.check_batch_invariant()
        if self.max_num_seqs > self.max_num_batched_tokens:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} is smaller than a full decode "
                             f"batch of max_num_seqs={self.max_num_seqs} requests (one row each per iteration); raise "
                             f"max_num_batched_tokens or lower max_num_seqs")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """`LLM(**kwargs)`'s engine settings: an unknown name is a ValueError listing the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine setting {unknown[0]!r}; known: {', '.join(sorted(known))}")
        return cls(**kwargs)

    def record(self) -> dict:
        """Every field by its own name, as JSON holds it (a report's record of what ran)."""
        return {f.name: dataclasses.asdict(v) if dataclasses.is_dataclass(v := getattr(self, f.name)) else v
                for f in dataclasses.fields(self)}

    def peak_blocks(self) -> int | None:
        """Under kv_eviction, the most blocks one request holds at once (serve/eviction.py peak_blocks, with one
        iteration's rows at most); None without eviction (a request holds its whole length)."""
        if self.kv_eviction is None:
            return None
        return self.kv_eviction.peak_blocks(self.block_size, min(self.long_prefill_token_threshold,
                                                                 self.max_num_batched_tokens))

    def check_batch_invariant(self, tp: int = 1) -> None:
        """The rules of batch_invariant: what it fixes (attention, matmuls) must not be replaced by a path it does not
        fix; tp: the tensor-parallel size (a ring all-reduce over more than two ranks sums each element in an order
        set by its place in the buffer, so by the batch)."""
        name = "batch_invariant=True"
        if self.attention not in ("auto", "flash"):
            raise ValueError(f"{name} attends with the flash backend's fixed tiles: leave attention at auto or flash, "
                             f"not {self.attention!r}")
        for setting, value, why in (("quantization", self.quantization, "int8's kernels"),
                                    ("speculative_config", self.speculative_config, "verified rows"),
                                    ("kv_eviction", self.kv_eviction, "eviction's masks"),
                                    ("kv_cache_dtype", None if self.kv_cache_dtype == "auto" else self.kv_cache_dtype,
                                     "a quantized cache")):
            if value is not None:
                raise ValueError(f"{name} with {setting} is not built ({why} are not made invariant): use one or the "
                                 f"other")
        if tp > 2:
            raise ValueError(f"{name} at tensor_parallel_size={tp} is not built: a ring all-reduce over more than two "
                             f"ranks sums each element in an order set by its place in the buffer (so by the batch); "
                             f"use 1 or 2")

    def check_connector(self) -> None:
        """The rules between kv_transfer_config and the other settings: the tiers are keyed by the prefix cache's
        names, and hold whole blocks of the model's dtype."""
        if self.kv_transfer_config.kv_connector != "OffloadingConnector":  # P/D's: serve/pd/run.py checks its rules
            return
        name = f"kv_transfer_config kv_connector={self.kv_transfer_config.kv_connector!r}"
        if not self.enable_prefix_caching:
            raise ValueError(f"{name} keys its tiers by the prefix cache's block hashes: set "
                             f"enable_prefix_caching=True")
        if self.kv_eviction is not None:
            raise ValueError(f"{name} with kv_eviction is not built (an evicted block has no whole copy to spill): "
                             f"use one or the other")
        if self.kv_cache_dtype != "auto":
            raise ValueError(f"{name} with kv_cache_dtype={self.kv_cache_dtype!r} is not built: the tiers hold the "
                             f"model's dtype; use kv_cache_dtype='auto'")
        spec = self.speculative_config
        if spec is not None and spec.method == "draft_model":
            raise ValueError(f"{name} with a draft model is not built (the draft's own cache is not spilled): use "
                             f"method 'ngram' or no speculative_config")

    def check_pipeline(self, pp: int) -> None:
        """The rule between these settings and the pipeline's size."""
        if pp == 1 and self.chunk_pipelining:
            raise ValueError("chunk_pipelining=True is for a pipeline: set pipeline_parallel_size (pp) > 1")
        if pp > 1 and self.kv_cache_memory_bytes is not None:  # stages of unequal layers would size unequal pools
            raise ValueError("kv_cache_memory_bytes with pipeline stages (pp > 1) is not built: size the pool with "
                             "num_gpu_blocks_override")
        if pp > 1 and self.speculative_config is not None:
            raise ValueError("speculative_config with pipeline stages (pp > 1) is not built yet: use pp = 1")
        if pp > 1 and self.kv_eviction is not None:
            raise ValueError("kv_eviction with pipeline stages (pp > 1) is not built: use pp = 1")
        if pp > 1 and self.batch_invariant:
            raise ValueError("batch_invariant with pipeline stages (pp > 1) is not built: use pp = 1")
        if pp > 1 and self.kv_transfer_config is not None:
            raise ValueError("kv_transfer_config with pipeline stages (pp > 1) is not built: use pp = 1")

    def check_context_parallel(self, cp: int, pp: int = 1, name: str = "context_parallel_size") -> None:
        """The rules between these settings and context parallelism's size
        (layers/attention/context_parallel.SplitCacheBackend), one ValueError each, naming what to change; name: the
        setting as the caller spells it (the launcher's cp)."""
        if cp == 1:
            return
        if pp > 1:
            raise ValueError(f"{name}={cp} with pipeline_parallel_size > 1 is not built: use context parallelism or "
                             f"pipeline stages, not both")
        if self.speculative_config is not None:
            raise ValueError(f"{name}={cp} with speculative decoding is not built: drop speculative_config or use "
                             f"{name}=1")
        if self.batch_invariant:
            raise ValueError(f"{name}={cp} with batch_invariant is not built: use {name}=1")
        if self.kv_transfer_config is not None:
            raise ValueError(f"{name}={cp} with kv_transfer_config is not built (each cp rank holds part of every "
                             f"block): drop kv_transfer_config or use {name}=1")
        if self.kv_eviction is not None:
            raise ValueError(f"{name}={cp} with kv_eviction is not built (each cp rank holds part of every block): "
                             f"drop kv_eviction or use {name}=1")
        if self.block_size % cp:
            low, high = cp * (self.block_size // cp), cp * ceil_div(self.block_size, cp)
            advice = " or ".join(f"block_size={b}" for b in (low, high) if b > 0)
            raise ValueError(f"{name}={cp} needs a block_size that is a multiple of {cp} (each cp rank keeps "
                             f"block_size/{cp} positions of every block): block_size={self.block_size}, not a multiple "
                             f"of {cp}; use {advice}")

    def check_model_len(self, max_seq_len: int) -> None:
        """max_model_len against the model's context (max_seq_len positions)."""
        if self.max_model_len is not None and self.max_model_len > max_seq_len:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the {max_seq_len} positions the model has "
                             f"(its context); leave it unset or lower it")

    def pool_blocks(self, max_seq_len: int, capacities: list[int] | None = None, block_bytes: int | None = None) -> int:
        """Blocks in each rank's pool: num_gpu_blocks_override; kv_cache_memory_bytes // block_bytes (a block's
        bytes on this rank, which the caller knows: serve/kv_cache.KVPool.block_bytes); else the engine sizes it so
        that nothing is ever preempted: for a workload known up front (capacities: each request's largest number of
        cached positions, serve/offline.py), every request at its largest at once; online, max_num_seqs requests
        at the full context (max_model_len where it is set)."""
        if self.num_gpu_blocks_override is not None:
            return self.num_gpu_blocks_override
        if self.kv_cache_memory_bytes is not None:
            if block_bytes is None:
                raise ValueError("kv_cache_memory_bytes sizes the pool from a block's bytes, which only the ranks know")
            if self.kv_cache_memory_bytes < block_bytes:
                raise ValueError(f"kv_cache_memory_bytes={self.kv_cache_memory_bytes} holds no block of "
                                 f"{block_bytes} bytes (block_size={self.block_size} positions on this rank)")
            return self.kv_cache_memory_bytes // block_bytes
        if capacities is not None:
            return max(1, sum(ceil_div(n, self.block_size) for n in capacities))
        return self.max_num_seqs * ceil_div(min(max_seq_len, self.max_model_len or max_seq_len), self.block_size)


def fits_alone(positions: int, num_blocks: int, block_size: int, block_bytes: int | None = None,
               peak: int | None = None) -> str | None:
    """The rule "a request fits the pool alone": None when `positions` cached positions fit in num_blocks blocks of
    block_size, else the one-line reason (every caller raises its own error type with it). block_bytes: a block's
    bytes on a rank, where kv_cache_memory_bytes sized the pool (the advice is then about it). peak: the most blocks
    a request holds at once under kv_eviction (EngineConfig.peak_blocks), whatever its length."""
    need = ceil_div(positions, block_size) if peak is None else min(peak, ceil_div(positions, block_size))
    if need <= num_blocks:
        return None
    if peak is not None and need == peak:
        return (f"kv_eviction holds up to {peak} KV blocks of block_size={block_size} per request, more than the "
                f"pool's {num_blocks}; raise the pool or lower the eviction's budget")
    if block_bytes is not None:
        return (f"{positions} positions need {need} KV blocks of block_size={block_size}, more than the "
                f"{num_blocks} that kv_cache_memory_bytes holds; raise kv_cache_memory_bytes to at least "
                f"{need * block_bytes}")
    return (f"{positions} positions need {need} KV blocks of block_size={block_size}, more than the pool's "
            f"num_gpu_blocks_override={num_blocks}; raise num_gpu_blocks_override to at least {need}")


# The engine's settings as command-line flags (python -m serve, python -m serve.api): vLLM's flag names, the fields
# that say flag=True.
FLAGS = {"--" + f.name.replace("_", "-"): f.name for f in dataclasses.fields(EngineConfig) if f.metadata["flag"]}


class FlagParser(argparse.ArgumentParser):
    """argparse's parser for the command lines (python -m serve, python -m serve.api, python -m serve.toy_model):
    an error is one line naming the flag, without the usage text (--help prints that)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# LLM's own settings (not EngineConfig's), flags of both command lines: (flag, LLM's keyword, argparse's options).
LLM_FLAGS = (
    ("--tensor-parallel-size", "tensor_parallel_size", dict(type=int, default=1)),
    ("--pipeline-parallel-size", "pipeline_parallel_size", dict(type=int, default=1,
                                                                help="pipeline stages (pp x tp ranks)")),
    ("--context-parallel-size", "context_parallel_size", dict(
        type=int, default=1, help="cp ranks per TP rank (cp x tp ranks), each keeping 1/cp of every request's K,V")),
    ("--data-parallel-size", "data_parallel_size", dict(
        type=int, default=1, help="replicas of the whole (each tp x pp x cp ranks and its own KV pool) behind one "
                                  "engine, a router choosing each request's (serve/router.py)")),
    ("--router-policy", "router_policy", dict(
        default="cache_aware", choices=("cache_aware", "round_robin"),
        help="with --data-parallel-size > 1: cache_aware (SGLang's: the longest prefix a replica was sent, balanced "
             "by load) or round_robin")),
    ("--tokenizer", "tokenizer", dict(help="a directory with tokenizer files (default: the model's)")),
    ("--dtype", "dtype", dict(default="auto", help="auto (the checkpoint's torch_dtype, else float32) or a dtype")),
    ("--device", "device", dict(default="auto", help="auto | cpu | cuda")),
    ("--moe-parallel", "moe_parallel", dict(default="tp", help="tp | ep | ep_a2a (MoE checkpoints)")),
    ("--threads-per-rank", "threads_per_rank", dict(
        type=int, default=None, metavar="N", help="each rank's intra-op threads (default: the cores this process "
                                                  "may use, one left to the driver, shared among the ranks; or "
                                                  "OMP_NUM_THREADS)")),
)


def add_llm_flags(parser, model_help: str) -> None:
    """--model and LLM's own settings (LLM_FLAGS), each defaulting to LLM's default."""
    parser.add_argument("--model", required=True, help=model_help)
    for flag, _, options in LLM_FLAGS:
        parser.add_argument(flag, **options)


def llm_settings(args, config: "EngineConfig") -> dict:
    """LLM's keyword arguments from the parsed flags: LLM_FLAGS', and config's (engine_from_flags) fields."""
    return {name: getattr(args, name) for _, name, _ in LLM_FLAGS} | dataclasses.asdict(config)


JSON_SETTINGS = ("speculative_config", "kv_eviction", "kv_transfer_config")  # flags that take a JSON object
CHOICES = {"attention": ATTENTION_MODES, "kv_cache_dtype": KV_CACHE_DTYPES + tuple(KV_CACHE_DTYPE_ALIASES),
           "scheduling_policy": SCHEDULING_POLICIES, "quantization": tuple(q for q in QUANTIZATIONS if q),
           "weight_layout": WEIGHT_LAYOUTS}


def add_engine_flags(parser) -> None:
    """Add the engine's flags to an argparse parser, each from its field: its default, its help, its type (a switch:
    --x / --no-x; a name among CHOICES; speculative_config: JSON; a count: N)."""
    group = parser.add_argument_group("engine settings (EngineConfig; vLLM's flag names)")
    for f in dataclasses.fields(EngineConfig):
        if not f.metadata["flag"]:
            continue
        flag, name, default = "--" + f.name.replace("_", "-"), f.name, f.default
        shown = "" if default is None else f" (default: {default})" if not isinstance(default, bool) else \
            f" (default: {'on' if default else 'off'})"
        kind = ({"action": argparse.BooleanOptionalAction} if isinstance(default, bool) else
                {"choices": CHOICES[name]} if name in CHOICES else
                {"type": _json_object, "metavar": "JSON"} if name in JSON_SETTINGS else
                {"type": int, "metavar": "N"})
        aliases = ["--num-gpu-blocks"] if name == "num_gpu_blocks_override" else []
        group.add_argument(flag, *aliases, dest=name, default=default, help=f.metadata["help"] + shown, **kind)


def _json_object(text: str) -> dict:
    import argparse
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is expected, like '{{\"method\": \"ngram\"}}', not {text!r}")
    return value


def engine_from_flags(args) -> "EngineConfig":
    """The EngineConfig the parsed flags describe (ValueError, one line naming the flag, when a value is bad)."""
    values = {name: getattr(args, name) for name in FLAGS.values()}
    try:
        return EngineConfig(**values)
    except ValueError as exc:
        raise ValueError(flag_names(str(exc))) from None


def flag_names(message: str) -> str:
    """An engine setting's error as the command line says it: max_num_seqs=0 -> --max-num-seqs=0."""
    names = [*FLAGS.values(), "tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size",
             "data_parallel_size", "router_policy", "threads_per_rank"]  # LLM's own settings, flags of both command lines too
    for name in names:
        flag = "--" + name.replace("_", "-")
        message = message.replace(f"{name}=", f"{flag}=").replace(f"{name} ", f"{flag} ")
    return message
