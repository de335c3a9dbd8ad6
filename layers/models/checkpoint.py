"""A `save_pretrained` directory's weights, read lazily: one tensor, or one rank's slices of it, at a time.

    model.safetensors                                              one file
    model.safetensors.index.json + model-0000i-of-0000N.safetensors   sharded: the index's weight_map says which
                                                                   file holds which tensor
    pytorch_model.bin, or pytorch_model.bin.index.json + shards    torch.load(mmap=True, weights_only=True)

Opening reads the index and every file's header only (safetensors: 8 bytes of length, then JSON with each
tensor's dtype, shape and byte range), so an index naming a missing file, a tensor the index puts in a file
that lacks it, and a truncated file are refused by name before any tensor is read, on every rank alike.

Reads go through safetensors' `safe_open` / `get_slice`, one tensor at a time: the file is mapped, the slice
copied into the caller's tensor (converting to its dtype), and the mapping dropped. safetensors' slices are
views of the mapped file, so the pages a read touches stay resident only until that copy is done; a column cut
(row-parallel weights) touches every page of its tensor, so the transient is one tensor, never a file.
pytorch_model.bin files are mapped whole, one file at a time, and stay mapped while it is being read.

`bytes_read` counts the bytes copied out of the files: the tests hold every rank to exactly its own slices.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping
from pathlib import Path

import torch

from tp.dist import ConfigError

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}
LAYOUTS = (("model.safetensors.index.json", "model.safetensors"), ("pytorch_model.bin.index.json", "pytorch_model.bin"))


class Checkpoint(Mapping):
    """The tensors of a checkpoint directory by name: shapes and dtypes from the headers, data on demand.

    `ckpt[key]` reads a whole tensor (the dense model's loader); `fill(dest, key, dim, ranges)` copies only ranges
    along one dimension (each rank's slices, layers/models/hf.CheckpointSource)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.where: dict[str, str] = {}  # tensor -> the file holding it
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self.bytes_read = 0
        self._bin: tuple[str, dict] | None = None  # the .bin file mapped now
        self._digest = 0
        index, single = next(((i, s) for i, s in LAYOUTS if (self.path / i).is_file() or (self.path / s).is_file()),
                             (None, None))
        if index is None:
            raise ConfigError(f"hf_checkpoint={self.path}: no model.safetensors, model.safetensors.index.json, "
                              f"pytorch_model.bin or pytorch_model.bin.index.json")
        self.format = "safetensors" if single.endswith(".safetensors") else "bin"
        if self.format == "safetensors":
            try:
                import safetensors  # noqa: F401
            except ImportError:
                raise ConfigError("reading safetensors checkpoints needs the safetensors package: "
                                  "pip install -e .[hf]") from None
        wanted = self._read_index(index) if (self.path / index).is_file() else None
        self.files = sorted(set(wanted.values())) if wanted is not None else [single]
        self.layout = f"{index} and its {len(self.files)} files" if wanted is not None else single
        for name in self.files:
            found = self._read_header(name)
            for key in found if wanted is None else [k for k, f in wanted.items() if f == name]:
                if key not in found:
                    raise ConfigError(f"hf_checkpoint={self.path}: {index} puts {key} in {name}, which has no such "
                                      f"tensor")
                self.where[key] = name
                self.shapes[key], self.dtypes[key] = found[key]

    def _read_index(self, index: str) -> dict[str, str]:
        try:
            weight_map = json.loads((self.path / index).read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise TypeError("weight_map is not an object of file names")
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
            raise ConfigError(f"hf_checkpoint={self.path}: {index} is not a weight index "
                              f"({type(exc).__name__}: {exc})") from None
        missing = sorted({f for f in weight_map.values() if not (self.path / f).is_file()})
        if missing:
            raise ConfigError(f"hf_checkpoint={self.path}: {index} names {missing[0]}, which is not in the directory"
                              + (f" ({len(missing)} files missing)" if len(missing) > 1 else ""))
        self._digest = zlib.crc32((self.path / index).read_bytes(), self._digest)
        return weight_map

    def _read_header(self, name: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """{tensor: (shape, dtype)} of one file, checking that the file holds every byte its header describes."""
        file = self.path / name
        size = file.stat().st_size
        if self.format == "bin":
            state = self._load_bin(name)
            self._digest = zlib.crc32(repr(sorted((k, tuple(v.shape)) for k, v in state.items())).encode(),
                                      zlib.crc32(str(size).encode(), self._digest))
            self._bin = None
            return {k: (tuple(v.shape), v.dtype) for k, v in state.items()}
        with open(file, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 <= n <= size - 8:
                raise self._unreadable(name, f"{name} is truncated or not safetensors: {size} bytes, and its first "
                                             f"8 bytes give a header of {n} bytes")
            raw = f.read(n)
        try:
            meta = json.loads(raw)
            tensors = {k: v for k, v in meta.items() if k != "__metadata__"}
            end = max((v["data_offsets"][1] for v in tensors.values()), default=0)
            found = {k: (tuple(v["shape"]), SAFETENSORS_DTYPES[v["dtype"]]) for k, v in tensors.items()}
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, IndexError, AttributeError) as exc:
            raise self._unreadable(name, f"{name} has no valid safetensors header ({type(exc).__name__}: {exc})")
        if 8 + n + end > size:
            raise self._unreadable(name, f"{name} is truncated: {size} bytes, its header describes {8 + n + end}")
        self._digest = zlib.crc32(raw, zlib.crc32(str(size).encode(), self._digest))
        return found

    def _unreadable(self, name: str, why: str) -> ConfigError:
        return ConfigError(f"hf_checkpoint={self.path}: cannot read the weights ({why})")

    def _load_bin(self, name: str) -> dict:
        if self._bin is None or self._bin[0] != name:
            self._bin = None
            try:
                try:
                    state = torch.load(self.path / name, map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError as exc:  # the legacy (non-zip) format cannot be mapped: read it whole
                    if "mmap" not in str(exc):
                        raise
                    state = torch.load(self.path / name, map_location="cpu", weights_only=True)
            except Exception as exc:  # a truncated or corrupt file: the reader's own message says what is wrong
                raise self._unreadable(name, f"{name}: {type(exc).__name__}: {exc}") from None
            self._bin = (name, state)
        return self._bin[1]

    # ---- the Mapping: names and whole tensors -------------------------------------------------------------------

    def __iter__(self):
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)

    def __contains__(self, key) -> bool:
        return key in self.where

    def __getitem__(self, key: str) -> torch.Tensor:
        """The whole tensor, in the file's dtype (a copy: no file stays mapped)."""
        if key not in self.where:
            raise KeyError(key)
        out = torch.empty(self.shapes[key], dtype=self.dtypes[key])
        self.fill(out, key)
        return out

    @property
    def fingerprint(self) -> int:
        """A checksum of the index and every header (and file size): ranks reading different files disagree."""
        return self._digest

    @property
    def total_bytes(self) -> int:
        return sum(torch.Size(s).numel() * self.dtypes[k].itemsize for k, s in self.shapes.items())

    # ---- slices ---------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def fill(self, dest: torch.Tensor, key: str, dim: int = 0, ranges: tuple[tuple[int, int], ...] | None = None,
             ) -> None:
        """dest <- the ranges [a, b) of `key` along `dim`, concatenated (ranges None: all of it), converted to
        dest's dtype. Only those bytes are copied out of the file."""
        shape = self.shapes[key]
        ranges = ((0, shape[dim] if shape else 1),) if ranges is None else ranges
        name = self.where[key]
        if self.format == "bin":
            tensor, offset = self._load_bin(name)[key], 0
            for a, b in ranges:
                piece = tensor.narrow(dim, a, b - a) if tensor.dim() else tensor
                dest.narrow(dim, offset, b - a).copy_(piece) if dest.dim() else dest.copy_(piece)
                offset += b - a
                self.bytes_read += piece.numel() * piece.element_size()
            return
        from safetensors import safe_open

        with safe_open(str(self.path / name), framework="pt") as f:
            view = f.get_slice(key)
            offset = 0
            for a, b in ranges:
                piece = view[:] if not shape else view[a:b] if dim == 0 else view[(slice(None),) * dim + (slice(a, b),)]
                (dest.narrow(dim, offset, b - a) if shape else dest).copy_(piece)
                offset += b - a
                self.bytes_read += piece.numel() * piece.element_size()
                del piece  # a view of the mapped file: drop it before the file is closed

    def close(self) -> None:
        """Unmap the .bin file held (safetensors files are never held between reads)."""
        self._bin = None
