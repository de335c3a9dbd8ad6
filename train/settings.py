"""The one record of a training run's settings: `python -m train`'s flags (--max-steps) and launch/train.py's Hydra
keys (max_steps=...) are both made from TrainSettings' fields, and every rank checks the record before any
collective (TrainSettings.validate)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

# the model shapes --size names (d_model, n_layers, n_heads, d_ffn); both families, with the vocabulary and context
SIZES = {
    "small": dict(d_model=128, n_layers=4, n_heads=4, d_ffn=512),  # the default model: ~1.3 M parameters
    "draft": dict(d_model=64, n_layers=2, n_heads=2, d_ffn=256),  # its draft for speculative decoding: ~0.4 M
    "medium": dict(d_model=256, n_layers=4, n_heads=4, d_ffn=1024),  # ~4.3 M: on 2 cores, slower to a given loss
    "tiny": dict(d_model=32, n_layers=2, n_heads=2, d_ffn=64),  # for tests
}
DTYPES = ("float32", "bfloat16", "float64")


def setting(default, help: str):
    return dataclasses.field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class TrainSettings:
    output_dir: str | None = setting(None, "where the model (transformers' save_pretrained files), its tokenizer, "
                                     "train_log.jsonl, loss.png and the checkpoint go (required)")
    family: str = setting("gpt2", "the model family: gpt2 | llama")
    size: str = setting("small", "the model's shape: " + ", ".join(
        f"{k} ({v['d_model']} wide, {v['n_layers']} layers)" for k, v in SIZES.items()))
    max_seq_len: int = setting(256, "tokens per training sequence (the model's context)")
    vocab_size: int = setting(4096, "the byte-level BPE's vocabulary, trained on the corpus")
    tokenizer: str | None = setting(None, "a directory whose tokenizer to use instead of training one (a draft "
                                    "shares its target's)")
    corpus: str = setting("stdlib", "stdlib (this Python's standard library source, tests left out) or a directory "
                          "of .py/.txt files")
    held_out: float = setting(0.05, "the fraction of the corpus files held out for eval_loss (by a hash of the name)")
    tensor_parallel_size: int = setting(1, "ranks per model replica (heads, FFN and vocabulary split)")
    data_parallel_size: int = setting(1, "model replicas, each with its rows of every batch (the world is tp x dp)")
    max_steps: int = setting(800, "optimizer steps")
    batch_size: int = setting(16, "sequences per optimizer step, all replicas together")
    micro_batch_size: int | None = setting(None, "sequences per forward and backward, the rest accumulated (default: "
                                           "batch_size / data_parallel_size, no accumulation)")
    lr: float = setting(3e-3, "the peak learning rate (after warm-up; cosine decay to min_lr)")
    min_lr: float = setting(3e-4, "the learning rate at max_steps")
    warmup_steps: int = setting(40, "steps of linear warm-up")
    weight_decay: float = setting(0.1, "AdamW's decoupled weight decay (matrices only)")
    grad_clip: float = setting(1.0, "the global gradient norm's bound (0: no clipping)")
    distributed_optimizer: bool = setting(False, "AdamW's state split over the dp replicas (ZeRO-1)")
    sequence_parallel: bool = setting(False, "the v2sp blocks: 1/tp of the rows between blocks, all-gathers and "
                                      "reduce-scatters in place of the all-reduces (Megatron's)")
    dtype: str = setting("float32", "float32 | bfloat16 (autocast, float32 master weights) | float64")
    attention: str = setting("sdpa", "sdpa (PyTorch's fused kernel) | flash (FlashAttention-2's forward and backward "
                                     "in plain PyTorch, layers/attention/flash.py: exact, slower on a CPU)")
    eval_interval: int = setting(100, "steps between held-out evaluations (and at the last step)")
    eval_rows: int = setting(32, "held-out sequences per evaluation (the same ones every time)")
    log_interval: int = setting(10, "steps between train_log.jsonl rows")
    save_interval: int = setting(200, "steps between checkpoints (and at the end; 0: at the end only)")
    resume: bool = setting(False, "continue from output_dir's last checkpoint (run with the same settings)")
    seed: int = setting(0, "the initial weights and the batches")
    backend: str = setting("auto", "auto | gloo | nccl")
    device: str = setting("auto", "auto | cpu | cuda")
    threads_per_rank: int | None = setting(None, "intra-op threads per rank (default: the cores shared among ranks)")

    @property
    def world(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def micro(self) -> int:
        """Sequences per forward and backward."""
        return self.micro_batch_size or max(1, self.batch_size // self.data_parallel_size)

    @property
    def accumulation(self) -> int:
        return self.batch_size // (self.data_parallel_size * self.micro)

    def model_config(self, vocab_size: int | None = None):
        """The model's config, vocab_size the tokenizer's (a small corpus may leave it below the setting's). GPT-2:
        ModelConfig; Llama: LlamaConfig with 2 K,V heads where the heads allow it, its head untied."""
        from layers.models.families import family

        shape = dict(SIZES[self.size], max_seq_len=self.max_seq_len,
                     vocab_size=vocab_size or self.vocab_size)
        shape["d_head"] = shape["d_model"] // shape["n_heads"]
        if self.family == "llama":
            shape["n_kv_heads"] = 2 if shape["n_heads"] % 2 == 0 else 1
        return family(self.family).config(**shape)

    def validate(self, world: int | None = None) -> None:
        """ValueError in one line for a setting that cannot run, before any rank joins a group."""
        if not self.output_dir:
            raise ValueError("output_dir is required: where the trained model goes")
        if self.family not in ("gpt2", "llama"):
            raise ValueError(f"family={self.family!r}: gpt2 | llama")
        if self.size not in SIZES:
            raise ValueError(f"size={self.size!r}: one of {', '.join(SIZES)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: one of {', '.join(DTYPES)}")
        if self.attention not in ("sdpa", "flash"):
            raise ValueError(f"attention={self.attention!r}: sdpa or flash")
        for name in ("max_seq_len", "vocab_size", "tensor_parallel_size", "data_parallel_size", "max_steps",
                     "batch_size", "eval_interval", "eval_rows", "log_interval", "micro_batch_size",
                     "threads_per_rank"):
            value = getattr(self, name)
            if value is None and name in ("micro_batch_size", "threads_per_rank"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        for name in ("warmup_steps", "save_interval", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2 ** 32:
                raise ValueError(f"{name}={value!r} must be an integer in [0, 2**32)")
        for name, low in (("lr", 0.0), ("min_lr", 0.0), ("weight_decay", 0.0), ("grad_clip", 0.0), ("held_out", 0.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= low or \
                    (name == "lr" and value == 0):
                raise ValueError(f"{name}={value!r} must be a number {'above' if name == 'lr' else 'at least'} {low}")
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr={self.min_lr} is above lr={self.lr}: the schedule decays from lr to min_lr")
        if not self.held_out < 1:
            raise ValueError(f"held_out={self.held_out} must be in [0, 1)")
        if self.backend not in ("auto", "gloo", "nccl") or self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"backend={self.backend!r}, device={self.device!r}: backend auto | gloo | nccl, device "
                             f"auto | cpu | cuda")
        if world is not None and world != self.world:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} x data_parallel_size="
                             f"{self.data_parallel_size} = {self.world} ranks, but the world has {world}")
        if self.batch_size % (self.data_parallel_size * self.micro):
            raise ValueError(f"batch_size={self.batch_size} is not divisible into data_parallel_size="
                             f"{self.data_parallel_size} replicas of micro_batch_size={self.micro} "
                             f"sequences: make it a multiple of {self.data_parallel_size * self.micro}")
        if self.distributed_optimizer and self.data_parallel_size == 1:
            raise ValueError("distributed_optimizer splits AdamW's state over replicas: set data_parallel_size > 1")
        if self.sequence_parallel and self.tensor_parallel_size == 1:
            raise ValueError("sequence_parallel splits the rows over the tp ranks: set tensor_parallel_size > 1")
        cfg = self.model_config()
        tp = self.tensor_parallel_size
        if cfg.n_heads % tp or cfg.d_ffn % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide the {self.size} model's n_heads="
                             f"{cfg.n_heads} and d_ffn={cfg.d_ffn}: the heads are split whole")
        if tp > getattr(cfg, "n_kv_heads", cfg.n_heads):
            raise ValueError(f"tensor_parallel_size={tp} > n_kv_heads={cfg.n_kv_heads}: replicated K,V heads are "
                             f"served, not trained")
        if self.resume and self.tokenizer is not None:
            raise ValueError("resume uses output_dir's tokenizer: leave tokenizer unset")
        from train.data import corpus_files, split

        split(corpus_files(self.corpus), self.held_out)  # an empty or missing corpus, said here
        if self.resume:
            self.check_resume()

    def check_resume(self) -> None:
        """ValueError unless output_dir holds an earlier run of these settings (train_settings.json, tokens.pt and
        checkpoint/): read from files on every rank, before any collective."""
        import json
        from pathlib import Path

        out = Path(self.output_dir)
        if not all((out / name).exists() for name in ("train_settings.json", "tokens.pt", "checkpoint")):
            raise ValueError(f"resume: {out} has no checkpoint of an earlier run (train_settings.json, tokens.pt and "
                             f"checkpoint/)")
        saved = json.loads((out / "train_settings.json").read_text())
        differ = [k for k in RESUME_SAME if saved.get(k) != getattr(self, k)]
        if differ:
            raise ValueError("resume: the earlier run had " + ", ".join(
                f"{k}={saved.get(k)!r} (here {getattr(self, k)!r})" for k in differ) + ": resume with its settings")

FIELDS = {f.name: f for f in dataclasses.fields(TrainSettings)}
# what a resumed run must share with the run it continues (the rest: where and how it runs, how often it logs)
RESUME_SAME = [name for name in FIELDS if name not in (
    "output_dir", "resume", "tokenizer", "eval_interval", "eval_rows", "log_interval", "save_interval", "backend",
    "device", "threads_per_rank")]


def add_flags(parser: argparse.ArgumentParser) -> None:
    """--output-dir, --tensor-parallel-size, --max-steps, ...: one flag per field, its help and default from it."""
    for f in dataclasses.fields(TrainSettings):
        flag = "--" + f.name.replace("_", "-")
        shown = f"{f.metadata['help']} (default: {f.default})"
        if f.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=shown)
            continue
        kind = {"int": int, "float": float, "int | None": int}.get(str(f.type), str)
        parser.add_argument(flag, type=kind, default=f.default, help=shown)


def from_mapping(values: dict) -> TrainSettings:
    """TrainSettings from flags or Hydra keys; ValueError naming a key it does not have."""
    unknown = sorted(set(values) - set(FIELDS))
    if unknown:
        raise ValueError(f"unknown setting {unknown[0]!r}: the settings are {', '.join(FIELDS)}")
    return TrainSettings(**values)
