"""Import Hugging Face GPT-2 weights into the dense stack (then shard as usual).

transformers' GPT-2 stores its linears as `Conv1D` with weight [in, out] (y = x·W + b),
nn.Linear stores [out, in]: every weight is transposed on the way in. The fused
`attn.c_attn` keeps GPT-2's [Q | K | V] column layout, which is the layout
layers/shard.py cuts head-aligned. Works on a plain state dict: transformers itself
is needed only to make one (pip install -e .[hf]); nothing is downloaded here. A directory from
`save_pretrained` is read by layers/hf.py, which also imports Llama checkpoints (layers/hf_llama.py).

    GPT2Block keys        ln_1.weight, attn.c_attn.weight, attn.c_proj.weight, mlp.c_fc.weight, ...
    GPT2Model keys        h.<i>.<block key>, wte.weight, wpe.weight, ln_f.weight, ln_f.bias
    GPT2LMHeadModel       transformer.<GPT2Model key>, lm_head.weight (tied to wte: the same tensor)
"""

from __future__ import annotations

import re

import torch

from layers.config import ModelConfig
from layers.dense import DenseBlock, DenseStack
from layers.lm import DenseLM
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
    for key in ("n_embd", "n_head", "n_layer", "n_positions", "vocab_size", "n_inner"):
        value = hf.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{key}={value!r} in config.json must be a positive integer")
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ConfigError(f"GPT-2 activation {act!r} is not supported: the block uses the tanh GeLU (gelu_new)")
    d, h = hf["n_embd"], hf["n_head"]
    if d % h:
        raise ConfigError(f"n_embd={d} is not divisible by n_head={h}")
    return ModelConfig(d_model=d, n_heads=h, d_head=d // h, d_ffn=hf.get("n_inner") or 4 * d,
                       n_layers=hf["n_layer"], max_seq_len=hf.get("n_positions", 1024),
                       ln_eps=hf.get("layer_norm_epsilon", 1e-5), vocab_size=hf.get("vocab_size", 50257))


@torch.no_grad()
def copy_checked(target: torch.Tensor, value: torch.Tensor, key: str, ours: str) -> None:
    """target <- value (a checkpoint's tensor for `key`, already in our layout), or ValueError naming both shapes."""
    if tuple(value.shape) != tuple(target.shape):
        raise ValueError(f"{key}: shape {tuple(value.shape)} does not fit {ours} {tuple(target.shape)}")
    target.copy_(value.to(target.dtype))


def load_block(block: DenseBlock, state: dict[str, torch.Tensor], prefix: str = "") -> DenseBlock:
    """Copy one GPT2Block's weights (keys under `prefix`) into a DenseBlock."""
    for ours, theirs, transpose in _BLOCK_KEYS:
        key = prefix + theirs
        if key not in state:
            raise KeyError(f"GPT-2 state dict has no {key!r}")
        copy_checked(block.get_parameter(ours), state[key].t() if transpose else state[key], key, ours)
    return block


def _block_prefix(state: dict[str, torch.Tensor]) -> str:
    for key in state:
        m = re.match(r"^(.*?)h\.0\.ln_1\.weight$", key)
        if m:
            return m.group(1) + "h."
    raise KeyError("no GPT-2 blocks found (expected keys like 'h.0.ln_1.weight' or 'transformer.h.0.ln_1.weight')")


def load_stack(stack: DenseStack, state: dict[str, torch.Tensor]) -> DenseStack:
    """Copy a GPT2Model / GPT2LMHeadModel state dict's blocks into a DenseStack of the same shape."""
    prefix = _block_prefix(state)
    for i, block in enumerate(stack.blocks):
        load_block(block, state, f"{prefix}{i}.")
    return stack


def load_lm(lm: DenseLM, state: dict[str, torch.Tensor]) -> DenseLM:
    """Copy a GPT2LMHeadModel (or GPT2Model) state dict into a DenseLM: blocks, embeddings, final LayerNorm."""
    load_stack(lm.stack, state)
    prefix = _block_prefix(state).removesuffix("h.")
    for name in ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"):
        key = prefix + name
        if key not in state:
            raise KeyError(f"GPT-2 state dict has no {key!r}")
        copy_checked(lm.get_parameter(name), state[key], key, name)
    head = state.get("lm_head.weight")
    if head is not None and not torch.equal(head, state[prefix + "wte.weight"]):
        raise ValueError("lm_head.weight differs from wte.weight: only GPT-2's tied LM head is supported")
    return lm


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
