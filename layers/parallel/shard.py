"""Which slice of each dense weight a rank holds: the one place that says it.

Every tensor-parallel module lists its parameters as `Part`s: "rows `row`.. of my parameter `param` are the
`cut` of the dense parameter `source`". Two loaders read those lists, so they cannot disagree:

    load dense, then shard   DenseSource: cut the dense model's tensors (run_block's check, random weights)
    per-rank, lazily         layers/models/hf.CheckpointSource: read only those slices from the checkpoint files

A Cut is ranges along one dimension of the dense [out, in] (nn.Linear) layout, concatenated in order:

    column-parallel    rows   [r·out/p, (r+1)·out/p)          (and the bias's)
    row-parallel       cols   [r·in/p, (r+1)·in/p)            (the bias stays whole)
    head-aligned QKV   rows   of rank r's heads in Q, in K, in V (three ranges: NOT the contiguous slice)
    vocab-parallel     rows   [r·V'/p, r·V'/p + real) of the [V, d] embedding; the padding rows are zeros
    replicated         the whole tensor (norms, position embeddings, row-parallel biases)

The model code does not know it is parallel; these rules decide which slice each rank holds, so both sides of
the equivalence check use the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class Cut:
    """Ranges [a, b) along `dim` of a dense tensor, concatenated in order; ranges None: the whole tensor."""

    dim: int = 0
    ranges: tuple[tuple[int, int], ...] | None = None

    def shape(self, full: tuple[int, ...]) -> tuple[int, ...]:
        if self.ranges is None:
            return tuple(full)
        out = list(full)
        out[self.dim] = sum(b - a for a, b in self.ranges)
        return tuple(out)

    def of(self, t: torch.Tensor) -> torch.Tensor:
        """This cut of a dense tensor (a copy when it is several ranges)."""
        if self.ranges is None:
            return t
        pieces = [t.narrow(self.dim, a, b - a) for a, b in self.ranges]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, self.dim)


WHOLE = Cut()


def rows(*ranges: tuple[int, int]) -> Cut:
    return Cut(0, tuple(ranges))


def cols(*ranges: tuple[int, int]) -> Cut:
    return Cut(1, tuple(ranges))


def even(features: int, rank: int, p: int, what: str = "features") -> tuple[int, int]:
    """Rank r's range of an even split of `features` over p ranks."""
    n = per_rank(features, p, what)
    return rank * n, (rank + 1) * n


def heads_range(heads: range, d_head: int, offset: int = 0) -> tuple[int, int]:
    """The contiguous rows (or columns) of heads [start, stop) in a [heads·d_head, ...] layout."""
    return offset + heads.start * d_head, offset + heads.stop * d_head


def head_aligned_cut(n_heads: int, d_head: int, rank: int, p: int) -> Cut:
    """Fused GPT-2 QKV [3k, d], rows [Q | K | V] -> rank r's heads of Q, of K and of V, re-fused.

        dense rows:  Q: h0 h1 .. h7 | K: h0 h1 .. h7 | V: h0 h1 .. h7
        rank 0 of 2: Q: h0 .. h3    | K: h0 .. h3    | V: h0 .. h3      -> [3k/p, d]
        rank 1 of 2: Q: h4 .. h7    | K: h4 .. h7    | V: h4 .. h7

    This is NOT the contiguous slice weight[r*3k/p : (r+1)*3k/p], which for p=2
    would hand rank 0 all of Q and half of K.
    """
    if n_heads % p:
        raise ValueError(f"n_heads={n_heads} is not divisible by {p} ranks")
    mine = heads_of_rank(n_heads, rank, p)
    return rows(*(heads_range(mine, d_head, part * n_heads * d_head) for part in range(3)))


def intra_head_cut(n_heads: int, d_head: int, rank: int, p: int, parts: int, dim: int) -> Cut:
    """The counterfactual cut INSIDE heads: dims [r·dh/p, (r+1)·dh/p) of every head of each of `parts` fused
    tensors, along `dim` (QKV: 3 parts, rows; the output projection: 1 part, columns)."""
    a, b = even(d_head, rank, p, "d_head")
    return Cut(dim, tuple((base + h * d_head + a, base + h * d_head + b)
                          for base in range(0, parts * n_heads * d_head, n_heads * d_head) for h in range(n_heads)))


@dataclass(frozen=True)
class Part:
    """Rows [row, row + rows of the cut) of the TP module's parameter `param` are `cut` of the dense parameter
    `source`; source None: those rows are zeros (the vocabulary's padding)."""

    param: str
    source: str | None
    cut: Cut = WHOLE
    row: int = 0

    def prefixed(self, param: str, source: str) -> "Part":
        return Part(param + self.param, None if self.source is None else source + self.source, self.cut, self.row)


