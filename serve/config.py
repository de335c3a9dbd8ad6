"""The engine's settings in one frozen object, each with its default written once and checked once.

    EngineConfig()                                   # the defaults
    EngineConfig.from_kwargs(max_num_seqs=8)         # vLLM's names are taken too (the table below)

    setting             vLLM's name               meaning
    chunk_size          long_prefill_token_threshold  most prompt rows one request gets in one iteration
    max_batched_tokens  max_num_batched_tokens    rows per iteration (decodes first, then prompt chunks)
    max_running         max_num_seqs              requests running at once
    block_size          block_size                token positions per KV block
    kv_blocks           num_gpu_blocks_override   blocks in each rank's pool (None: max_running requests at
                                                  the model's full context, so nothing is ever preempted)
    prefix_cache        enable_prefix_caching     share full blocks of identical prompt prefixes
    attention           -                         the attention backend (layers/attention_backends.py): auto
                                                  (cpu on a CPU, batched on CUDA) | cpu (one call per request,
                                                  nothing padded) | batched (one cache write and a few calls
                                                  per layer, as a GPU runs it) | reference (the readable loop)
    comm_timing         -                         per-collective wall times in the ledger (two waits each)
    check_ledger        -                         compare every iteration's collectives with the model
    reserve_capacity    -                         the pre-paging rule, kept to measure what paging frees: a
                                                  request takes blocks for its whole capacity when admitted
                                                  (needs prefix_cache off)
    chunk_pipelining    -                         pipeline stages (pp > 1): a prompt's next chunk may enter the
                                                  pipeline while its previous chunk is still in flight (off: a
                                                  request is in one micro-batch in flight at most, vLLM V1's rule)

Plain Python, no torch: the scheduler and the block manager read their defaults from here too (each default is
written once, here; tests/test_llm.py checks it). A bad value is a ValueError with one line that names the setting, raised where the object is made, before
any process starts or any collective runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

ATTENTION_MODES = ("auto", "cpu", "batched", "reference")  # layers/attention_backends.py: auto picks by device

from tp.partition import ceil_div

VLLM_NAMES = {"long_prefill_token_threshold": "chunk_size", "max_num_batched_tokens": "max_batched_tokens",
              "max_num_seqs": "max_running", "num_gpu_blocks_override": "kv_blocks",
              "enable_prefix_caching": "prefix_cache"}


@dataclass(frozen=True)
class EngineConfig:
    chunk_size: int = 256
    max_batched_tokens: int = 512
    max_running: int = 16
    block_size: int = 16
    kv_blocks: int | None = None
    prefix_cache: bool = True
    attention: str = "auto"
    comm_timing: bool = False
    check_ledger: bool = True
    reserve_capacity: bool = False
    chunk_pipelining: bool = False

    def __post_init__(self):
        for name in ("chunk_size", "max_batched_tokens", "max_running", "block_size", "kv_blocks"):
            v = getattr(self, name)
            if name == "kv_blocks" and v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be an integer of at least 1")
        for name in ("prefix_cache", "comm_timing", "check_ledger", "reserve_capacity", "chunk_pipelining"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        if self.attention not in ATTENTION_MODES:
            raise ValueError(f"attention={self.attention!r}: choose {', '.join(ATTENTION_MODES[:-1])} or "
                             f"{ATTENTION_MODES[-1]}")
        if self.reserve_capacity and self.prefix_cache:
            raise ValueError("reserve_capacity (the pre-paging rule) shares nothing: set prefix_cache=False")
        if self.max_running > self.max_batched_tokens:
            raise ValueError(f"max_batched_tokens={self.max_batched_tokens} is smaller than a full decode batch of "
                             f"max_running={self.max_running} requests (one row each per iteration); raise "
                             f"max_batched_tokens or lower max_running")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """Settings by our names or vLLM's (VLLM_NAMES); an unknown name is a ValueError listing the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        out = {}
        for key, value in kwargs.items():
            name = VLLM_NAMES.get(key, key)
            if name not in known:
                raise ValueError(f"unknown engine setting {key!r}; known: {', '.join(sorted(known | set(VLLM_NAMES)))}")
            if name in out:
                raise ValueError(f"{key!r} and {name!r} set the same thing: give one")
            out[name] = value
        try:
            return cls(**out)
        except ValueError as exc:  # say it with the name the caller used
            message = str(exc)
            for key in kwargs:
                if key in VLLM_NAMES:
                    message = message.replace(f"{VLLM_NAMES[key]}=", f"{key}=")
            raise ValueError(message) from None

    def pool_blocks(self, max_seq_len: int) -> int:
        """Blocks in each rank's pool: kv_blocks, or enough for max_running requests at the full context."""
        return self.kv_blocks or self.max_running * ceil_div(max_seq_len, self.block_size)


# The engine's settings as command-line flags (python -m serve, python -m serve.api): vLLM's flag names where vLLM has
# the setting, ours where it has not.
FLAGS = {"--block-size": "block_size", "--max-num-batched-tokens": "max_batched_tokens",
         "--max-num-seqs": "max_running", "--long-prefill-token-threshold": "chunk_size",
         "--num-gpu-blocks-override": "kv_blocks", "--enable-prefix-caching": "prefix_cache",
         "--attention": "attention"}


def add_engine_flags(parser) -> None:
    """Add the engine's flags to an argparse parser; each defaults to EngineConfig's own default."""
    import argparse

    group = parser.add_argument_group("engine settings (EngineConfig; vLLM's flag names)")
    for flag, name in FLAGS.items():
        default = getattr(EngineConfig, name)
        if name == "prefix_cache":
            group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=default,
                               help=f"{name} (default: on)")
        elif name == "attention":
            group.add_argument(flag, dest=name, choices=ATTENTION_MODES, default=default,
                               help=f"{name}: the attention backend (default: auto, cpu on a CPU device and batched "
                                    f"on CUDA)")
        else:
            aliases = ["--num-gpu-blocks"] if name == "kv_blocks" else []
            group.add_argument(flag, *aliases, dest=name, type=int, default=default, metavar="N",
                               help=f"{name} (default: "
                                    f"{'max-num-seqs requests at the full context' if default is None else default})")


def engine_from_flags(args) -> "EngineConfig":
    """The EngineConfig the parsed flags describe (ValueError, one line naming the flag, when a value is bad)."""
    values = {name: getattr(args, name) for name in FLAGS.values()}
    try:
        return EngineConfig(**values)
    except ValueError as exc:
        message = str(exc)
        for flag, name in FLAGS.items():
            message = message.replace(f"{name}=", f"{flag}=")
        raise ValueError(message) from None
