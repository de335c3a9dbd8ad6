"""Checkpoints from transformers' `save_pretrained`: config.json's model_type picks the family (families.py),
whose module maps the files' keys to our parameters (modules of layers/models/):

    model_type gpt2    GPT2Model / GPT2LMHeadModel      hf_gpt2.py (Conv1D weights transposed)
    model_type llama   LlamaModel / LlamaForCausalLM    hf_llama.py (gate_proj, up_proj stacked)
    model_type mixtral, deepseek_v3                     hf_mixtral.py, hf_deepseek.py (experts stacked)
    model_type qwen3   Qwen3Model / Qwen3ForCausalLM    qwen3.py (Llama's keys and q_norm, k_norm)

Both are read before any collective (launch/settings.py): a file that is missing, corrupt or of an
unsupported kind is a setting error on every rank, with the reason. The weights are read lazily
(layers/models/checkpoint.py): the dense model's loader reads one whole tensor at a time, and CheckpointSource lets
each rank read only the slices it holds, by the rules of layers/parallel/shard.py (shard_lm).
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch

from layers.models.checkpoint import Checkpoint
from layers.models.config import DTYPES, ModelConfig, parse_dtype
from layers.models.families import FAMILIES, family, of
from layers.models.llama import LlamaConfig
from layers.parallel.shard import Cut
from tp.dist import ConfigError


def config_from_hf(hf: dict) -> ModelConfig | LlamaConfig:
    """The model config of a config.json's dict (or transformers' PretrainedConfig.to_dict())."""
    if not isinstance(hf, dict):
        raise ConfigError(f"a model config must be a JSON object, got {type(hf).__name__}")
    kind = hf.get("model_type", "gpt2")
    if kind not in FAMILIES:
        titles = [f"{family(name).title} ({name})" for name in FAMILIES]
        raise ConfigError(f"model_type={kind!r} is not supported: {', '.join(titles[:-1])} and {titles[-1]} "
                          f"checkpoints are")
    return family(kind).config_from_hf(hf)


def check_positive(hf: dict, keys, required: bool = False) -> None:
    """ConfigError naming the first of config.json's `keys` that is not a positive integer (one that is absent passes,
    unless required)."""
    for key in keys:
        value = hf.get(key)
        if (required or value is not None) and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{key}={value!r} in config.json must be a positive integer")


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


def resolve_dtype(dtype, checkpoint: str | Path | None) -> tuple[torch.dtype, str | None]:
    """The run's dtype, the one rule every entry point uses (LLM, python -m serve, the server, the launchers): a name
    ("bfloat16") or a torch.dtype as given; "auto": the checkpoint's torch_dtype (float32 where it names none),
    float32 for presets and random weights. Returns (dtype, where it came from: None when given); ConfigError for an
    unknown name."""
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    if str(dtype) != "auto":
        return parse_dtype(str(dtype)), None
    saved = None if checkpoint is None or not Path(checkpoint).is_dir() else checkpoint_dtype(checkpoint)
    if saved is not None:
        return parse_dtype(saved), "auto: the checkpoint's torch_dtype"
    return torch.float32, ("auto: the checkpoint names no dtype" if checkpoint else "auto: random weights")


def checkpoint_dtype(path: str | Path) -> str | None:
    """The dtype config.json says the weights were saved in (`torch_dtype`, or `dtype` in newer transformers), when it
    is one of ours (layers/models/config.DTYPES); None if it names none."""
    f = Path(path) / "config.json"
    hf = json.loads(f.read_text()) if f.is_file() else {}
    name = hf.get("torch_dtype") or hf.get("dtype")
    return name if isinstance(name, str) and name in DTYPES else None


def checkpoint_eos(path: str | Path | None, vocab_size: int) -> tuple[int, ...]:
    """The checkpoint's EOS ids: generation_config.json's eos_token_id, else config.json's (an int or a list); ()
    for none (or no checkpoint)."""
    if path is None:
        return ()
    for name in ("generation_config.json", "config.json"):
        f = Path(path) / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if eos is not None:
                ids = eos if isinstance(eos, list) else [eos]
                return tuple(int(t) for t in ids if isinstance(t, int) and 0 <= t < vocab_size)
    return ()


def read_state(path: str | Path) -> Checkpoint:
    """The weights of a directory saved by `save_pretrained` (model.safetensors, sharded safetensors with their
    index, or pytorch_model.bin): a lazy Mapping of the tensors by name, read on demand
    (layers/models/checkpoint.py)."""
    return Checkpoint(path)


@contextmanager
def shapes_only():
    """Meta-device modules built for their shapes only: their random init skipped (normal_ on a meta tensor imports
    torch._dynamo, 1.7 s of LLM's start-up on a laptop, for values nobody reads)."""
    saved = torch.nn.init.normal_, torch.nn.init.trunc_normal_
    torch.nn.init.normal_ = torch.nn.init.trunc_normal_ = lambda tensor, *args, **kwargs: tensor
    try:
        yield
    finally:
        torch.nn.init.normal_, torch.nn.init.trunc_normal_ = saved


def check_state(cfg: ModelConfig | LlamaConfig, state, lm: bool = False) -> None:
    """ConfigError naming the first weight the config expects but the checkpoint (a Checkpoint, or a state dict) lacks
    or shapes differently; from the headers only. lm=True also checks the embeddings, the final norm and (GPT-2)
    that a saved lm_head equals the embedding it is tied to."""
    shapes = state.shapes if isinstance(state, Checkpoint) else {k: tuple(v.shape) for k, v in state.items()}
    with shapes_only():
        expected = of(cfg).expected_shapes(cfg, state, lm)
    for key, shape in expected.items():
        if key not in shapes:
            raise ConfigError(f"the weights have no {key!r}, which config.json's model needs")
        if tuple(shapes[key]) != shape:
            raise ConfigError(f"{key} has shape {tuple(shapes[key])}, config.json's model needs {shape}")
    if lm and of(cfg).check_lm is not None:
        of(cfg).check_lm(state)
    if isinstance(state, Checkpoint):
        state.close()  # a .bin file mapped for the comparison


@torch.no_grad()
def copy_checked(target: torch.Tensor, value: torch.Tensor, key: str, ours: str) -> None:
    """target <- value (a checkpoint's tensor for `key`, already in our layout), or ValueError naming both shapes."""
    if tuple(value.shape) != tuple(target.shape):
        raise ValueError(f"{key}: shape {tuple(value.shape)} does not fit {ours} {tuple(target.shape)}")
    target.copy_(value.to(target.dtype))


def load_named(module: torch.nn.Module, state, named: dict[str, tuple[tuple[str, ...], bool]], what: str):
    """Copy each of our parameters from its checkpoint key(s), transposed where marked, converting to the parameter's
    dtype. Several keys are stacked along rows (of our [E·rows, cols] view for stacked experts), each copied
    straight into its rows: no concatenated copy. KeyError naming a missing key, ValueError a shape that differs."""
    try:
        for ours, (keys, transpose) in named.items():
            for key in keys:
                if key not in state:
                    raise KeyError(f"{what} state dict has no {key!r}")
            target = module.get_parameter(ours)
            shape = state.shapes[keys[0]] if hasattr(state, "shapes") else state[keys[0]].shape  # no read for a shape
            if len(keys) == 1 and not (target.dim() == 3 and len(shape) == 2):
                value = state[keys[0]]
                copy_checked(target, value.t() if transpose else value, keys[0], ours)
                continue
            rows = target.view(-1, target.shape[-1]) if target.dim() == 3 else target
            at = 0
            for key in keys:
                value = state[key]
                n = value.shape[0]
                if at + n > rows.shape[0]:
                    raise ValueError(f"{key}: rows {at}..{at + n} do not fit {ours} {tuple(target.shape)}")
                copy_checked(rows.narrow(0, at, n), value, key, ours)
                at += n
            if at != rows.shape[0]:
                raise ValueError(f"{keys[0]} .. {keys[-1]}: {at} rows do not fill {ours} {tuple(target.shape)}")
        return module
    finally:
        getattr(state, "close", lambda: None)()  # a lazily read checkpoint: release a mapped .bin file


def load_stack(stack, state):
    """A checkpoint's blocks into the dense stack of the same family and shape."""
    fam = of(stack.cfg)
    return load_named(stack, state, fam.names(stack.cfg, state, len(stack.blocks), lm=False), fam.title)


def load_lm(lm, state):
    """A checkpoint into the dense LM of the same family and shape (layers/models/lm.dense_lm), one tensor at a time."""
    fam = of(lm.cfg)
    load_named(lm, state, fam.names(lm.cfg, state, len(lm.stack.blocks), lm=True), fam.title)
    if fam.check_lm is not None:
        try:
            fam.check_lm(state)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
    return lm


class CheckpointSource:
    """Per-rank loading (layers/parallel/shard.Source): each Part of a TP model's plan, read straight from the
    checkpoint files into this rank's parameters, converted to the run's dtype slice by slice; nothing else is read.

    Our parameters are in the dense model's layout; the files are in transformers': GPT-2's Conv1D weights are
    transposed (a cut of our rows is a cut of its columns), Llama's gate_up is gate_proj's rows then up_proj's."""

    def __init__(self, checkpoint: Checkpoint, cfg: ModelConfig | LlamaConfig, dtype: torch.dtype, device=None):
        self.checkpoint, self.cfg, self.dtype, self.device = checkpoint, cfg, dtype, device
        self.names = of(cfg).names(cfg, checkpoint, cfg.n_layers, lm=True)

    def close(self) -> None:
        """The load is done (shard_lm): release what the checkpoint holds mapped."""
        self.checkpoint.close()

    def _experts(self, name: str) -> int | None:
        """E where our parameter is an [E, rows, cols] stack the files hold expert by expert (Mixtral)."""
        experts_of, keys = of(self.cfg).experts_of, self.names[name][0]
        return experts_of(name, self.cfg) if experts_of and len(self.checkpoint.shapes[keys[0]]) == 2 else None

    def shape(self, name: str) -> tuple[int, ...]:
        keys, transpose = self.names[name]
        parts = [self.checkpoint.shapes[k] for k in keys]
        full = (sum(s[0] for s in parts),) + tuple(parts[0][1:])
        experts = self._experts(name)
        if experts:  # the files' rows are those of our [E·rows, cols] view
            full = (experts, full[0] // experts, full[1])
        return full[::-1] if transpose else full

    def fill(self, dest: torch.Tensor, name: str, cut: Cut) -> None:
        keys, transpose = self.names[name]
        if transpose:  # the file holds our [out, in] as [in, out]: fill the transposed view along the other dim
            self.checkpoint.fill(dest.t(), keys[0], 1 - cut.dim, cut.ranges)
            return
        experts = self._experts(name)
        if experts:  # our [E, R, C] from E·(rows) files: the same cut on the [E·R, C] view
            rows = self.shape(name)[1]
            if cut.ranges is None:
                flat = cut
            elif cut.dim == 0:  # whole experts (ep)
                flat = Cut(0, tuple((a * rows, b * rows) for a, b in cut.ranges))
            elif cut.dim == 1:  # rows within every expert (tp)
                flat = Cut(0, tuple((e * rows + a, e * rows + b) for e in range(experts) for a, b in cut.ranges))
            else:
                flat = Cut(1, cut.ranges)
            self._stacked(dest.view(-1, dest.shape[-1]), keys, flat)
            return
        self._stacked(dest, keys, cut)

    def _stacked(self, dest: torch.Tensor, keys: tuple[str, ...], cut: Cut) -> None:
        """dest <- the cut of the keys' tensors stacked along rows."""
        if len(keys) == 1:
            self.checkpoint.fill(dest, keys[0], cut.dim, cut.ranges)
            return
        bounds, lo = [], 0  # stacked along rows: each key's rows [lo, hi) of ours
        for key in keys:
            bounds.append((key, lo, lo + self.checkpoint.shapes[key][0]))
            lo = bounds[-1][2]
        if cut.dim != 0 or cut.ranges is None:  # every row of every key, each in its place
            for key, lo, hi in bounds:
                self.checkpoint.fill(dest.narrow(0, lo, hi - lo), key, cut.dim, cut.ranges)
            return
        out = 0
        for a, b in cut.ranges:  # a range of our rows may fall in one key or span several
            for key, lo, hi in bounds:
                s, e = max(a, lo), min(b, hi)
                if s < e:
                    self.checkpoint.fill(dest.narrow(0, out, e - s), key, 0, ((s - lo, e - lo),))
                    out += e - s
