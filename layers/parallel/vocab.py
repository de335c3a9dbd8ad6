"""The token embedding and the LM head tied to it: vocab-parallel (Megatron) or replicated.

Vocab-parallel: the vocabulary V is padded up to V' (a multiple of p) and rank r
holds embedding rows [r·V'/p, (r+1)·V'/p):

    wte [V' x d]      rank 0: ids 0 .. V'/p-1      rank 1: ids V'/p .. 2V'/p-1   ...   (padding rows at the end)

  lookup   ids outside this rank's slice give zero rows; ★ one all-reduce of [T, d] sums the p slices.
  LM head  x [S, d] @ wte_rᵀ -> local logits [S, V'/p] (padded ids set to -inf, so they never win);
           layers/sampling/sampler.py picks the token from the slices: greedy keeps each rank's (max, argmax) per
           row; ★ one all-gather of those pairs, [S, 2] per rank, and every rank picks the same winner:
           the largest value, ties to the lowest rank and so to the lowest token id, exactly as
           torch.argmax over the full row. The full [S, V] logits never exist anywhere.

Replicated (the baseline for bytes and memory): every rank holds all of wte; lookup and
head are local, no collective, V·d weights per rank instead of V'·d/p.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from layers.parallel.shard import DenseSource, Part, load_plan, rows
from layers.parallel.weight_format import embedding, linear
from tp.comm import reduce_from_region
from tp.partition import padded


def padded_vocab(vocab_size: int, p: int) -> int:
    """V' = V rounded up to a multiple of p (GPT-2: 50257 -> 50258 at p = 2, 50264 at p = 8)."""
    return padded(vocab_size, p)


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the token embedding; also the tied LM head (`local_logits`)."""

    def __init__(self, vocab_size: int, d_model: int, group: dist.ProcessGroup, dtype=None, device=None):
        super().__init__()
        self.group = group
        self.head_group = group  # what the head's pick gathers over (layers/sampling/sampler.py)
        p, rank = dist.get_world_size(group), dist.get_rank(group)
        self.vocab_size = vocab_size
        self.per_rank = padded_vocab(vocab_size, p) // p
        self.start = rank * self.per_rank  # first token id this rank holds
        self.n_real = max(0, min(self.per_rank, vocab_size - self.start))  # the rest of the slice is padding
        self.weight = nn.Parameter(torch.zeros(self.per_rank, d_model, dtype=dtype, device=device))
        self.register_buffer("scales", None)  # int8 codes' per-row scales (layers/parallel/weight_format.py)
        self.fused = False  # the head's product may run decode's compiled kernels (weight_format.prepare sets it)
        self.tile_rows = None  # batch_invariant: the head's product in tiles of rows (weight_format.prepare)

    def plan(self, source: str) -> list[Part]:
        """Rows [start, start + n_real) of the dense [V, d] tensor `source`, then zero rows up to V'/p."""
        real = [Part("weight", source, rows((self.start, self.start + self.n_real)))] if self.n_real else []
        pad = self.per_rank - self.n_real
        return real + ([Part("weight", None, rows((0, pad)), row=self.n_real)] if pad else [])

    def load_dense(self, weight: torch.Tensor) -> "VocabParallelEmbedding":
        """weight: the dense [V, d] embedding; padding rows stay zero."""
        return load_plan(self, self.plan("weight"), DenseSource({"weight": weight}))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: [T]
        local = ids - self.start
        outside = (local < 0) | (local >= self.n_real)
        rows = embedding(local.masked_fill(outside, 0), self.weight, self.scales)
        rows = rows.masked_fill(outside[:, None], 0)  # [T, d]
        return reduce_from_region(rows, self.group, "embed/all-reduce")  # ★ all-reduce: [T, d], every rank

    def local_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The tied LM head on this rank's slice: x [S, d] final hidden rows -> logits [S, V'/p] (padding ids -inf,
        so they never win). The full [S, V] logits never exist: layers/sampling/sampler.py picks from the slices."""
        logits = linear(x, self.weight, self.scales, fused=self.fused, tile=self.tile_rows)  # [S, V'/p]
        logits[:, self.n_real:] = float("-inf")
        return logits


class ReplicatedEmbedding(nn.Module):
    """Every rank holds the whole [V, d] embedding: lookup and LM head without communication."""

    def __init__(self, vocab_size: int, d_model: int, dtype=None, device=None):
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.zeros(vocab_size, d_model, dtype=dtype, device=device))
        self.register_buffer("scales", None)
        self.fused = False
        self.tile_rows = None

    def plan(self, source: str) -> list[Part]:
        return [Part("weight", source)]

    load_dense = VocabParallelEmbedding.load_dense  # weight: the dense [V, d] embedding, whole here

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, d]
        return embedding(ids, self.weight, self.scales)

    start = 0  # the whole vocabulary is here

    def local_logits(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.scales, fused=self.fused, tile=self.tile_rows)  # [S, V]

    head_group = None  # nothing to gather: the pick is local
