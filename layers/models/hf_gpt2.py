"""Import Hugging Face GPT-2 weights into the dense stack (then shard as usual).

transformers' GPT-2 stores its linears as `Conv1D` with weight [in, out] (y = x·W + b),
nn.Linear stores [out, in]: every weight is transposed on the way in. The fused
`attn.c_attn` keeps GPT-2's [Q | K | V] column layout, which is the layout
layers/parallel/shard.py cuts head-aligned. Works on a plain state dict: transformers itself
is needed only to make one (pip install -e .[hf]); nothing is downloaded here. A directory from
`save_pretrained` is read by layers/models/hf.py, which also imports Llama checkpoints (layers/models/hf_llama.py).

    GPT2Block keys        ln_1.weight, attn.c_attn.weight, attn.c_proj.weight, mlp.c_fc.weight, ...
    GPT2Model keys        h.<i>.<block key>, wte.weight, wpe.weight, ln_f.weight, ln_f.bias
    GPT2LMHeadModel       transformer.<GPT2Model key>, lm_head.weight (tied to wte: the same tensor)
"""

from __future__ import annotations

import re

import torch

from layers.models.config import ModelConfig, validate_model
from layers.models.dense import DenseBlock
from layers.models.families import Family, same_blocks
from layers.models.hf import check_positive, load_lm, load_named, load_stack  # noqa: F401  (as for every family)
from layers.models.lm import DenseLM
from layers.models.tp_block import TPBlockIntraHead, TPBlockV1, TPBlockV2, TPBlockV2SP
from tp.dist import ConfigError

# (our parameter, HF key, transpose?)
_BLOCK_KEYS = [
    ("ln_1.weight", "ln_1.weight", False), ("ln_1.bias", "ln_1.bias", False),
    ("qkv.weight", "attn.c_attn.weight", True), ("qkv.bias", "attn.c_attn.bias", False),
    ("attn_out.weight", "attn.c_proj.weight", True), ("attn_out.bias", "attn.c_proj.bias", False),
    ("ln_2.weight", "ln_2.weight", False), ("ln_2.bias", "ln_2.bias", False),
    ("mlp_up.weight", "mlp.c_fc.weight", True), ("mlp_up.bias", "mlp.c_fc.bias", False),
    ("mlp_down.weight", "mlp.c_proj.weight", True), ("mlp_down.bias", "mlp.c_proj.bias", False),
]


def config_from_hf(hf: dict) -> ModelConfig:
    """ModelConfig from a GPT-2 config (config.json's dict, or transformers' GPT2Config.to_dict())."""
    if not isinstance(hf, dict):
        raise ConfigError(f"a GPT-2 config must be a JSON object, got {type(hf).__name__}")
    kind = hf.get("model_type", "gpt2")
    missing = [k for k in ("n_embd", "n_head", "n_layer") if k not in hf]
    if kind != "gpt2" or missing:
        raise ConfigError(f"not a GPT-2 config (model_type={kind!r}"
                          + (f", no {', '.join(missing)}" if missing else "") + "): only GPT-2 checkpoints are supported")
    check_positive(hf, ("n_embd", "n_head", "n_layer", "n_positions", "vocab_size", "n_inner"))
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ConfigError(f"GPT-2 activation {act!r} is not supported: the block uses the tanh GeLU (gelu_new)")
    d, h = hf["n_embd"], hf["n_head"]
    if d % h:
        raise ConfigError(f"n_embd={d} is not divisible by n_head={h}")
    return ModelConfig(d_model=d, n_heads=h, d_head=d // h, d_ffn=hf.get("n_inner") or 4 * d,
                       n_layers=hf["n_layer"], max_seq_len=hf.get("n_positions", 1024),
                       ln_eps=hf.get("layer_norm_epsilon", 1e-5), vocab_size=hf.get("vocab_size", 50257))


def _block_prefix(state) -> str:
    for key in state:
        m = re.match(r"^(.*?)h\.0\.ln_1\.weight$", key)
        if m:
            return m.group(1) + "h."
    raise KeyError("no GPT-2 blocks found (expected keys like 'h.0.ln_1.weight' or 'transformer.h.0.ln_1.weight')")


