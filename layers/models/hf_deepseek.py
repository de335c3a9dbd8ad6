"""Import transformers DeepSeek-V3 weights (DeepseekV3ForCausalLM / DeepseekV3Model) into the dense DeepSeek stack or
LM (layers/models/mla.py). Nothing is transposed (nn.Linear [out, in], as ours).

    DeepseekV3DecoderLayer keys   input_layernorm.weight, post_attention_layernorm.weight,
        attention                 self_attn.q_proj.weight (q_lora_rank null) or self_attn.q_a_proj.weight,
                                  self_attn.q_a_layernorm.weight, self_attn.q_b_proj.weight; self_attn.kv_a_proj_with_mqa,
                                  self_attn.kv_a_layernorm, self_attn.kv_b_proj, self_attn.o_proj (.weight)
        dense FFN (layer < k)     mlp.gate_proj, mlp.up_proj, mlp.down_proj (.weight)
        DeepSeekMoE               mlp.gate.weight [E, d], mlp.gate.e_score_correction_bias [E],
                                  mlp.shared_experts.{gate,up,down}_proj.weight, and the routed experts:
            save_pretrained       mlp.experts.<j>.gate_proj.weight [f, d], .up_proj [f, d], .down_proj [d, f]
            transformers in memory  mlp.experts.gate_up_proj [E, 2f, d], mlp.experts.down_proj [E, d, f]

Ours stacks the experts as the second layout (layers/models/hf_mixtral.py does the same for Mixtral); from the first,
gate_up is the rows gate_0, up_0, gate_1, up_1, ... of its [E·2f, d] view. Rotary positions: default, or YaRN (V3's
own config.json: factor 40 over 4096 original positions), as transformers computes them. Refused by name: another
rope type, biases, another activation, a scoring function other than sigmoid; the multi-token-prediction layer is
ignored (as transformers does).
"""

from __future__ import annotations

import re

from layers.models import hf_llama
from layers.models.families import Family
from layers.models.hf import check_positive, load_lm  # noqa: F401  (the dense DeepSeek LM, as for every family)
from layers.models.mla import DeepseekConfig, DenseDeepseekBlock, TPDeepseekBlock, validate_deepseek
from tp.dist import ConfigError

_ATTENTION = {"attn_norm.weight": "input_layernorm.weight", "kv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
              "kv_norm.weight": "self_attn.kv_a_layernorm.weight", "kv_b.weight": "self_attn.kv_b_proj.weight",
              "o.weight": "self_attn.o_proj.weight", "mlp_norm.weight": "post_attention_layernorm.weight"}
_Q = {"q.weight": "self_attn.q_proj.weight"}
_Q_LORA = {"q_a.weight": "self_attn.q_a_proj.weight", "q_norm.weight": "self_attn.q_a_layernorm.weight",
           "q_b.weight": "self_attn.q_b_proj.weight"}


def config_from_hf(hf: dict) -> DeepseekConfig:
    """DeepseekConfig from a DeepSeek-V3 config.json; what the blocks do not implement is refused by name."""
    need = ("hidden_size", "num_attention_heads", "num_hidden_layers", "kv_lora_rank", "qk_rope_head_dim",
            "qk_nope_head_dim", "v_head_dim")
    missing = [k for k in need if k not in hf]
    if missing:
        raise ConfigError(f"not a DeepSeek-V3 config (no {', '.join(missing)})")
    check_positive(hf, need + ("intermediate_size", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok",
                               "n_group", "topk_group", "max_position_embeddings", "vocab_size", "q_lora_rank"))
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ConfigError(f"hidden_act={hf.get('hidden_act')!r} is not supported: the FFNs are SwiGLU (silu)")
    if hf.get("scoring_func", "sigmoid") != "sigmoid" or hf.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ConfigError(f"scoring_func={hf.get('scoring_func')!r} / topk_method={hf.get('topk_method')!r}: the "
                          f"router implements DeepSeek-V3's sigmoid scores with the correction bias (noaux_tc)")
    rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}  # 4.x rope_scaling, 5.x parameters
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise ConfigError(f"rope_type={rope_type!r} is not supported: the MLA blocks implement default and yarn "
                          f"rotary positions (DeepSeek-V3's)")
    yarn = {}
    if rope_type == "yarn":
        original = rope.get("original_max_position_embeddings")
        if not isinstance(original, int) or isinstance(original, bool) or original < 1:
            raise ConfigError(f"yarn needs original_max_position_embeddings (a positive integer), got {original!r}")
        factor = rope.get("factor") or hf.get("max_position_embeddings", original) / original
        yarn = dict(rope_type="yarn", rope_factor=float(factor), rope_original_max_position=original,
                    rope_beta_fast=float(rope.get("beta_fast") or 32), rope_beta_slow=float(rope.get("beta_slow") or 1),
                    rope_mscale=float(rope.get("mscale") or 0), rope_mscale_all_dim=float(rope.get("mscale_all_dim") or 0),
                    rope_attention_factor=float(rope.get("attention_factor") or 0),
                    rope_truncate=bool(rope.get("truncate", True)))
    if hf.get("attention_bias"):
        raise ConfigError("attention_bias=true is not supported: the MLA blocks have no biases")
    if hf.get("quantization_config"):
        method = (hf["quantization_config"] or {}).get("quant_method", "?")
        raise ConfigError(f"quantization_config (quant_method={method!r}) is not supported: the weights must be "
                          f"bfloat16, float16 or float32 (DeepSeek-V3's released FP8 weights need dequantizing first)")
    layers = hf["num_hidden_layers"]
    # a key config.json leaves out takes transformers' DeepseekV3Config default (save_pretrained writes them all)
    return DeepseekConfig(
        d_model=hf["hidden_size"], n_heads=hf["num_attention_heads"], q_lora_rank=hf.get("q_lora_rank", 1536) or 0,
        kv_lora_rank=hf["kv_lora_rank"], qk_rope_head_dim=hf["qk_rope_head_dim"],
        qk_nope_head_dim=hf["qk_nope_head_dim"], v_head_dim=hf["v_head_dim"],
        d_ffn=hf.get("intermediate_size", 18432), moe_d_ffn=hf.get("moe_intermediate_size", 2048),
        n_routed_experts=hf.get("n_routed_experts", 256), n_shared_experts=hf.get("n_shared_experts", 1) or 0,
        top_k=hf.get("num_experts_per_tok", 8), n_group=hf.get("n_group", 8) or 1, topk_group=hf.get("topk_group", 4) or 1,
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 2.5)),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        first_k_dense_replace=min(hf.get("first_k_dense_replace", 3) or 0, layers), n_layers=layers,
        max_seq_len=hf.get("max_position_embeddings", 4096), norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rope_interleave=bool(hf.get("rope_interleave", True)), vocab_size=hf.get("vocab_size", 129280),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)), **yarn)


