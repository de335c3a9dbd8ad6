"""The model families: one registry line each, and everything else asks here.

    family        its module (layers/models/)   what it is
    gpt2          hf_gpt2.py                    tp_block.py (v1, v2, intra_head, v2sp): LayerNorm, GeLU, learned positions
    llama         hf_llama.py                   llama.py: RoPE, GQA, SwiGLU, RMSNorm
    mixtral       hf_mixtral.py                 moe.py: Llama attention, routed SwiGLU experts (tp, ep, ep_a2a)
    deepseek_v3   hf_deepseek.py                mla.py: MLA, DeepSeekMoE (tp, ep)
    qwen3         qwen3.py                      Llama with an RMSNorm on each query and key head before RoPE

A family's module declares `FAMILY = Family(...)`: how to read its transformers config, its checkpoint key map, its
dense and TP blocks, the LM around them, its KV cache layout and what it can be run with (MoE placements, pipeline
stages, context parallelism). The family's name is cfg.family and config.json's model_type. Code outside the
family's module reads these fields (`of(cfg).moe`) instead of comparing names, so a family is added with its module
and one line of MODULES.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from tp.partition import kv_heads_per_rank  # plain Python: this registry imports no torch

MODULES = {  # the registry: family name -> the module that declares FAMILY
    "gpt2": "layers.models.hf_gpt2",
    "llama": "layers.models.hf_llama",
    "mixtral": "layers.models.hf_mixtral",
    "deepseek_v3": "layers.models.hf_deepseek",
    "qwen3": "layers.models.qwen3",
}
FAMILIES = tuple(MODULES)


def kv_heads_layout(cfg, p: int) -> tuple[int, int, int]:
    """(planes, heads, width) of a TP rank's cache: K and V of max(h_kv/p, 1) heads of d_head (multi-head attention:
    h_kv = h)."""
    return 2, kv_heads_per_rank(cfg.n_kv_heads, p), cfg.d_head


@dataclass(frozen=True)
class Family:
    """One model family: what the rest of the code needs to know of it."""

    name: str  # cfg.family, and model_type in config.json
    title: str  # as messages name it ("Llama")
    config: type  # its config dataclass (the presets in conf/model/ build it)
    # checkpoints (transformers' save_pretrained layout, read by layers/models/hf.py)
    config_from_hf: Callable  # (config.json's dict) -> config; ConfigError naming what is not built
    names: Callable  # (cfg, state, n_layers, lm) -> {our dense parameter: (its checkpoint keys, transposed?)}
    expected_shapes: Callable  # (cfg, state, lm) -> {checkpoint key: shape}, for the checks before any load
    # the model
    validate: Callable  # (cfg, p, moe_parallel="tp") -> None, or ConfigError naming what to change
    dense_blocks: Callable  # (cfg, dtype, device) -> the single-device model's L blocks
    tp_blocks: Callable  # (cfg, variant, group, dtype, device, moe_parallel, n_layers) -> this rank's blocks
    variants: tuple[str, ...]  # the tensor-parallel cuts its blocks are built in (layers/models/config.py)
    llama_lm: bool = True  # the LM around the blocks: Llama's (token embedding, RMSNorm, own or tied head), else GPT-2's
    cache_layout: Callable = kv_heads_layout  # (cfg, p) -> (planes, heads, width) of a TP rank's cache
    moe: bool = False  # routed experts: takes moe_parallel
    pipeline: bool = True  # can be cut into pipeline stages
    context_parallel: bool = False  # served with context_parallel_size > 1
    kv_eviction: bool = True  # served with kv_eviction (its attention reads the paged cache through the backends)
    quantization: bool = True  # served with quantization="int8" (every matmul weight is a column- or row-parallel
    #                            linear, or the LM head: layers/parallel/weight_format.py)
    block_check: bool = True  # launch/run_block.py checks its blocks (MLA's are checked by serving them)
    experts_of: Callable | None = None  # (our parameter, cfg) -> E where the files hold an [E, ...] stack per expert
    check_lm: Callable | None = None  # (state) -> None, or ConfigError: what a whole LM's checkpoint must also hold
    toy: Callable | None = None  # (sizes, token ids) -> transformers' config of serve/toy_model.py's model
    hf_config: Callable | None = None  # (cfg, **token ids) -> transformers' config of this model (train/export.py)


def family(name: str) -> Family:
    """The family of that name (ConfigError naming the families for another)."""
    if name not in MODULES:
        from tp.dist import ConfigError

        raise ConfigError(f"model.family={name!r}: choose {', '.join(FAMILIES)}")
    return importlib.import_module(MODULES[name]).FAMILY


def of(cfg) -> Family:
    """The family of a model config."""
    return family(cfg.family)


def same_blocks(dense: type, tp: dict[str, type]) -> dict:
    """dense_blocks, tp_blocks and variants for a family whose layers are all alike: one dense block class, one TP
    block class per variant (each built as cls(cfg, [group,] dtype, device))."""
    def dense_blocks(cfg, dtype, device) -> list:
        return [dense(cfg, dtype, device) for _ in range(cfg.n_layers)]

    def tp_blocks(cfg, variant: str, group, dtype, device, moe_parallel: str = "tp", n_layers: int | None = None):
        return [tp[variant](cfg, group, dtype, device) for _ in range(n_layers or cfg.n_layers)]

    return dict(dense_blocks=dense_blocks, tp_blocks=tp_blocks, variants=tuple(tp))


def config_class(name: str) -> type:
    return family(name).config


def validate(cfg, p: int, moe_parallel: str = "tp") -> None:
    """ConfigError naming what to change when cfg cannot run at tensor-parallel size p (with the MoE placement)."""
    fam = of(cfg)
    if not fam.moe and moe_parallel != "tp":
        from tp.dist import ConfigError

        raise ConfigError(f"moe_parallel={moe_parallel!r} is for MoE models; this model's FFN is dense")
    fam.validate(cfg, p, moe_parallel)
