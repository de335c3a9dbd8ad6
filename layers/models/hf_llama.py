"""Import transformers Llama weights (LlamaModel / LlamaForCausalLM) into the dense Llama stack or LM.

transformers' Llama linears are nn.Linear ([out, in], as ours), so nothing is transposed; gate_proj and
up_proj are stacked into our one gate_up weight (rows [gate | up]), which layers/models/llama.TPLlamaBlock cuts
column-parallel. Nothing is downloaded: a directory from `save_pretrained` is read by layers/models/hf.py.

    LlamaDecoderLayer keys  input_layernorm.weight, self_attn.{q,k,v,o}_proj.weight,
                            post_attention_layernorm.weight, mlp.{gate,up,down}_proj.weight
    LlamaModel keys         layers.<i>.<layer key>, embed_tokens.weight, norm.weight
    LlamaForCausalLM        model.<LlamaModel key>, lm_head.weight (not read when config.json ties it to
                            embed_tokens: tie_word_embeddings)
"""

from __future__ import annotations

import re

import torch

from layers.models.families import Family, of, same_blocks
from layers.models.hf import check_positive, load_lm, load_stack  # noqa: F401  (the dense stack or LM, from Llama's)
from layers.models.llama import DenseLlamaBlock, LlamaConfig, TPLlamaBlock, TPLlamaBlockSP, validate_llama
from tp.dist import ConfigError

# (our parameter, HF key(s)): gate_up is HF's gate_proj and up_proj, stacked
_BLOCK_KEYS = [
    ("attn_norm.weight", ("input_layernorm.weight",)), ("q.weight", ("self_attn.q_proj.weight",)),
    ("k.weight", ("self_attn.k_proj.weight",)), ("v.weight", ("self_attn.v_proj.weight",)),
    ("o.weight", ("self_attn.o_proj.weight",)), ("mlp_norm.weight", ("post_attention_layernorm.weight",)),
    ("gate_up.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight")), ("down.weight", ("mlp.down_proj.weight",)),
]


def config_from_hf(hf: dict) -> LlamaConfig:
    """LlamaConfig from a Llama config.json (transformers 4.x `rope_theta`/`rope_scaling` or 5.x `rope_parameters`).
    What the blocks do not implement is refused by name: another activation, rope scaling, biases."""
    missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size")
               if k not in hf]
    if missing:
        raise ConfigError(f"not a Llama config (no {', '.join(missing)})")
    check_positive(hf, ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
                        "intermediate_size", "max_position_embeddings", "vocab_size", "head_dim"))
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):  # transformers' names for the same function
        raise ConfigError(f"hidden_act={act!r} is not supported: the Llama block's gated MLP uses silu (SwiGLU)")
    rope = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if scaling or rope_type != "default":
        raise ConfigError(f"rope scaling is not supported (rope_scaling={scaling!r}, rope_type={rope_type!r}): "
                          f"the blocks implement plain rotary positions (rope_type default)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ConfigError(f"{key}=true is not supported: the Llama blocks have no biases")
    d, h = hf["hidden_size"], hf["num_attention_heads"]
    d_head = hf.get("head_dim") or (d // h if d % h == 0 else None)
    if d_head is None:
        raise ConfigError(f"hidden_size={d} is not divisible by num_attention_heads={h} and head_dim is not given")
    return LlamaConfig(d_model=d, n_heads=h, n_kv_heads=hf.get("num_key_value_heads") or h, d_head=d_head,
                       d_ffn=hf["intermediate_size"], n_layers=hf["num_hidden_layers"],
                       max_seq_len=hf.get("max_position_embeddings", 2048), norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                       rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
                       vocab_size=hf.get("vocab_size", 32000),
                       tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)))


def block_prefix(state) -> str:
    """'layers.' (LlamaModel) or 'model.layers.' (LlamaForCausalLM)."""
    for key in state:
        m = re.match(r"^(.*?)layers\.0\.input_layernorm\.weight$", key)
        if m:
            return m.group(1) + "layers."
    raise KeyError("no Llama layers found (expected keys like 'layers.0.input_layernorm.weight' or "
                   "'model.layers.0.input_layernorm.weight')")


# ---- Llama's checkpoint layout, which Mixtral, DeepSeek-V3 and Qwen3 share: only their layers' keys differ ----------