def layer_keys(cfg: DeepseekConfig, state, prefix: str, i: int) -> dict[str, tuple[str, ...]]:
    at = f"{prefix}{i}."
    keys = {ours: (at + theirs,) for ours, theirs in {**_ATTENTION, **(_Q_LORA if cfg.q_lora_rank else _Q)}.items()}
    if not cfg.moe_layer(i):
        keys["gate_up"] = (at + "mlp.gate_proj.weight", at + "mlp.up_proj.weight")
        keys["down"] = (at + "mlp.down_proj.weight",)
        return keys
    keys["router"], keys["router_bias"] = (at + "mlp.gate.weight",), (at + "mlp.gate.e_score_correction_bias",)
    e = at + "mlp.experts."
    if f"{e}0.gate_proj.weight" in state:  # the files' layout (save_pretrained): one key per expert
        keys["gate_up"] = tuple(f"{e}{j}.{w}_proj.weight" for j in range(cfg.n_routed_experts) for w in ("gate", "up"))
        keys["down"] = tuple(f"{e}{j}.down_proj.weight" for j in range(cfg.n_routed_experts))
    else:
        keys["gate_up"], keys["down"] = (e + "gate_up_proj",), (e + "down_proj",)
    if cfg.n_shared_experts:
        s = at + "mlp.shared_experts."
        keys["shared_gate_up"] = (s + "gate_proj.weight", s + "up_proj.weight")
        keys["shared_down"] = (s + "down_proj.weight",)
    return keys


def experts_of(name: str, cfg: DeepseekConfig) -> int | None:
    """E for our stacked routed-expert parameters (blocks.<i>.gate_up / down of an MoE layer), None for the rest."""
    m = re.search(r"blocks\.(\d+)\.(gate_up|down)$", name)
    return cfg.n_routed_experts if m and cfg.moe_layer(int(m.group(1))) else None


def toy_config(s: dict, ids: dict):
    """transformers' DeepseekV3Config of the toy model (serve/toy_model.py): MLA with a query LoRA, one dense layer,
    then DeepSeekMoE (8 routed experts in 2 groups, top 2, one shared)."""
    import transformers

    dh = s["hidden"] // s["heads"]
    shape = {**hf_llama.toy_shape(s, ids), "num_key_value_heads": s["heads"]}
    return transformers.DeepseekV3Config(
        q_lora_rank=s["hidden"] // 2, kv_lora_rank=s["hidden"] // 4, qk_rope_head_dim=dh // 2, qk_nope_head_dim=dh,
        v_head_dim=dh, intermediate_size=s["hidden"] * 2, moe_intermediate_size=s["hidden"] // 2, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, **shape)


FAMILY = Family(
    "deepseek_v3", "DeepSeek-V3", DeepseekConfig, config_from_hf,
    names=lambda cfg, state, n_layers, lm: hf_llama.layout_names(cfg, state, n_layers, lm, layer_keys),
    expected_shapes=lambda cfg, state, lm: hf_llama.layout_shapes(cfg, state, lm, layer_keys, "DeepseekV3"),
    validate=validate_deepseek,
    dense_blocks=lambda cfg, dtype, device: [DenseDeepseekBlock(cfg, i, dtype, device) for i in range(cfg.n_layers)],
    tp_blocks=lambda cfg, variant, group, dtype, device, moe_parallel="tp", n_layers=None:
        [TPDeepseekBlock(cfg, i, group, moe_parallel, dtype, device) for i in range(cfg.n_layers)],
    variants=("v2",), moe=True, pipeline=False, experts_of=experts_of, toy=toy_config, block_check=False,
    kv_eviction=False, quantization=False,
    cache_layout=lambda cfg, p: (1, 1, cfg.latent_dim),  # MLA: one latent of c + r per token, whole on every rank
)
