"""The model families, in one table: each family's config class and what p (and an MoE placement) it needs.

    gpt2          layers/config.ModelConfig    layers/tp_block.py (v1, v2, intra_head, v2sp)
    llama         layers/llama.LlamaConfig     RoPE, GQA, SwiGLU
    mixtral       layers/moe.MoEConfig         Llama attention, routed SwiGLU experts (tp, ep, ep_a2a)
    deepseek_v3   layers/mla.DeepseekConfig    MLA, DeepSeekMoE (tp, ep)

Every entry point that turns settings or a preset into a model config, or checks it against a tensor-parallel size,
asks here, so a family is added in one place.
"""

from __future__ import annotations

FAMILIES = ("gpt2", "llama", "mixtral", "deepseek_v3")
MOE_FAMILIES = ("mixtral", "deepseek_v3")  # the ones that take moe_parallel


def config_class(family: str):
    from layers.config import ModelConfig
    from layers.llama import LlamaConfig
    from layers.mla import DeepseekConfig
    from layers.moe import MoEConfig
    from tp.dist import ConfigError

    classes = {"gpt2": ModelConfig, "llama": LlamaConfig, "mixtral": MoEConfig, "deepseek_v3": DeepseekConfig}
    if family not in classes:
        raise ConfigError(f"model.family={family!r}: choose {', '.join(FAMILIES)}")
    return classes[family]


def validate(cfg, p: int, moe_parallel: str = "tp") -> None:
    """ConfigError naming what to change when cfg cannot run at tensor-parallel size p (with the MoE placement)."""
    from layers.config import validate_model
    from layers.llama import validate_llama
    from layers.mla import validate_deepseek
    from layers.moe import validate_moe

    if cfg.family == "mixtral":
        validate_moe(cfg, p, moe_parallel)
    elif cfg.family == "deepseek_v3":
        validate_deepseek(cfg, p, moe_parallel)
    elif moe_parallel != "tp":
        from tp.dist import ConfigError

        raise ConfigError(f"moe_parallel={moe_parallel!r} is for MoE models; this model's FFN is dense")
    else:
        (validate_llama if cfg.family == "llama" else validate_model)(cfg, p)
