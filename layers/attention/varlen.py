"""Many requests in one forward: a flat [T, d] token tensor and the request boundaries (cu_seqlens).

    requests A (10 tokens) and B (30 tokens)  ->  x: [40, d],  cu_seqlens = [0, 10, 40]

Linears and pointwise ops do not care where one request ends: they act per token.
Only attention uses the boundaries: each request attends causally within itself.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from tp.dist import ConfigError, same_on_every_rank


@dataclass(frozen=True)
class Requests:
    """Where each request's rows lie in the flat token tensor.

    padded=True selects the baseline kept for comparison: attention pads every
    request to the longest and masks, instead of computing each request alone.
    """

    cu_seqlens: tuple[int, ...]
    padded: bool = False
    flash: bool = False  # each request's causal attention through FlashAttention-2's forward and backward (training)
    invariant: bool = False  # with flash: the tiles padded as the engine's batch_invariant mode pads them

    @property
    def spans(self) -> list[tuple[int, int]]:
        return list(zip(self.cu_seqlens[:-1], self.cu_seqlens[1:]))

    @property
    def lengths(self) -> list[int]:
        return [e - s for s, e in self.spans]

    @property
    def n_tokens(self) -> int:
        return self.cu_seqlens[-1]

    @classmethod
    def from_lengths(cls, lengths, padded: bool = False, flash: bool = False, invariant: bool = False) -> "Requests":
        return cls(tuple(itertools.accumulate((int(n) for n in lengths), initial=0)), padded, flash or invariant,
                   invariant)


def check_cu_seqlens(cu_seqlens, n_tokens: int, max_seq_len: int) -> tuple[int, ...]:
    """Validate request boundaries without communicating; return them as a tuple of ints.

    Integer dtype, one dimension, starts at 0, strictly increasing (an empty request
    is an error), ends at n_tokens, and no request longer than max_seq_len.
    """
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex or cu_seqlens.dtype == torch.bool:
            raise ConfigError(f"cu_seqlens must be an integer tensor (int32 or int64), got {cu_seqlens.dtype}")
        if cu_seqlens.dim() != 1:
            raise ConfigError(f"cu_seqlens must be one-dimensional, got shape {tuple(cu_seqlens.shape)}")
        values = [int(v) for v in cu_seqlens.tolist()]
    else:
        values = list(cu_seqlens)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise ConfigError(f"cu_seqlens must hold integers, got {values}")
    if len(values) < 2:
        raise ConfigError(f"cu_seqlens={values} needs at least two entries: [0, ..., n_tokens]")
    if values[0] != 0:
        raise ConfigError(f"cu_seqlens must start at 0, got {values[0]} (cu_seqlens={_short(values)})")
    for i, (a, b) in enumerate(zip(values[:-1], values[1:])):
        if b <= a:
            raise ConfigError(f"cu_seqlens must be strictly increasing: request {i} spans [{a}, {b}) "
                              f"(an empty request is an error; cu_seqlens={_short(values)})")
        if b - a > max_seq_len:
            raise ConfigError(f"request {i} has {b - a} tokens, more than max_seq_len={max_seq_len}")
    if values[-1] != n_tokens:
        raise ConfigError(f"cu_seqlens must end at the number of tokens {n_tokens}, got {values[-1]} "
                          f"(cu_seqlens={_short(values)})")
    return tuple(values)


def check_same_on_every_rank(cu_seqlens: tuple[int, ...], group) -> None:
    """Raise ConfigError on every rank unless all ranks hold the same boundaries (one small all-gather).

    Call it before the first block: ranks that disagree would still issue matching
    collectives (same T) and silently compute garbage.
    """
    cu = torch.tensor(cu_seqlens, dtype=torch.float64)
    ramp = torch.arange(1, len(cu) + 1, dtype=torch.float64)
    fingerprint = torch.stack([torch.tensor(float(len(cu))), cu.sum(), (cu * ramp).sum()])  # moved to the group's device
    if not same_on_every_rank(fingerprint, group):
        raise ConfigError("cu_seqlens differ between ranks: every rank must pass the same request boundaries")


def _short(values: list[int]) -> str:
    return str(values) if len(values) <= 12 else f"[{values[0]}, {values[1]}, ..., {values[-1]}] ({len(values)} entries)"


def score_entries(lengths: list[int], layout: str) -> int:
    """Q·Kᵀ entries one head computes in one layer (causal masking does not skip work in SDPA's math).

    varlen: each request alone, Σ Lᵢ²; flat_masked: one [T, T] square with the
    cross-request blocks masked, (Σ Lᵢ)²; padded: R requests padded to the longest, R·max².
    """
    if layout == "varlen":
        return sum(n * n for n in lengths)
    if layout == "flat_masked":
        return sum(lengths) ** 2
    if layout == "padded":
        return len(lengths) * max(lengths) ** 2
    raise ValueError(f"unknown layout {layout!r}")
