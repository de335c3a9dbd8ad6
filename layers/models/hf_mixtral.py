"""Import transformers Mixtral weights (MixtralForCausalLM / MixtralModel) into the dense MoE stack or LM (layers/models/moe.py).

Attention, norms, embedding and head are Llama's (layers/models/hf_llama.py). The routed FFN comes in two layouts:

    files written by save_pretrained      block_sparse_moe.gate.weight [E, d], and per expert j
                                          block_sparse_moe.experts.<j>.w1 (gate) [f, d], .w3 (up) [f, d], .w2 (down) [d, f]
    transformers 5.x in memory            mlp.gate.weight [E, d], mlp.experts.gate_up_proj [E, 2f, d], .down_proj [E, d, f]

Ours is the second: gate_up [E, 2f, d] (each expert's gate rows, then its up rows) and down [E, d, f]. From the
first, gate_up is the rows w1_0, w3_0, w1_1, w3_1, ... of its [E·2f, d] view, down the rows w2_0, w2_1, ... of its
[E·d, f] view: a stack of rows, which the dense loader and the per-rank one (layers/models/hf.CheckpointSource) both
read.
"""

from __future__ import annotations

import dataclasses

from layers.models import hf_llama
from layers.models.families import Family
from layers.models.hf import check_positive
from layers.models.moe import HF_LAYER_KEYS, DenseMoEBlock, MoEConfig, moe_block, validate_moe
from tp.dist import ConfigError

STACKED = ("gate_up", "down")  # our [E, rows, cols] parameters


def config_from_hf(hf: dict) -> MoEConfig:
    """MoEConfig from a Mixtral config.json: Llama's fields (and refusals), num_local_experts, num_experts_per_tok."""
    check_positive(hf, ("num_local_experts", "num_experts_per_tok"), required=True)
    window, positions = hf.get("sliding_window"), hf.get("max_position_embeddings", 4096)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ConfigError(f"sliding_window={window!r} in config.json must be a positive integer or null")
    if window is not None and isinstance(positions, int) and window < positions:
        raise ConfigError(f"sliding_window={window} is not supported: the blocks attend to the whole prefix")
    llama = hf_llama.config_from_hf(hf)
    return MoEConfig(**dataclasses.asdict(llama), n_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"])


def layer_keys(cfg: MoEConfig, state, prefix: str, i: int) -> dict[str, tuple[str, ...]]:
    """Layer i's parameters (ours) -> their checkpoint keys, in either layout."""
    keys = {ours: (f"{prefix}{i}.{theirs}",) for ours, theirs in HF_LAYER_KEYS.items()}
    if f"{prefix}0.block_sparse_moe.gate.weight" in state:  # the files' layout (save_pretrained)
        moe = f"{prefix}{i}.block_sparse_moe."
        keys["router"] = (moe + "gate.weight",)
        keys["gate_up"] = tuple(f"{moe}experts.{j}.{w}.weight" for j in range(cfg.n_experts) for w in ("w1", "w3"))
        keys["down"] = tuple(f"{moe}experts.{j}.w2.weight" for j in range(cfg.n_experts))
    return keys


def experts_of(name: str, cfg: MoEConfig) -> int | None:
    """E for our stacked expert parameters (gate_up, down), None for the rest."""
    return cfg.n_experts if name.rsplit(".", 1)[-1] in STACKED else None


def tp_blocks(cfg: MoEConfig, variant: str, group, dtype, device, moe_parallel: str = "tp", n_layers=None) -> list:
    """Served MoE blocks: the experts split (tp) or whole per rank (ep); v2 attention."""
    if moe_parallel not in ("tp", "ep"):
        raise ValueError(f"serving runs moe_parallel tp or ep, not {moe_parallel!r}")
    return [moe_block(cfg, moe_parallel, group, dtype, device) for _ in range(n_layers or cfg.n_layers)]


def toy_config(s: dict, ids: dict):
    """transformers' MixtralConfig of the toy model (serve/toy_model.py)."""
    import transformers

    return transformers.MixtralConfig(intermediate_size=s["hidden"], num_local_experts=4, num_experts_per_tok=2,
                                      **hf_llama.toy_shape(s, ids))


FAMILY = Family(
    "mixtral", "Mixtral", MoEConfig, config_from_hf,
    names=lambda cfg, state, n_layers, lm: hf_llama.layout_names(cfg, state, n_layers, lm, layer_keys),
    expected_shapes=lambda cfg, state, lm: hf_llama.layout_shapes(cfg, state, lm, layer_keys, "Mixtral"),
    validate=lambda cfg, p, moe_parallel="tp": validate_moe(cfg, p, moe_parallel),
    dense_blocks=lambda cfg, dtype, device: [DenseMoEBlock(cfg, dtype, device) for _ in range(cfg.n_layers)],
    tp_blocks=tp_blocks, variants=("v2",), moe=True, pipeline=False, experts_of=experts_of, toy=toy_config,
    quantization=False,
)