def layer_keys(cfg, state, prefix: str, i: int) -> dict[str, tuple[str, ...]]:
    """Layer i's parameters (ours) -> their checkpoint keys (gate_up: gate_proj's rows, then up_proj's)."""
    return {ours: tuple(f"{prefix}{i}.{key}" for key in theirs) for ours, theirs in _BLOCK_KEYS}


def _lm_keys(cfg, prefix: str) -> dict[str, str]:
    """The embedding, the final norm and (unless tied to the embedding) the head."""
    base = prefix.removesuffix("layers.")
    out = {"embed.weight": base + "embed_tokens.weight", "norm.weight": base + "norm.weight"}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = "lm_head.weight"
    return out


def layout_names(cfg, state, n_layers: int, lm: bool, keys=layer_keys) -> dict[str, tuple[tuple[str, ...], bool]]:
    """Our dense parameter (of a DenseLlamaLM when lm, else of a DenseStack) -> (its checkpoint keys, False), for a
    checkpoint in Llama's layout whose layer i holds keys(cfg, state, prefix, i); several keys are stacked along
    rows; nothing is transposed. A tied head has no key of its own."""
    prefix, base = block_prefix(state), "stack." if lm else ""
    out = {f"{base}blocks.{i}.{ours}": (theirs, False)
           for i in range(n_layers) for ours, theirs in keys(cfg, state, prefix, i).items()}
    if lm:
        out.update({ours: ((theirs,), False) for ours, theirs in _lm_keys(cfg, prefix).items()})
    return out


def layout_shapes(cfg, state, lm: bool, keys=layer_keys, model: str = "Llama") -> dict[str, tuple]:
    """Every checkpoint key the config needs, with its shape (from the family's blocks on the meta device: no memory).
    Where several keys fill one parameter they split its rows evenly: gate_up's gate_proj and up_proj, or the
    experts of an [E, rows, cols] stack saved one expert per key (their rows of the [E·rows, cols] view). model:
    transformers' name of the family's classes, for the message about a base model without a head."""
    try:
        prefix = block_prefix(state)
    except KeyError as exc:
        raise ConfigError(str(exc).strip("'\"")) from None
    out = {}
    for i, block in enumerate(of(cfg).dense_blocks(cfg, torch.float32, "meta")):
        for ours, theirs in keys(cfg, state, prefix, i).items():
            shape = tuple(block.get_parameter(ours).shape)
            if len(shape) == 3 and len(theirs) > 1:
                shape = (shape[0] * shape[1] // len(theirs), shape[2])
            elif len(theirs) > 1:
                shape = (shape[0] // len(theirs),) + shape[1:]
            out.update({key: shape for key in theirs})
    if lm:
        if not cfg.tie_word_embeddings and "lm_head.weight" not in state and not prefix.startswith("model."):
            raise ConfigError(f"a {model}Model checkpoint has no LM head: serving needs a {model}ForCausalLM "
                              f"directory")
        shapes = {"embed.weight": (cfg.vocab_size, cfg.d_model), "norm.weight": (cfg.d_model,),
                  "lm_head.weight": (cfg.vocab_size, cfg.d_model)}  # an untied head must be there
        out.update({theirs: shapes[ours] for ours, theirs in _lm_keys(cfg, prefix).items()})
    return out


def toy_shape(s: dict, ids: dict) -> dict:
    """transformers' config fields of a Llama-layout toy model (serve/toy_model.py) of sizes s, token ids ids."""
    return dict(hidden_size=s["hidden"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                num_hidden_layers=s["layers"], max_position_embeddings=s["context"], tie_word_embeddings=False, **ids)


def toy_config(s: dict, ids: dict):
    """transformers' LlamaConfig of the toy model (serve/toy_model.py)."""
    import transformers

    return transformers.LlamaConfig(intermediate_size=s["hidden"] * 8 // 3 // 8 * 8, **toy_shape(s, ids))


def hf_config(cfg: LlamaConfig, **ids):
    """transformers' LlamaConfig of this model (train/export.py)."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ffn, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.d_head,
        max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_word_embeddings, **ids)


FAMILY = Family(
    "llama", "Llama", LlamaConfig, config_from_hf, layout_names, layout_shapes,  # the layout's own: Llama's keys
    validate=lambda cfg, p, moe_parallel="tp": validate_llama(cfg, p),
    **same_blocks(DenseLlamaBlock, {"v2": TPLlamaBlock, "v2sp": TPLlamaBlockSP}),  # v2: the Megatron pattern
    context_parallel=True,
    toy=toy_config, hf_config=hf_config,
)