def whole(*names: str) -> list[Part]:
    """Replicated parameters: the same name on both sides, the whole tensor."""
    return [Part(name, name) for name in names]


def prefixed(plan: list[Part], param: str, source: str | None = None) -> list[Part]:
    return [part.prefixed(param, param if source is None else source) for part in plan]


class Source(Protocol):
    """Where a plan's dense tensors come from: their shapes, and a copy of a cut of one into a destination."""

    def shape(self, name: str) -> tuple[int, ...]: ...

    def fill(self, dest: torch.Tensor, name: str, cut: Cut) -> None: ...


class DenseSource:
    """Load dense, then shard: the cuts of a dense module's parameters (or of a dict of dense tensors)."""

    def __init__(self, dense: torch.nn.Module | dict[str, torch.Tensor]):
        self.dense = dense
        if isinstance(dense, torch.nn.Module):
            self.cfg = getattr(dense, "cfg", None)
            param = next(dense.parameters())
            self.dtype, self.device = param.dtype, param.device

    def tensor(self, name: str) -> torch.Tensor:
        return self.dense[name] if isinstance(self.dense, dict) else self.dense.get_parameter(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensor(name).shape)

    def fill(self, dest: torch.Tensor, name: str, cut: Cut) -> None:
        dest.copy_(cut.of(self.tensor(name)))


@torch.no_grad()
def load_plan(module: torch.nn.Module, plan: list[Part], source: Source) -> torch.nn.Module:
    """Copy every Part of `plan` from `source` into `module`. Every parameter must be covered row by row exactly
    once (a ValueError names the first row left uninitialised or written twice): a plan cannot silently leave a
    slice of torch.empty behind, nor write one slice over another."""
    params = dict(module.named_parameters())
    covered = {name: torch.zeros(p.shape[0], dtype=torch.bool) for name, p in params.items()}
    for part in plan:
        if part.param not in params:
            raise ValueError(f"the plan names {part.param!r}, which {type(module).__name__} does not have")
        param = params[part.param]
        if part.source is None:  # zero rows
            n = part.cut.ranges[0][1] - part.cut.ranges[0][0]
            if part.row + n > param.shape[0]:
                raise ValueError(f"zero rows {part.row}..{part.row + n} do not fit {part.param} {tuple(param.shape)}")
            param.narrow(0, part.row, n).zero_()
        else:
            want = part.cut.shape(source.shape(part.source))
            n = want[0]
            if part.row + n > param.shape[0] or tuple(param.shape[1:]) != want[1:]:
                raise ValueError(f"{part.source}: the slice {want} does not fit {part.param} "
                                 f"{tuple(param.shape)} at row {part.row}")
            source.fill(param.narrow(0, part.row, n), part.source, part.cut)
        rows = covered[part.param][part.row:part.row + n]
        if rows.any():
            raise ValueError(f"the plan writes rows of {part.param} twice (from row {part.row}, {part.source})")
        rows.fill_(True)
    short = next((name for name, rows in covered.items() if not bool(rows.all())), None)
    if short is not None:
        raise ValueError(f"the plan leaves {int((~covered[short]).sum())} of {covered[short].numel()} rows of "
                         f"{short} unset")
    return module


# ---- the same rules on tensors (load dense, then shard one weight) -----------------------------------------------


def column_shard(weight: torch.Tensor, bias: torch.Tensor | None, rank: int, p: int):
    """nn.Linear weight [out, in]: rank r keeps output rows [r*out/p, (r+1)*out/p) and their bias."""
    cut = rows(even(weight.shape[0], rank, p, "out_features"))
    return cut.of(weight), None if bias is None else cut.of(bias)


def row_shard(weight: torch.Tensor, bias: torch.Tensor | None, rank: int, p: int):
    """nn.Linear weight [out, in]: rank r keeps input columns [r*in/p, (r+1)*in/p); the bias stays whole."""
    return cols(even(weight.shape[1], rank, p, "in_features")).of(weight), bias


def qkv_head_aligned_shard(weight: torch.Tensor, bias: torch.Tensor | None, n_heads: int, rank: int, p: int):
    """head_aligned_cut of a fused [3k, d] QKV weight and its bias."""
    cut = head_aligned_cut(n_heads, weight.shape[0] // (3 * n_heads), rank, p)
    return cut.of(weight), None if bias is None else cut.of(bias)


def per_rank(features: int, p: int, what: str) -> int:
    """features / p, or a ValueError naming the numbers."""
    if features % p:
        raise ValueError(f"{what}={features} is not divisible by {p} ranks")
    return features // p


def heads_of_rank(n_heads: int, rank: int, p: int) -> range:
    hp = n_heads // p
    return range(rank * hp, (rank + 1) * hp)
