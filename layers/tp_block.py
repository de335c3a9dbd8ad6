"""The transformer block split over p ranks, two ways.

v2 (Megatron pattern): column -> row for attention and for the MLP,
    2 all-reduces of [n, d] per block.
v1 (every matmul column-parallel): 4 all-gathers per block, of [n, k], [n, d],
    [n, ffn] and [n, d]. Kept to measure what pairing column with row saves.

Every line of a forward that communicates is marked ★. LayerNorm, GeLU and the
residual adds run redundantly on every rank that holds the full tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from layers.attention import causal_attention
from layers.config import ModelConfig
from layers.dense import DenseBlock, DenseStack, Stack
from layers.linear import ColumnParallelLinear, RowParallelLinear
from layers.shard import column_shard, load_, qkv_head_aligned_shard, row_shard
from tp.comm import gather_from_region


class _TPBlockBase(nn.Module):
    def __init__(self, cfg: ModelConfig, group: dist.ProcessGroup, dtype, device):
        super().__init__()
        self.cfg = cfg
        self.group = group
        kw = dict(dtype=dtype, device=device)
        self.ln_1 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps, **kw)
        # Head-aligned: this rank's heads of Q, K and V, rows [Q_r | K_r | V_r].
        self.qkv = ColumnParallelLinear(cfg.d_model, 3 * cfg.k, group, **kw)
        self.ln_2 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps, **kw)
        self.mlp_up = ColumnParallelLinear(cfg.d_model, cfg.d_ffn, group, **kw)

    def _load_common(self, dense: DenseBlock, rank: int, p: int) -> None:
        self.ln_1.load_state_dict(dense.ln_1.state_dict())
        self.ln_2.load_state_dict(dense.ln_2.state_dict())
        load_(self.qkv, *qkv_head_aligned_shard(dense.qkv.weight, dense.qkv.bias, self.cfg.n_heads, rank, p))
        load_(self.mlp_up, *column_shard(dense.mlp_up.weight, dense.mlp_up.bias, rank, p))


class TPBlockV2(_TPBlockBase):
    """Megatron pattern: QKV column -> attention (local heads) -> out-proj row; up column -> down row."""

    def __init__(self, cfg: ModelConfig, group: dist.ProcessGroup, dtype=torch.float32, device=None):
        super().__init__(cfg, group, dtype, device)
        kw = dict(dtype=dtype, device=device)
        self.attn_out = RowParallelLinear(cfg.k, cfg.d_model, group, input_is_parallel=True, **kw)
        self.mlp_down = RowParallelLinear(cfg.d_ffn, cfg.d_model, group, input_is_parallel=True, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [n, d], identical on every rank
        a = causal_attention(self.qkv(self.ln_1(x)), self.cfg.d_head)  # [n, k/p]: this rank's heads only
        x = x + self.attn_out(a)  # ★ all-reduce #1: partial [n, d] summed over ranks, then + bias
        h = F.gelu(self.mlp_up(self.ln_2(x)), approximate="tanh")  # [n, ffn/p]
        return x + self.mlp_down(h)  # ★ all-reduce #2: partial [n, d] summed over ranks, then + bias

    @torch.no_grad()
    def load_dense(self, dense: DenseBlock) -> "TPBlockV2":
        rank, p = dist.get_rank(self.group), dist.get_world_size(self.group)
        self._load_common(dense, rank, p)
        load_(self.attn_out, *row_shard(dense.attn_out.weight, dense.attn_out.bias, rank, p))
        load_(self.mlp_down, *row_shard(dense.mlp_down.weight, dense.mlp_down.bias, rank, p))
        return self


class TPBlockV1(_TPBlockBase):
    """Every matmul column-parallel: a full input is needed after each one, so gather four times."""

    def __init__(self, cfg: ModelConfig, group: dist.ProcessGroup, dtype=torch.float32, device=None):
        super().__init__(cfg, group, dtype, device)
        kw = dict(dtype=dtype, device=device)
        self.attn_out = ColumnParallelLinear(cfg.k, cfg.d_model, group, **kw)
        self.mlp_down = ColumnParallelLinear(cfg.d_ffn, cfg.d_model, group, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [n, d], identical on every rank
        g = self.group
        a = causal_attention(self.qkv(self.ln_1(x)), self.cfg.d_head)  # [n, k/p]: this rank's heads only
        a = gather_from_region(a, g)  # ★ gather #1: [n, k], out-proj needs every head
        o = gather_from_region(self.attn_out(a), g)  # ★ gather #2: [n, d/p] -> [n, d] for the residual
        x = x + o
        h = F.gelu(self.mlp_up(self.ln_2(x)), approximate="tanh")  # [n, ffn/p]
        h = gather_from_region(h, g)  # ★ gather #3: [n, ffn], FFN-down needs the full hidden
        return x + gather_from_region(self.mlp_down(h), g)  # ★ gather #4: [n, d/p] -> [n, d]

    @torch.no_grad()
    def load_dense(self, dense: DenseBlock) -> "TPBlockV1":
        rank, p = dist.get_rank(self.group), dist.get_world_size(self.group)
        self._load_common(dense, rank, p)
        load_(self.attn_out, *column_shard(dense.attn_out.weight, dense.attn_out.bias, rank, p))
        load_(self.mlp_down, *column_shard(dense.mlp_down.weight, dense.mlp_down.bias, rank, p))
        return self


BLOCKS = {"v1": TPBlockV1, "v2": TPBlockV2}


class TPStack(Stack):
    """L tensor-parallel blocks of one variant; every rank returns the same full [n, d] outputs."""


def shard_stack(dense: DenseStack, variant: str, group: dist.ProcessGroup) -> TPStack:
    """Build the `variant` TP stack holding this rank's slices of `dense`'s weights."""
    param = next(dense.parameters())
    cls = BLOCKS[variant]
    return TPStack(dense.cfg, [cls(dense.cfg, group, param.dtype, param.device).load_dense(b) for b in dense.blocks])
