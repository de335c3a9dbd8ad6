"""Llama-family blocks on the same TP machinery: RMSNorm, rotary positions, SwiGLU, grouped-query attention.

    x -> RMSNorm -> q [d -> h·dh], k, v [d -> h_kv·dh] -> RoPE(q, k) -> causal GQA -> o [h·dh -> d] -> +x
      -> RMSNorm -> gate|up [d -> 2f] -> silu(gate)·up -> down [f -> d] -> +x              (no biases)

h query heads share h_kv key/value heads: query head j reads K,V head j // (h/h_kv). Tensor parallel, as
for GPT-2 (layers/models/tp_block.py), with the same ColumnParallelLinear / RowParallelLinear and 2 all-reduces
of [n, d] per block. Head alignment keeps each query head with its K,V head: rank r holds query heads
[r·h/p, (r+1)·h/p) and
    p ≤ h_kv   K,V heads [r·h_kv/p, (r+1)·h_kv/p)          (each K,V head on exactly one rank)
    p > h_kv   K,V head r·h_kv // p, replicated on p/h_kv ranks (vLLM's rule): the per-rank KV cache
               stops shrinking once p reaches h_kv
Valid p: h % p == 0, d_ffn % p == 0, and h_kv % p == 0 or p % h_kv == 0.
gate and up are one column-parallel matmul (rank r's rows of gate, then of up, so silu(gate)·up is local);
down is row-parallel.

The block family is a choice inside one design, not a second code path: Llama blocks take the same
`requests` (None, varlen Requests, or serving's PagedLayer) as GPT-2's, attend through the same
layers/attention/attention.attention (which handles h_kv < h), stack in the same layers/models/dense.Stack, shard
through layers/models/tp_block.shard_stack and are served by the same engine (layers/models/lm.TPLlamaLM). Checkpoints:
layers/models/hf_llama.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from layers.attention.attention import PagedLayer, attention, positions_of
from layers.attention.varlen import Requests
from layers.models.config import FamilyConfig
from layers.parallel.linear import ColumnParallelLinear, RowParallelLinear
from layers.parallel.shard import Part, cols, even, heads_range, rows, whole
from tp.comm import copy_to_region, gather_rows_to_parallel, reduce_scatter_rows
from tp.dist import ConfigError
from tp.partition import kv_head_range


@dataclass(frozen=True)
class LlamaConfig(FamilyConfig):
    d_model: int = 256
    n_heads: int = 8
    n_kv_heads: int = 2
    d_head: int = 32
    d_ffn: int = 688
    n_layers: int = 4
    max_seq_len: int = 1024
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    vocab_size: int = 32000
    tie_word_embeddings: bool = False  # the LM head is the token embedding (some checkpoints); Llama-2: separate

    family = "llama"  # the block family (layers/models/config.ModelConfig is "gpt2"); not a dataclass field
    llama_block = True  # the analytic models (tp/) count its blocks as Llama's: RMSNorm, GQA, SwiGLU, no biases

    @property
    def k_kv(self) -> int:
        return self.n_kv_heads * self.d_head


LLAMA_TINY = LlamaConfig()  # runs in seconds on a laptop
LLAMA2_7B_SHAPE = LlamaConfig(d_model=4096, n_heads=32, n_kv_heads=32, d_head=128, d_ffn=11008, n_layers=32,
                              max_seq_len=4096, norm_eps=1e-5, vocab_size=32000)  # = conf/model/llama2_7b.yaml


def valid_llama_tp_sizes(cfg: LlamaConfig, up_to: int = 64) -> list[int]:
    return [p for p in range(1, up_to + 1) if cfg.n_heads % p == 0 and cfg.d_ffn % p == 0
            and (cfg.n_kv_heads % p == 0 or p % cfg.n_kv_heads == 0)]


def validate_llama(cfg: LlamaConfig, p: int) -> None:
    """ConfigError naming the numbers to change, with the valid p. Pure: every rank reaches the same verdict."""
    cfg.check_positive(("d_model", "n_heads", "n_kv_heads", "d_head", "d_ffn", "n_layers", "max_seq_len",
                        "vocab_size"))
    if not (cfg.norm_eps > 0 and cfg.rope_theta > 0):
        raise ConfigError(f"model.norm_eps={cfg.norm_eps} and model.rope_theta={cfg.rope_theta} must be positive")
    if cfg.n_heads % cfg.n_kv_heads:
        raise ConfigError(f"n_heads={cfg.n_heads} must be a multiple of n_kv_heads={cfg.n_kv_heads} "
                          f"(each K,V head serves n_heads/n_kv_heads query heads)")
    if cfg.d_head % 2:
        raise ConfigError(f"d_head={cfg.d_head} must be even: rotary positions rotate pairs of dimensions")
    if p not in valid_llama_tp_sizes(cfg, max(p, 1)):
        raise ConfigError(f"n_heads={cfg.n_heads}, n_kv_heads={cfg.n_kv_heads}, d_ffn={cfg.d_ffn} cannot be split "
                          f"over p={p} ranks (h % p, d_ffn % p, and h_kv % p or p % h_kv must be 0); valid "
                          f"tensor-parallel sizes: {', '.join(map(str, valid_llama_tp_sizes(cfg)))}")


def kv_heads_of_rank(cfg: LlamaConfig, rank: int, p: int) -> range:
    """The K,V heads rank r holds (one, shared with p/h_kv − 1 other ranks, once p > h_kv)."""
    return kv_head_range(cfg.n_kv_heads, rank, p)


# ---- the pieces -------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # The statistics in float32 at least, as transformers' LlamaRMSNorm: squared in float16, a residual stream
    # whose activations reach the thousands (Llama-2-7B's do) overflows above |x| ~ 256 and the row becomes
    # zeros. Normalized in float32, rounded back to x's dtype, then scaled (transformers' order, so bfloat16
    # rounds where it does). nn.LayerNorm already keeps its statistics in float32 for half inputs.
    stats = torch.promote_types(x.dtype, torch.float32)
    xs = x.to(stats)
    return weight * (xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_tables(positions: torch.Tensor, dh: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, dh] for rows at `positions` [T] (each row's own position: a request's q_start onwards)."""
    # The angles in float32 at least: bfloat16 holds integers exactly only up to 256 (positions 256 and 257 would
    # rotate alike) and float16 up to 2048. The tables are then rounded to x's dtype, as transformers does.
    table = torch.promote_types(dtype, torch.float32)
    inv_freq = 1.0 / theta ** (torch.arange(0, dh, 2, dtype=table, device=positions.device) / dh)  # [dh/2]
    angles = positions.to(table)[:, None] * inv_freq[None, :]  # [T, dh/2]
    return tuple(torch.cat([f, f], dim=-1).to(dtype) for f in (angles.cos(), angles.sin()))  # [T, dh], all heads


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions on x [heads, T, dh]. Dimension i pairs with i + dh/2 (the rotate-half layout of Llama
    checkpoints)."""
    dh = x.shape[-1]
    x1, x2 = x[..., : dh // 2], x[..., dh // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def rotary_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: LlamaConfig,
                     requests: Requests | PagedLayer | None) -> torch.Tensor:
    """q [T, h·dh], k, v [T, h_kv·dh] (this rank's heads): RoPE on q and k at each row's position, then causal
    grouped-query attention (layers/attention/attention.py, which also keeps the cache). Returns [T, h·dh]."""
    tables = requests.batch.tables if isinstance(requests, PagedLayer) else {}  # serving: once an iteration
    key = ("rope", cfg.d_head, cfg.rope_theta, q.dtype)
    if key not in tables:
        tables[key] = rope_tables(positions_of(requests, q.shape[0], q.device), cfg.d_head, cfg.rope_theta, q.dtype)
    cos, sin = tables[key]
    q, k, v = (rearrange(t, "n (h d) -> h n d", d=cfg.d_head) for t in (q, k, v))
    kv = torch.stack([rope(k, cos, sin), v])  # [2, h_kv, T, dh]
    return attention(rope(q, cos, sin), kv, requests)


# ---- the single-device block and its TP counterpart -------------------------------------------------------------


def dense_attention(module: nn.Module, cfg: LlamaConfig, dtype, device) -> None:
    """The whole attention's parameters on `module` (no biases): attn_norm, q [d -> h·dh], k, v [d -> h_kv·dh], o."""
    kw = dict(dtype=dtype, device=device, bias=False)
    module.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype, device)
    module.q = nn.Linear(cfg.d_model, cfg.k, **kw)
    module.k = nn.Linear(cfg.d_model, cfg.k_kv, **kw)
    module.v = nn.Linear(cfg.d_model, cfg.k_kv, **kw)
    module.o = nn.Linear(cfg.k, cfg.d_model, **kw)


