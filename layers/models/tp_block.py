"""The transformer block split over p ranks, three ways.

v2 (Megatron pattern): column -> row for attention and for the MLP,
    2 all-reduces of [n, d] per block.
v1 (every matmul column-parallel): 4 all-gathers per block, of [n, k], [n, d],
    [n, ffn] and [n, d]. Kept to measure what pairing column with row saves.
intra_head (the counterfactual of seeds/03 §6): v2 with the QKV cut falling
    INSIDE every head; the partial Q·Kᵀ scores [h, n, n] must be all-reduced
    before softmax, a third collective that grows with n².
v2sp (sequence parallelism): v2 with each all-reduce split into a
    reduce-scatter (after the row-parallel linear) and an all-gather (before the
    next column-parallel one): between sub-layers each rank holds n/p rows, and
    LayerNorm and the residual adds run on those rows only. 4 collectives of
    [n, d] per block, the same bytes as v2's 2 all-reduces.

Every line of a forward that communicates is marked ★. LayerNorm, GeLU and the
residual adds run redundantly on every rank that holds the full tensor. The
`site` strings only name collectives for the traffic ledger (tp/ledger.py);
"dx" sites are the backward all-reduces of column-parallel input gradients.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from layers.attention.attention import PagedLayer, causal_attention
from layers.attention.varlen import Requests
from layers.models.config import ModelConfig
from layers.models.dense import DenseStack, Stack
from layers.models.families import of
from layers.models.llama import pad_rows
from layers.parallel.linear import ColumnParallelLinear, RowParallelLinear
from layers.parallel.shard import (DenseSource, Part, cols, even, head_aligned_cut, intra_head_cut, load_plan, prefixed,
                                   rows, whole)
from tp.partition import ceil_div, padded
from tp.comm import (copy_to_region, gather_from_region, gather_rows_from_region, gather_rows_to_parallel,
                     reduce_from_region, reduce_scatter_rows, scatter_rows_to_region)


class _TPBlockBase(nn.Module):
    """qkv and mlp_up column-parallel in every variant; attn_out and mlp_down of the variant's `second` kind."""

    def __init__(self, cfg: ModelConfig, group: dist.ProcessGroup, dtype, device, second: type, attn_site: str,
                 mlp_site: str):
        super().__init__()
        self.cfg = cfg
        self.group = group
        kw = dict(dtype=dtype, device=device)
        self.ln_1 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps, **kw)
        # Head-aligned: this rank's heads of Q, K and V, rows [Q_r | K_r | V_r].
        self.qkv = ColumnParallelLinear(cfg.d_model, 3 * cfg.k, group, site="attn/qkv dx", **kw)
        self.ln_2 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps, **kw)
        self.mlp_up = ColumnParallelLinear(cfg.d_model, cfg.d_ffn, group, site="mlp/mlp_up dx", **kw)
        self.attn_out = second(cfg.k, cfg.d_model, group, site=attn_site, **kw)
        self.mlp_down = second(cfg.d_ffn, cfg.d_model, group, site=mlp_site, **kw)

    def plan(self) -> list[Part]:
        """Which slice of the dense block's parameters each of this rank's holds (the rules:
        layers/parallel/shard.py)."""
        c, r, p = self.cfg, dist.get_rank(self.group), dist.get_world_size(self.group)
        qkv, up = head_aligned_cut(c.n_heads, c.d_head, r, p), rows(even(c.d_ffn, r, p))
        return whole("ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias") + [
            Part("qkv.weight", "qkv.weight", qkv), Part("qkv.bias", "qkv.bias", qkv),
            Part("mlp_up.weight", "mlp_up.weight", up), Part("mlp_up.bias", "mlp_up.bias", up)] + self._outputs(r, p)