def names(cfg: ModelConfig, state, n_layers: int, lm: bool) -> dict[str, tuple[tuple[str, ...], bool]]:
    """Our dense parameter (of a DenseLM when lm, else of a DenseStack) -> (its checkpoint key, transposed?)."""
    prefix, base = _block_prefix(state), "stack." if lm else ""
    out = {f"{base}blocks.{i}.{ours}": ((f"{prefix}{i}.{theirs}",), transpose)
           for i in range(n_layers) for ours, theirs, transpose in _BLOCK_KEYS}
    if lm:
        top = prefix.removesuffix("h.")
        out.update({name: ((top + name,), False) for name in ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias")})
    return out


def check_tied(state, chunk_rows: int = 4096) -> None:
    """GPT-2's head is its token embedding: a checkpoint's lm_head.weight (the .bin format saves it) must equal
    wte.weight. Compared in chunks of rows, so a lazily read checkpoint never holds either whole."""
    if "lm_head.weight" not in state:
        return
    wte = _block_prefix(state).removesuffix("h.") + "wte.weight"
    if wte not in state:
        return  # check_state names the missing embedding
    shape = state.shapes[wte] if hasattr(state, "shapes") else tuple(state[wte].shape)
    head = state.shapes["lm_head.weight"] if hasattr(state, "shapes") else tuple(state["lm_head.weight"].shape)
    if head != shape:
        raise ConfigError(f"lm_head.weight has shape {head}, wte.weight {shape}: only GPT-2's tied LM head is supported")
    for a in range(0, shape[0], chunk_rows):
        b = min(a + chunk_rows, shape[0])
        if not torch.equal(*(rows_of(state, key, a, b) for key in ("lm_head.weight", wte))):
            raise ConfigError("lm_head.weight differs from wte.weight: only GPT-2's tied LM head is supported")


def rows_of(state, key: str, a: int, b: int) -> torch.Tensor:
    """Rows [a, b) of a checkpoint tensor (read only those from a lazily read checkpoint)."""
    if not hasattr(state, "fill"):
        return state[key][a:b]
    out = torch.empty((b - a,) + state.shapes[key][1:], dtype=state.dtypes[key])
    state.fill(out, key, 0, ((a, b),))
    return out


def expected_shapes(cfg: ModelConfig, state: dict[str, torch.Tensor], lm: bool) -> dict[str, tuple]:
    """Every checkpoint key the config needs, with its shape (from meta-device modules: no memory); lm=True adds
    wte, wpe and ln_f."""
    try:
        prefix = _block_prefix(state)
    except KeyError as exc:
        raise ConfigError(str(exc).strip("'\"")) from None
    block = DenseBlock(cfg, device="meta")
    expected = {f"{prefix}{i}.{theirs}": tuple(block.get_parameter(ours).shape)[::-1 if transpose else 1]
                for i in range(cfg.n_layers) for ours, theirs, transpose in _BLOCK_KEYS}
    if lm:
        model = DenseLM(cfg, device="meta")
        expected.update({prefix.removesuffix("h.") + name: tuple(model.get_parameter(name).shape)
                         for name in ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias")})
    return expected


def toy_config(s: dict, ids: dict):
    """transformers' GPT2Config of the toy model (serve/toy_model.py)."""
    import transformers

    return transformers.GPT2Config(n_embd=s["hidden"], n_head=s["heads"], n_layer=s["layers"], n_positions=s["context"],
                                   **ids)


def hf_config(cfg: ModelConfig, **ids):
    """transformers' GPT2Config of this model (its tanh GeLU is gelu_new; the head tied to the token embedding)."""
    import transformers

    if cfg.d_head * cfg.n_heads != cfg.d_model:
        raise ConfigError(f"d_head={cfg.d_head} x n_heads={cfg.n_heads} != d_model={cfg.d_model}: transformers' GPT-2 "
                          f"has d_head = d_model / n_heads")
    return transformers.GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.max_seq_len, n_embd=cfg.d_model,
                                   n_layer=cfg.n_layers, n_head=cfg.n_heads, n_inner=cfg.d_ffn,
                                   layer_norm_epsilon=cfg.ln_eps, activation_function="gelu_new", **ids)


FAMILY = Family(
    "gpt2", "GPT-2", ModelConfig, config_from_hf, names, expected_shapes,
    validate=lambda cfg, p, moe_parallel="tp": validate_model(cfg, p),
    **same_blocks(DenseBlock, {"v1": TPBlockV1, "v2": TPBlockV2, "intra_head": TPBlockIntraHead, "v2sp": TPBlockV2SP}),
    llama_lm=False, context_parallel=True, check_lm=check_tied, toy=toy_config, hf_config=hf_config,
)
