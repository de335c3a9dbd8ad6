"""Model shapes and the checks that must pass before any collective is issued."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch

from tp.dist import ConfigError

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The default check: max |tp - dense| / max |dense| per layer. float32 is the strict check; the
# half-precision bounds are about 1.6x (bfloat16) and 1.9x (float16) the worst measured rounding of every default
# variant, v2sp included, at p = 2, 4, 8 (docs/precision.md).
DEFAULT_TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 5e-2, torch.float16: 6e-3}
VARIANTS = ("v1", "v2", "intra_head")  # every rank holds the whole residual stream [n, d]
SP_VARIANTS = ("v2sp",)  # sequence parallelism: each rank holds n/p rows between sub-layers (tp_block.SPStack)
ALL_VARIANTS = VARIANTS + SP_VARIANTS  # what run_block runs
SERVING_VARIANTS = ("v1", "v2")  # intra_head is a counterfactual of one forward, not served


class FamilyConfig:
    """What every family's config dataclass has (ModelConfig; layers/models/llama.LlamaConfig, mla.DeepseekConfig)."""

    @property
    def k(self) -> int:  # the attention width, n_heads·d_head
        return self.n_heads * self.d_head

    def asdict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_settings(cls, settings: dict):
        """The config from settings (a preset's YAML, the launchers' model.* overrides), each value checked against
        its field's type first: ConfigError naming the setting."""
        kinds = {f.name: getattr(f.type, "__name__", f.type) for f in fields(cls)}  # "int", "float", "bool", "str"
        for key, value in settings.items():
            kind, flag = kinds.get(key), isinstance(value, bool)
            if kind == "float" and (flag or not isinstance(value, (int, float))):
                raise ConfigError(f"model.{key}={value!r} must be a number")
            if kind == "bool" and not flag:
                raise ConfigError(f"model.{key}={value!r} must be true or false")
            if kind == "int" and (flag or not isinstance(value, int)):
                raise ConfigError(f"model.{key}={value!r} must be an integer")
        try:
            return cls(**settings)
        except TypeError as exc:
            raise ConfigError(f"bad model settings: {exc}") from None

    def check_positive(self, names) -> None:
        """ConfigError naming the first of the fields `names` that is not a positive integer."""
        for name in names:
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name}={getattr(self, name)} must be a positive integer")


@dataclass(frozen=True)
class ModelConfig(FamilyConfig):
    """A GPT-2-style pre-LN decoder stack. k = n_heads * d_head is the attention width."""

    d_model: int = 512
    n_heads: int = 8
    d_head: int = 64
    d_ffn: int = 2048
    n_layers: int = 8
    max_seq_len: int = 1024
    ln_eps: float = 1e-5
    vocab_size: int = 50257  # GPT-2's BPE vocabulary; only the language model (layers/models/lm.py) uses it

    family = "gpt2"  # the block family (layers/models/llama.LlamaConfig is "llama"); not a dataclass field

    @property
    def n_kv_heads(self) -> int:  # multi-head attention: every query head has its own K,V head
        return self.n_heads


# seeds/03's model, the default everywhere (conf/model/article03.yaml gives Hydra the same numbers; a test checks it).
ARTICLE03 = ModelConfig()


def valid_tp_sizes(cfg: ModelConfig, up_to: int = 64) -> list[int]:
    return [p for p in range(1, up_to + 1) if cfg.n_heads % p == 0 and cfg.d_ffn % p == 0 and cfg.d_model % p == 0]


def validate_model(cfg: ModelConfig, p: int) -> None:
    """Raise ConfigError naming the numbers to change. Pure: every rank reaches the same verdict."""
    cfg.check_positive(("d_model", "n_heads", "d_head", "d_ffn", "n_layers", "max_seq_len", "vocab_size"))
    if cfg.d_model != cfg.k:
        raise ConfigError(f"d_model={cfg.d_model} must equal n_heads*d_head={cfg.n_heads}*{cfg.d_head}={cfg.k} "
                          f"(the GPT-2 block adds the attention output back onto the residual stream); "
                          f"set model.d_head={cfg.d_model // cfg.n_heads if cfg.d_model % cfg.n_heads == 0 else '?'}")
    valid = ", ".join(map(str, valid_tp_sizes(cfg)))
    if cfg.n_heads % p:
        raise ConfigError(f"n_heads={cfg.n_heads} heads cannot be split over p={p} ranks (head-aligned split needs "
                          f"n_heads % p == 0); valid tensor-parallel sizes: {valid}")
    for name in ("d_ffn", "d_model"):  # d_model: v1 column-splits the output projection and FFN-down over it
        if getattr(cfg, name) % p:
            raise ConfigError(f"{name}={getattr(cfg, name)} is not divisible by p={p} ranks; valid tensor-parallel "
                              f"sizes: {valid}")


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def parse_variants(names) -> list[str]:
    names = [names] if isinstance(names, str) else list(names)
    if not names:
        raise ConfigError(f"variants is empty; choose from {', '.join(ALL_VARIANTS)}")
    for v in names:
        if v not in ALL_VARIANTS:
            raise ConfigError(f"unknown variant {v!r}; choose from {', '.join(ALL_VARIANTS)}")
    return names


def validate_variants(cfg: ModelConfig, p: int, variants: list[str]) -> None:
    if "intra_head" in variants and cfg.d_head % p:
        valid = ", ".join(str(q) for q in valid_tp_sizes(cfg) if cfg.d_head % q == 0)
        raise ConfigError(f"variant intra_head splits every head's d_head={cfg.d_head} over p={p} ranks, which needs "
                          f"d_head % p == 0; valid tensor-parallel sizes for it: {valid} (or drop intra_head from "
                          f"variants)")


def validate_tokens(cfg: ModelConfig, n_tokens: int, what: str = "n_tokens") -> None:
    if n_tokens < 1:
        raise ConfigError(f"{what}={n_tokens} must be at least 1")
    if n_tokens > cfg.max_seq_len:
        raise ConfigError(f"{what}={n_tokens} exceeds model.max_seq_len={cfg.max_seq_len}")
