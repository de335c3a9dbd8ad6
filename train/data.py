"""The text a model is trained on here, with no download: the running Python's standard library source.

    corpus   = every .py file under the interpreter's stdlib directory (sysconfig's), read at run time (nothing is
               copied into the repository); left out: site-packages, the test directories, and two directories of
               generated data (encodings/' codec tables, pydoc_data's help text)
    held out = the files whose path hashes into the held-out fraction (crc32: the same split on every machine with
               the same Python), so no held-out function was seen in training
    tokens   = a byte-level BPE trained on the training files alone, every file ended by <|endoftext|>

A batch is `rows` windows of T + 1 tokens at random offsets, drawn from a generator seeded by (seed, step): the
step's batch is the same whatever the layout, and each dp replica takes its own rows of it.
"""

from __future__ import annotations

import sysconfig
import zlib
from pathlib import Path

import torch

SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
# the stdlib's generated files: codec tables (encodings/cp437.py ...) and pydoc's help text, data rather than code
STDLIB_DATA = {"encodings", "pydoc_data"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(corpus: str) -> list[Path]:
    """The .py files of `corpus`: "stdlib" (the interpreter's, tests and generated data left out) or a directory
    (every .py and .txt file under it, __pycache__ aside). ValueError when there are none, naming where it looked."""
    root = stdlib_root() if corpus == "stdlib" else Path(corpus)
    if not root.is_dir():
        raise ValueError(f"corpus={corpus!r}: {root} is not a directory (give 'stdlib' or a directory of .py/.txt "
                         f"files)")
    patterns = ["*.py"] if corpus == "stdlib" else ["*.py", "*.txt"]
    skip = SKIP_DIRS | STDLIB_DATA if corpus == "stdlib" else {"__pycache__"}
    files = sorted(p for pattern in patterns for p in root.rglob(pattern)
                   if p.is_file() and not skip & set(p.relative_to(root).parts[:-1]))
    if not files:
        raise ValueError(f"corpus={corpus!r}: no .py or .txt file under {root}: nothing to train on")
    return files


def split(files: list[Path], held_out: float) -> tuple[list[Path], list[Path]]:
    """(train, held-out) by a hash of each file's name and parent: a file's side does not depend on the others."""
    key = [zlib.crc32(f"{f.parent.name}/{f.name}".encode()) / 2 ** 32 for f in files]
    train = [f for f, k in zip(files, key) if k >= held_out]
    held = [f for f, k in zip(files, key) if k < held_out]
    if held_out > 0 and not held:  # a tiny corpus: the last file is held out
        train, held = train[:-1], train[-1:]
    if not train:
        raise ValueError(f"held_out={held_out}: every one of the {len(files)} corpus files would be held out")
    return train, held


def read(files: list[Path]) -> list[str]:
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def encode(tokenizer, texts: list[str]) -> torch.Tensor:
    """Every text's ids, each followed by the end-of-text id, as one int64 tensor."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch(texts):
        ids += enc.ids
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int64)


# identifiers, runs of other symbols, runs of whitespace: a space is a token of its own rather than the start of the
# next word (GPT-2's rule), so a prompt ending in a space ("def ") ends as the training text does there; a newline
# and the next line's indent are one piece, which BPE makes one token
PIECES = r"[\p{L}\p{N}_]+|[^\s\p{L}\p{N}_]+|\s+"


def prepare(corpus: str, held_out: float, vocab_size: int, directory: Path, tokenizer_dir: str | None = None) -> dict:
    """Read the corpus, train its BPE on the training files (or load tokenizer_dir's, for a draft that must share its
    target's), save the tokenizer in directory, and return {"train": ids, "held_out": ids, "files": (n train, n held
    out), "vocab_size": the tokenizer's, "tokenizer": it}; all but the tokenizer are written to directory/tokens.pt
    for the ranks to read."""
    from serve.toy_model import train_tokenizer

    train_files, held_files = split(corpus_files(corpus), held_out)
    train_texts = read(train_files)
    if tokenizer_dir is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        tokenizer.save_pretrained(directory)
    else:
        tokenizer = train_tokenizer(directory, train_texts, vocab_size, PIECES)  # BPE within PIECES
    data = {"train": encode(tokenizer, train_texts), "held_out": encode(tokenizer, read(held_files)),
            "files": (len(train_files), len(held_files)), "vocab_size": len(tokenizer)}
    torch.save(data, directory / "tokens.pt")
    return data | {"tokenizer": tokenizer}


def windows(ids: torch.Tensor, rows: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """`rows` windows of `length` consecutive ids at random offsets: [rows, length]."""
    if ids.numel() <= length:
        raise ValueError(f"{ids.numel()} tokens: too few for one window of {length} (a smaller max_seq_len or a "
                         f"larger corpus)")
    start = torch.randint(0, ids.numel() - length, (rows,), generator=generator)
    return ids[start[:, None] + torch.arange(length)]


def step_batch(ids: torch.Tensor, step: int, seed: int, rows: int, length: int) -> torch.Tensor:
    """The step's whole batch [rows, length], the same on every rank and at every layout."""
    return windows(ids, rows, length, torch.Generator().manual_seed(seed * 1_000_003 + step))