class TPBlockV2(_TPBlockBase):
    """Megatron pattern: QKV column -> attention (local heads) -> out-proj row; up column -> down row."""

    def __init__(self, cfg: ModelConfig, group: dist.ProcessGroup, dtype=torch.float32, device=None):
        super().__init__(cfg, group, dtype, device, RowParallelLinear, "attn/all-reduce #1", "mlp/all-reduce #2")

    def forward(self, x: torch.Tensor, requests: Requests | None = None) -> torch.Tensor:  # x: [n, d] on every rank
        a = causal_attention(self.qkv(self.ln_1(x)), self.cfg.d_head, requests)  # [n, k/p]: this rank's heads
        x = x + self.attn_out(a)  # ★ all-reduce #1: partial [n, d] summed over ranks, then + bias
        h = F.gelu(self.mlp_up(self.ln_2(x)), approximate="tanh")  # [n, ffn/p]
        return x + self.mlp_down(h)  # ★ all-reduce #2: partial [n, d] summed over ranks, then + bias

    def _outputs(self, r: int, p: int) -> list[Part]:  # row-parallel: input columns; the biases stay whole
        c = self.cfg
        return [Part("attn_out.weight", "attn_out.weight", cols(even(c.k, r, p))), *whole("attn_out.bias"),
                Part("mlp_down.weight", "mlp_down.weight", cols(even(c.d_ffn, r, p))), *whole("mlp_down.bias")]


class TPBlockV1(_TPBlockBase):
    """Every matmul column-parallel: a full input is needed after each one, so gather four times."""

    def __init__(self, cfg: ModelConfig, group: dist.ProcessGroup, dtype=torch.float32, device=None):
        super().__init__(cfg, group, dtype, device, ColumnParallelLinear, "attn/attn_out dx", "mlp/mlp_down dx")

    def forward(self, x: torch.Tensor, requests: Requests | None = None) -> torch.Tensor:  # x: [n, d] on every rank
        g = self.group
        a = causal_attention(self.qkv(self.ln_1(x)), self.cfg.d_head, requests)  # [n, k/p]: this rank's heads
        a = gather_from_region(a, g, "attn/gather #1")  # ★ gather #1: [n, k], out-proj needs every head
        o = gather_from_region(self.attn_out(a), g, "attn/gather #2")  # ★ gather #2: [n, d/p] -> [n, d]
        x = x + o
        h = F.gelu(self.mlp_up(self.ln_2(x)), approximate="tanh")  # [n, ffn/p]
        h = gather_from_region(h, g, "mlp/gather #3")  # ★ gather #3: [n, ffn], FFN-down needs all of it
        return x + gather_from_region(self.mlp_down(h), g, "mlp/gather #4")  # ★ gather #4: [n, d/p] -> [n, d]

    def _outputs(self, r: int, p: int) -> list[Part]:  # column-parallel: output rows, and their biases
        out = rows(even(self.cfg.d_model, r, p))
        return [Part(f"{name}.{t}", f"{name}.{t}", out) for name in ("attn_out", "mlp_down") for t in ("weight", "bias")]


class TPBlockIntraHead(TPBlockV2):
    """v2 with the QKV cut inside every head: rank r holds dims [r·dh/p, (r+1)·dh/p) of all h heads."""

    def forward(self, x: torch.Tensor, requests: Requests | None = None) -> torch.Tensor:  # x: [n, d] on every rank
        if isinstance(requests, PagedLayer):
            raise ValueError("intra_head is a counterfactual of one forward; serving runs v1 or v2")
        if requests is not None and requests.padded:
            raise ValueError("intra_head runs one sequence or varlen requests, not the padded baseline")
        g, h, spans = self.group, self.cfg.n_heads, requests.spans if requests else [(0, x.shape[0])]
        q, k, v = rearrange(self.qkv(self.ln_1(x)), "n (three h d) -> three h n d", three=3, h=h)  # d = d_head/p
        # Every request's [h, L, L] block of partial Q·Kᵀ (from this rank's dims only), flattened side by side.
        sizes = [(e - s) ** 2 for s, e in spans]
        partial = torch.cat([(q[:, s:e] @ k[:, s:e].transpose(-1, -2)).flatten(1) for s, e in spans], dim=1)
        scores = reduce_from_region(partial / math.sqrt(self.cfg.d_head), g, "attn/scores all-reduce")  # ★ [h, Σ L²]
        probs = []
        for (s, e), block in zip(spans, scores.split(sizes, dim=1)):  # softmax is nonlinear: needs full scores
            causal = torch.ones(e - s, e - s, dtype=torch.bool, device=x.device).triu(1)
            probs.append(torch.softmax(block.view(h, e - s, e - s).masked_fill(causal, float("-inf")), -1).flatten(1))
        probs = copy_to_region(torch.cat(probs, dim=1), g, "attn/probs dP")  # backward all-reduces dP
        a = torch.cat([pr.view(h, e - s, e - s) @ v[:, s:e]
                       for (s, e), pr in zip(spans, probs.split(sizes, dim=1))], dim=1)  # [h, n, d_head/p]
        x = x + self.attn_out(rearrange(a, "h n d -> n (h d)"))  # ★ all-reduce #1
        hidden = F.gelu(self.mlp_up(self.ln_2(x)), approximate="tanh")  # [n, ffn/p]
        return x + self.mlp_down(hidden)  # ★ all-reduce #2

    def plan(self) -> list[Part]:
        c, r, p = self.cfg, dist.get_rank(self.group), dist.get_world_size(self.group)
        inside = {"qkv.weight": intra_head_cut(c.n_heads, c.d_head, r, p, parts=3, dim=0),
                  "qkv.bias": intra_head_cut(c.n_heads, c.d_head, r, p, parts=3, dim=0),
                  "attn_out.weight": intra_head_cut(c.n_heads, c.d_head, r, p, parts=1, dim=1)}
        return [Part(part.param, part.source, inside[part.param]) if part.param in inside else part
                for part in super().plan()]