class RotaryBlock(nn.Module):
    """What every Llama-family block shares: `attention`, RoPE and causal GQA on the block's (or this rank's) heads.
    A family that changes only what enters the attention overrides it (Qwen3's per-head q, k norms:
    layers/models/qwen3.py)."""

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  requests: Requests | PagedLayer | None) -> torch.Tensor:
        return rotary_attention(q, k, v, self.cfg, requests)


class DenseLlamaBlock(RotaryBlock):
    def __init__(self, cfg: LlamaConfig, dtype=torch.float32, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device, bias=False)
        self.cfg = cfg
        dense_attention(self, cfg, dtype, device)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype, device)
        self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.d_ffn, **kw)  # rows [gate | up]
        self.down = nn.Linear(cfg.d_ffn, cfg.d_model, **kw)

    def forward(self, x: torch.Tensor, requests: Requests | PagedLayer | None = None) -> torch.Tensor:
        h = self.attn_norm(x)
        x = x + self.o(self.attention(self.q(h), self.k(h), self.v(h), requests))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class TPLlamaBlock(RotaryBlock):
    """Column (fused q|k|v of this rank's heads) -> GQA on local heads -> row (o); column (gate|up) -> row (down)."""

    def __init__(self, cfg: LlamaConfig, group: dist.ProcessGroup, dtype=torch.float32, device=None):
        super().__init__()
        p = dist.get_world_size(group)
        validate_llama(cfg, p)
        kw = dict(dtype=dtype, device=device, bias=False)
        self.cfg, self.group = cfg, group
        self.q_heads = cfg.n_heads // p
        self.kv_heads = len(kv_heads_of_rank(cfg, 0, p))
        self.qkv_split = [self.q_heads * cfg.d_head, self.kv_heads * cfg.d_head, self.kv_heads * cfg.d_head]  # q, k, v
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype, device)
        # out_features counts every rank's slice, replicated K,V heads once per rank: p * the local width
        self.qkv = ColumnParallelLinear(cfg.d_model, p * sum(self.qkv_split), group, site="attn/qkv dx", **kw)
        self.o = RowParallelLinear(cfg.k, cfg.d_model, group, site="attn/all-reduce #1", **kw)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype, device)
        self.gate_up = ColumnParallelLinear(cfg.d_model, 2 * cfg.d_ffn, group, site="mlp/gate_up dx", **kw)
        self.down = RowParallelLinear(cfg.d_ffn, cfg.d_model, group, site="mlp/all-reduce #2", **kw)

    def forward(self, x: torch.Tensor, requests: Requests | PagedLayer | None = None) -> torch.Tensor:
        q, k, v = self.qkv(self.attn_norm(x)).split(self.qkv_split, dim=-1)  # this rank's query heads, its K,V heads
        x = x + self.o(self.attention(q, k, v, requests))  # ★ all-reduce #1: partial [n, d] summed
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)  # this rank's f/p columns of each
        return x + self.down(F.silu(gate) * up)  # ★ all-reduce #2: partial [n, d] summed over ranks

    def plan(self) -> list[Part]:
        """This rank's slices of the dense block (the rules: layers/parallel/shard.py). qkv stacks three dense tensors:
        its query heads' rows of q, then its K,V heads' rows of k and of v (the same K,V head on p/h_kv ranks once
        p > h_kv); gate_up takes its f/p rows of gate and of up."""
        c, rank, p = self.cfg, dist.get_rank(self.group), dist.get_world_size(self.group)
        q_heads, kv = range(rank * self.q_heads, (rank + 1) * self.q_heads), kv_heads_of_rank(c, rank, p)
        q, kv_rows = rows(heads_range(q_heads, c.d_head)), rows(heads_range(kv, c.d_head))
        (a, b), f = even(c.d_ffn, rank, p, "d_ffn"), c.d_ffn
        return whole("attn_norm.weight", "mlp_norm.weight") + [
            Part("qkv.weight", "q.weight", q), Part("qkv.weight", "k.weight", kv_rows, row=len(q_heads) * c.d_head),
            Part("qkv.weight", "v.weight", kv_rows, row=(len(q_heads) + len(kv)) * c.d_head),
            Part("o.weight", "o.weight", cols(heads_range(q_heads, c.d_head))),
            Part("gate_up.weight", "gate_up.weight", rows((a, b), (f + a, f + b))),
            Part("down.weight", "down.weight", cols((a, b)))]


