"""Checkpoints from transformers' `save_pretrained`, of either block family: config.json picks the family.

    model_type gpt2    GPT2Model / GPT2LMHeadModel      layers/hf_gpt2.py (Conv1D weights transposed)
    model_type llama   LlamaModel / LlamaForCausalLM    layers/hf_llama.py (gate_proj, up_proj stacked)

Both are read before any collective (launch/settings.py): a file that is missing, corrupt or of an
unsupported kind is a setting error on every rank, with the reason.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from layers import hf_gpt2, hf_llama
from layers.config import ModelConfig
from layers.llama import LlamaConfig
from tp.dist import ConfigError

FAMILIES = {"gpt2": hf_gpt2, "llama": hf_llama}


def config_from_hf(hf: dict) -> ModelConfig | LlamaConfig:
    """The model config of a config.json's dict (or transformers' PretrainedConfig.to_dict())."""
    if not isinstance(hf, dict):
        raise ConfigError(f"a model config must be a JSON object, got {type(hf).__name__}")
    kind = hf.get("model_type", "gpt2")
    if kind not in FAMILIES:
        raise ConfigError(f"model_type={kind!r} is not supported: GPT-2 (gpt2) and Llama (llama) checkpoints are")
    return FAMILIES[kind].config_from_hf(hf)


def read_config(path: str | Path) -> ModelConfig | LlamaConfig:
    """The model config of a directory saved by `save_pretrained` (its config.json)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"hf_checkpoint={path}: expected a directory with config.json (from save_pretrained)")
    try:
        hf = json.loads((path / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"hf_checkpoint={path}: config.json is not valid JSON ({exc})") from None
    try:
        return config_from_hf(hf)
    except ConfigError as exc:
        raise ConfigError(f"hf_checkpoint={path}: {exc}") from None


def read_state(path: str | Path) -> dict[str, torch.Tensor]:
    """The weights of a directory saved by `save_pretrained`: model.safetensors or pytorch_model.bin."""
    path = Path(path)
    if (path / "model.safetensors").is_file():
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise ConfigError("reading model.safetensors needs the safetensors package: pip install -e .[hf]") from None
        return load_file(str(path / "model.safetensors"))
    if (path / "pytorch_model.bin").is_file():
        return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise ConfigError(f"hf_checkpoint={path}: no model.safetensors or pytorch_model.bin")


def check_state(cfg: ModelConfig | LlamaConfig, state: dict[str, torch.Tensor], lm: bool = False) -> None:
    """ConfigError naming the first weight the config expects but the state dict lacks or shapes differently.
    lm=True also checks the embeddings and the final norm."""
    for key, shape in FAMILIES[cfg.family].expected_shapes(cfg, state, lm).items():
        if key not in state:
            raise ConfigError(f"the weights have no {key!r}, which config.json's model needs")
        if tuple(state[key].shape) != shape:
            raise ConfigError(f"{key} has shape {tuple(state[key].shape)}, config.json's model needs {shape}")


def load_stack(stack, state: dict[str, torch.Tensor]):
    """A checkpoint's blocks into the dense stack of the same family and shape."""
    return FAMILIES[stack.cfg.family].load_stack(stack, state)


def load_lm(lm, state: dict[str, torch.Tensor]):
    """A checkpoint into the dense LM of the same family and shape (layers/lm.dense_lm)."""
    return FAMILIES[lm.cfg.family].load_lm(lm, state)