class TPBlockV2SP(TPBlockV2):
    """v2 with sequence parallelism: x is this rank's n'/p rows (n' = n padded up to a multiple of p, SPStack).

    The LayerNorm parameters and the row-parallel biases act on this rank's rows only, so their gradients are
    partial sums over rows: each sub-layer passes them through copy_to_region (forward identity, backward one
    all-reduce of [3d]) at the line that uses them."""

    def forward(self, x: torch.Tensor, requests: Requests | None = None, n: int | None = None) -> torch.Tensor:
        if isinstance(requests, PagedLayer):
            raise ValueError("v2sp cuts one forward (training-style); serving runs v1 or v2")
        g, d, eps = self.group, self.cfg.d_model, self.cfg.ln_eps
        n = x.shape[0] * dist.get_world_size(g) if n is None else n  # real rows; the rest is padding
        ln_w, ln_b, out_b = copy_to_region(torch.cat([self.ln_1.weight, self.ln_1.bias, self.attn_out.bias]), g,
                                           "attn/norm+bias dw").split(d)  # backward: all-reduce of [3d]
        h = gather_rows_to_parallel(F.layer_norm(x, (d,), ln_w, ln_b, eps), g, "attn/all-gather #1")  # ★ [n', d]
        # no copy_to_region before the column-parallel matmul: the gather's backward reduce-scatters dX
        a = causal_attention(F.linear(h[:n], self.qkv.weight, self.qkv.bias), self.cfg.d_head, requests)  # [n, k/p]
        partial = pad_rows(F.linear(a, self.attn_out.weight), h.shape[0])  # [n', d] partial sums, padding rows 0
        x = x + reduce_scatter_rows(partial, g, "attn/reduce-scatter #1") + out_b  # ★ reduce-scatter: [n'/p, d]
        ln_w, ln_b, down_b = copy_to_region(torch.cat([self.ln_2.weight, self.ln_2.bias, self.mlp_down.bias]), g,
                                            "mlp/norm+bias dw").split(d)
        h = gather_rows_to_parallel(F.layer_norm(x, (d,), ln_w, ln_b, eps), g, "mlp/all-gather #2")  # ★ [n', d]
        hidden = F.gelu(F.linear(h[:n], self.mlp_up.weight, self.mlp_up.bias), approximate="tanh")  # [n, ffn/p]
        partial = pad_rows(F.linear(hidden, self.mlp_down.weight), h.shape[0])  # [n', d] partial sums
        return x + reduce_scatter_rows(partial, g, "mlp/reduce-scatter #2") + down_b  # ★ reduce-scatter: [n'/p, d]