class TPLlamaBlockSP(TPLlamaBlock):
    """v2sp: TPLlamaBlock with sequence parallelism, cut as GPT-2's TPBlockV2SP (layers/models/tp_block.py): between
    sub-layers each rank holds its T'/p rows (T' = T padded up to a multiple of p), where RMSNorm and the residual
    adds run; the norm weights' gradients, partial over those rows, are all-reduced in backward (copy_to_region)."""

    def forward(self, x: torch.Tensor, requests: Requests | None = None, n: int | None = None) -> torch.Tensor:
        if isinstance(requests, PagedLayer):
            raise ValueError("v2sp cuts one forward (training-style); serving runs v2")
        g, eps = self.group, self.cfg.norm_eps
        n = x.shape[0] * dist.get_world_size(g) if n is None else n  # real rows T; the rest is padding
        w = copy_to_region(self.attn_norm.weight, g, "attn/norm dw")  # backward: all-reduce the partial gradient
        h = gather_rows_to_parallel(rms_norm(x, w, eps), g, "attn/all-gather #1")  # ★ all-gather: [T', d]
        # no copy_to_region before the column-parallel matmul: the gather's backward sums dX
        q, k, v = F.linear(h[:n], self.qkv.weight).split(self.qkv_split, dim=-1)
        partial = F.linear(self.attention(q, k, v, requests), self.o.weight)  # [T, d] partial sums
        x = x + reduce_scatter_rows(pad_rows(partial, h.shape[0]), g, "attn/reduce-scatter #1")  # ★ [T'/p, d]
        w = copy_to_region(self.mlp_norm.weight, g, "mlp/norm dw")
        h = gather_rows_to_parallel(rms_norm(x, w, eps), g, "mlp/all-gather #2")  # ★ all-gather: [T', d]
        gate, up = F.linear(h[:n], self.gate_up.weight).chunk(2, dim=-1)  # this rank's f/p columns of each
        partial = F.linear(F.silu(gate) * up, self.down.weight)  # [T, d] partial sums
        return x + reduce_scatter_rows(pad_rows(partial, h.shape[0]), g, "mlp/reduce-scatter #2")  # ★ [T'/p, d]


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """[T, ...] -> [rows, ...], zero rows appended (sequence parallelism's padding to a multiple of p)."""
    return x if x.shape[0] == rows else F.pad(x, (0, 0) * (x.dim() - 1) + (0, rows - x.shape[0]))