class TPStack(Stack):
    """L tensor-parallel blocks of one variant; every rank returns the same full [n, d] outputs."""

    def plan(self) -> list[Part]:
        """Every block's slices of the dense stack's parameters (blocks.<i>.<name> on both sides)."""
        return [part for i, block in enumerate(self.blocks) for part in prefixed(block.plan(), f"blocks.{i}.")]

    def output(self, outs: tuple[torch.Tensor, ...], n: int) -> torch.Tensor:
        """The stack's replicated output [n, d] from forward's per-layer outputs."""
        return outs[-1]

    def rows_held(self, n: int) -> tuple[int, int]:
        """[lo, hi): the rows of each layer's output this rank holds (all of them)."""
        return 0, n


class SPStack(TPStack):
    """L v2sp blocks. forward takes the replicated [n, d] (n ≥ p), pads it to n' = p·⌈n/p⌉ rows and keeps this
    rank's n'/p (scatter_rows_to_region: no communication; backward all-gathers dx, "stack/scatter input");
    it returns every layer's output as this rank's rows [n'/p, d] (rows `rows_held(n)` of the n real ones). The
    padding rows come last, so no real row attends to them (attention is causal).
    `gather(out, n)` all-gathers one back to the replicated [n, d] ("stack/gather output", outside any block)."""

    def forward(self, x: torch.Tensor, cu_seqlens=None, padded: bool = False) -> tuple[torch.Tensor, ...]:
        if padded:
            raise ValueError("v2sp runs one sequence or varlen requests, not the padded baseline")
        n, p = x.shape[0], dist.get_world_size(self.blocks[0].group)
        if n < p:
            raise ValueError(f"v2sp needs at least one row per rank: T={n} tokens over p={p} ranks")
        return super().forward(x, cu_seqlens)  # attention sees all n rows; each block takes this rank's n'/p

    def layer(self, block: nn.Module, x: torch.Tensor, requests, n: int) -> torch.Tensor:
        return block(x, requests, n)  # the real rows: the rest of the n' is padding

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """[n, d] replicated -> this rank's n'/p rows of the padded [n', d] (no communication; backward all-gathers)."""
        g = self.blocks[0].group
        return scatter_rows_to_region(pad_rows(x, padded(x.shape[0], dist.get_world_size(g))), g, "stack/scatter input")

    def gather(self, rows: torch.Tensor, n: int) -> torch.Tensor:
        """This rank's [n'/p, d] -> the replicated [n, d]: ★ one all-gather (backward: split)."""
        return gather_rows_from_region(rows, self.blocks[0].group, "stack/gather output")[:n]

    def output(self, outs: tuple[torch.Tensor, ...], n: int) -> torch.Tensor:
        return self.gather(outs[-1], n)

    def rows_held(self, n: int) -> tuple[int, int]:
        """[lo, hi): the real rows this rank holds (hi - lo < n'/p on the last ranks when n % p != 0)."""
        g = self.blocks[0].group
        per = ceil_div(n, dist.get_world_size(g))  # n'/p
        lo = dist.get_rank(g) * per
        return min(lo, n), min(lo + per, n)


def tp_stack(cfg, variant: str, group: dist.ProcessGroup, dtype: torch.dtype, device,
             n_layers: int | None = None, moe_parallel: str = "tp") -> TPStack:
    """The `variant` TP stack of cfg's family (n_layers blocks, default cfg.n_layers; an MoE family's experts placed
    by moe_parallel), its parameters not yet loaded: load_plan fills them."""
    family = of(cfg)
    if variant not in family.variants:
        raise ValueError(f"no {variant!r} TP block for the {cfg.family} family; it has {', '.join(family.variants)}")
    blocks = family.tp_blocks(cfg, variant, group, dtype, device, moe_parallel, n_layers)
    return (SPStack if variant == "v2sp" else TPStack)(cfg, blocks)


def shard_stack(dense: DenseStack, variant: str, group: dist.ProcessGroup) -> TPStack:
    """Load dense, then shard: the `variant` TP stack holding this rank's slices of `dense`'s weights."""
    source = DenseSource(dense)
    stack = tp_stack(dense.cfg, variant, group, source.dtype, source.device, len(dense.blocks))
    return load_plan(stack, stack.plan(), source)
