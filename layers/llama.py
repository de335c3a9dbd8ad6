"""Llama-family blocks on the same TP machinery (SPEC §9): RMSNorm, rotary positions, SwiGLU, grouped-query attention.

    x -> RMSNorm -> q [d -> h·dh], k, v [d -> h_kv·dh] -> RoPE(q, k) -> causal GQA -> o [h·dh -> d] -> +x
      -> RMSNorm -> gate|up [d -> 2f] -> silu(gate)·up -> down [f -> d] -> +x              (no biases)

h query heads share h_kv key/value heads: query head j reads K,V head j // (h/h_kv). Tensor parallel, as
for GPT-2 (layers/tp_block.py), with the same ColumnParallelLinear / RowParallelLinear and 2 all-reduces
of [n, d] per block. Head alignment keeps each query head with its K,V head: rank r holds query heads
[r·h/p, (r+1)·h/p) and
    p ≤ h_kv   K,V heads [r·h_kv/p, (r+1)·h_kv/p)          (each K,V head on exactly one rank)
    p > h_kv   K,V head r·h_kv // p, replicated on p/h_kv ranks (vLLM's rule): the per-rank KV cache
               stops shrinking once p reaches h_kv
Valid p: h % p == 0, d_ffn % p == 0, and h_kv % p == 0 or p % h_kv == 0 (SPEC §9).
gate and up are one column-parallel matmul (rank r's rows of gate, then of up, so silu(gate)·up is local);
down is row-parallel.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from layers.linear import ColumnParallelLinear, RowParallelLinear
from layers.shard import load_
from tp.dist import ConfigError


@dataclass(frozen=True)
class LlamaConfig:
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

    @property
    def k(self) -> int:
        return self.n_heads * self.d_head

    @property
    def k_kv(self) -> int:
        return self.n_kv_heads * self.d_head

    def asdict(self) -> dict:
        return asdict(self)


LLAMA_TINY = LlamaConfig()  # runs in seconds on a laptop
LLAMA2_7B_SHAPE = LlamaConfig(d_model=4096, n_heads=32, n_kv_heads=32, d_head=128, d_ffn=11008, n_layers=32,
                              max_seq_len=4096, norm_eps=1e-5, vocab_size=32000)  # for the cost model only


def valid_llama_tp_sizes(cfg: LlamaConfig, up_to: int = 64) -> list[int]:
    return [p for p in range(1, up_to + 1) if cfg.n_heads % p == 0 and cfg.d_ffn % p == 0
            and (cfg.n_kv_heads % p == 0 or p % cfg.n_kv_heads == 0)]


def validate_llama(cfg: LlamaConfig, p: int) -> None:
    """ConfigError naming the numbers to change, with the valid p. Pure: every rank reaches the same verdict."""
    if cfg.n_kv_heads < 1 or cfg.n_heads % cfg.n_kv_heads:
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
    if p <= cfg.n_kv_heads:
        per = cfg.n_kv_heads // p
        return range(rank * per, (rank + 1) * per)
    return range(rank * cfg.n_kv_heads // p, rank * cfg.n_kv_heads // p + 1)


# ---- the pieces -------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # in x's own dtype throughout
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary positions on x [T, heads, dh] at `positions` [T] (each row's own position: a request's q_start
    onwards). Dimension i pairs with i + dh/2 (the rotate-half layout of Llama checkpoints)."""
    dh = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dh, 2, dtype=x.dtype, device=x.device) / dh)  # [dh/2]
    angles = positions.to(x.dtype)[:, None] * inv_freq[None, :]  # [T, dh/2]
    cos, sin = (torch.cat([f, f], dim=-1)[:, None, :] for f in (angles.cos(), angles.sin()))  # [T, 1, dh]
    x1, x2 = x[..., : dh // 2], x[..., dh // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """q [T, hq, dh], k, v [T, hkv, dh], hq a multiple of hkv; causal within each span of rows. Returns [T, hq·dh]."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))  # query head j reads K,V head j // group
    outs = []
    for s, e in spans:
        qs, ks, vs = (rearrange(t[s:e], "n h d -> 1 h n d") for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True))
    return rearrange(torch.cat(outs, dim=2), "1 h n d -> n (h d)")


# ---- the single-device block and its TP counterpart -------------------------------------------------------------


class DenseLlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig, dtype=torch.float32, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device, bias=False)
        self.cfg = cfg
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype, device)
        self.q = nn.Linear(cfg.d_model, cfg.k, **kw)
        self.k = nn.Linear(cfg.d_model, cfg.k_kv, **kw)
        self.v = nn.Linear(cfg.d_model, cfg.k_kv, **kw)
        self.o = nn.Linear(cfg.k, cfg.d_model, **kw)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype, device)
        self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.d_ffn, **kw)  # rows [gate | up]
        self.down = nn.Linear(cfg.d_ffn, cfg.d_model, **kw)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        c, h = self.cfg, self.attn_norm(x)
        q = rope(rearrange(self.q(h), "n (h d) -> n h d", d=c.d_head), positions, c.rope_theta)
        k = rope(rearrange(self.k(h), "n (h d) -> n h d", d=c.d_head), positions, c.rope_theta)
        v = rearrange(self.v(h), "n (h d) -> n h d", d=c.d_head)
        x = x + self.o(_attend(q, k, v, spans))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class TPLlamaBlock(nn.Module):
    """Column (fused q|k|v of this rank's heads) -> GQA on local heads -> row (o); column (gate|up) -> row (down)."""

    def __init__(self, cfg: LlamaConfig, group: dist.ProcessGroup, dtype=torch.float32, device=None):
        super().__init__()
        p = dist.get_world_size(group)
        validate_llama(cfg, p)
        kw = dict(dtype=dtype, device=device, bias=False)
        self.cfg, self.group = cfg, group
        self.q_heads = cfg.n_heads // p
        self.kv_heads = len(kv_heads_of_rank(cfg, 0, p))
        local_qkv = (self.q_heads + 2 * self.kv_heads) * cfg.d_head
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype, device)
        # out_features counts every rank's slice, replicated K,V heads once per rank: p * the local width
        self.qkv = ColumnParallelLinear(cfg.d_model, p * local_qkv, group, site="attn/qkv dx", **kw)
        self.o = RowParallelLinear(cfg.k, cfg.d_model, group, site="attn/all-reduce #1", **kw)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype, device)
        self.gate_up = ColumnParallelLinear(cfg.d_model, 2 * cfg.d_ffn, group, site="mlp/gate_up dx", **kw)
        self.down = RowParallelLinear(cfg.d_ffn, cfg.d_model, group, site="mlp/all-reduce #2", **kw)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        c = self.cfg
        q, k, v = self.qkv(self.attn_norm(x)).split(
            [self.q_heads * c.d_head, self.kv_heads * c.d_head, self.kv_heads * c.d_head], dim=-1)
        q = rope(rearrange(q, "n (h d) -> n h d", d=c.d_head), positions, c.rope_theta)
        k = rope(rearrange(k, "n (h d) -> n h d", d=c.d_head), positions, c.rope_theta)
        v = rearrange(v, "n (h d) -> n h d", d=c.d_head)
        x = x + self.o(_attend(q, k, v, spans))  # ★ all-reduce #1: partial [n, d] summed over ranks
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)  # this rank's f/p columns of each
        return x + self.down(F.silu(gate) * up)  # ★ all-reduce #2: partial [n, d] summed over ranks

    @torch.no_grad()
    def load_dense(self, dense: DenseLlamaBlock) -> "TPLlamaBlock":
        c, rank, p = self.cfg, dist.get_rank(self.group), dist.get_world_size(self.group)
        dh = c.d_head
        rows = lambda w, heads: torch.cat([w[j * dh:(j + 1) * dh] for j in heads])  # noqa: E731
        kv = kv_heads_of_rank(c, rank, p)
        q_heads = range(rank * self.q_heads, (rank + 1) * self.q_heads)
        load_(self.qkv, torch.cat([rows(dense.q.weight, q_heads), rows(dense.k.weight, kv),
                                   rows(dense.v.weight, kv)]), None)
        load_(self.o, dense.o.weight[:, q_heads.start * dh:q_heads.stop * dh], None)
        gate, up = dense.gate_up.weight.chunk(2, dim=0)
        f = c.d_ffn // p
        load_(self.gate_up, torch.cat([gate[rank * f:(rank + 1) * f], up[rank * f:(rank + 1) * f]]), None)
        load_(self.down, dense.down.weight[:, rank * f:(rank + 1) * f], None)
        self.attn_norm.load_state_dict(dense.attn_norm.state_dict())
        self.mlp_norm.load_state_dict(dense.mlp_norm.state_dict())
        return self


def load_hf_llama_block(block: DenseLlamaBlock, state: dict[str, torch.Tensor], prefix: str) -> DenseLlamaBlock:
    """transformers' LlamaDecoderLayer weights (nn.Linear [out, in], like ours) into a DenseLlamaBlock."""
    g = lambda name: state[prefix + name]  # noqa: E731
    with torch.no_grad():
        block.attn_norm.weight.copy_(g("input_layernorm.weight"))
        block.q.weight.copy_(g("self_attn.q_proj.weight"))
        block.k.weight.copy_(g("self_attn.k_proj.weight"))
        block.v.weight.copy_(g("self_attn.v_proj.weight"))
        block.o.weight.copy_(g("self_attn.o_proj.weight"))
        block.mlp_norm.weight.copy_(g("post_attention_layernorm.weight"))
        block.gate_up.weight.copy_(torch.cat([g("mlp.gate_proj.weight"), g("mlp.up_proj.weight")]))
        block.down.weight.copy_(g("mlp.down_proj.weight"))
    return block


# ---- serving: cached attention, the language model (dense oracle and TP) ----------------------------------------


def cached_gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch) -> torch.Tensor:
    """Serving (layers/attention.CachedRequests): write each request's new K,V [rows, hkv, dh] into its cache
    [2, hkv, capacity, dh] at [q_start, q_end), then attend over keys [0, q_end) with the prefix-causal mask."""
    from layers.attention import prefix_causal_mask

    group = q.shape[1] // k.shape[1]
    outs = []
    for (s, e), q_start, cache in zip(batch.spans, batch.q_starts, batch.caches):
        kv_length = q_start + e - s
        cache[0, :, q_start:kv_length] = rearrange(k[s:e], "n h d -> h n d")
        cache[1, :, q_start:kv_length] = rearrange(v[s:e], "n h d -> h n d")
        keys, values = (t.repeat_interleave(group, dim=0)[None] for t in cache[:, :, :kv_length])  # [1, hq, kv, dh]
        mask = None if e - s == 1 else prefix_causal_mask(q_start, e - s, kv_length, q.device)
        outs.append(F.scaled_dot_product_attention(rearrange(q[s:e], "n h d -> 1 h n d"), keys, values, attn_mask=mask))
    return rearrange(torch.cat(outs, dim=2), "1 h n d -> n (h d)")


def _attend(q, k, v, requests):
    from layers.attention import CachedRequests

    return cached_gqa_attention(q, k, v, requests) if isinstance(requests, CachedRequests) else gqa_attention(q, k, v, requests)


class LlamaStack(nn.Module):
    """L blocks (dense or TP); `blocks` is what the traffic ledger labels layers by."""

    def __init__(self, cfg: LlamaConfig, blocks: list[nn.Module]):
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x, positions, requests):  # requests: spans [(s, e)], or one CachedRequests per layer
        layers = requests if isinstance(requests, list) and requests and not isinstance(requests[0], tuple) \
            else [requests] * len(self.blocks)
        for block, r in zip(self.blocks, layers):
            x = block(x, positions, r)
        return x


class DenseLlamaLM(nn.Module):
    """The single-device Llama LM: embed -> L blocks -> RMSNorm -> lm_head (untied). The serving oracle."""

    def __init__(self, cfg: LlamaConfig, dtype=torch.float32, device=None):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model, dtype=dtype, device=device)
        self.stack = LlamaStack(cfg, [DenseLlamaBlock(cfg, dtype, device) for _ in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype, device)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False, dtype=dtype, device=device)

    def logits(self, ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, V], no cache
        n = ids.shape[0]
        x = self.stack(self.embed(ids), torch.arange(n, device=ids.device), [(0, n)])
        return self.lm_head(self.norm(x))


class TPLlamaLM(nn.Module):
    """The Llama LM on p ranks: vocab-parallel embedding and LM head (layers/vocab.py), TP blocks, per-rank caches
    of this rank's K,V heads. `step` is one serving iteration, as layers/lm.TPLM.step."""

    variant = "v2"
    vocab_parallel = True

    def __init__(self, cfg: LlamaConfig, embed, stack: LlamaStack, norm: RMSNorm, head):
        super().__init__()
        self.cfg, self.embed, self.stack, self.norm, self.head = cfg, embed, stack, norm, head

    @property
    def cache_heads(self) -> int:
        return self.stack.blocks[0].kv_heads

    def step(self, ids, positions, layers, sample_rows):
        x = self.embed(ids)  # ★ all-reduce [T, d]
        x = self.stack(x, positions, layers)  # ★ 2 all-reduces [T, d] per layer
        if not sample_rows:
            return torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.float64)
        return self.head.greedy(self.norm(x[sample_rows]))  # ★ all-gather of (max, argmax) pairs [S, 2] per rank


@torch.no_grad()
def shard_llama_lm(dense: DenseLlamaLM, group: dist.ProcessGroup) -> TPLlamaLM:
    from layers.vocab import VocabParallelEmbedding

    cfg, w = dense.cfg, dense.embed.weight
    embed = VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, group, w.dtype, w.device).load_dense(w)
    head = VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, group, w.dtype, w.device).load_dense(
        dense.lm_head.weight)  # only its greedy() is used: the untied head, vocab-parallel
    stack = LlamaStack(cfg, [TPLlamaBlock(cfg, group, w.dtype, w.device).load_dense(b) for b in dense.stack.blocks])
    norm = RMSNorm(cfg.d_model, cfg.norm_eps, w.dtype, w.device)
    norm.load_state_dict(dense.norm.state_dict())
    return TPLlamaLM(cfg, embed, stack, norm, head)


def load_hf_llama_lm(lm: DenseLlamaLM, state: dict[str, torch.Tensor]) -> DenseLlamaLM:
    """transformers' LlamaForCausalLM state dict into a DenseLlamaLM."""
    with torch.no_grad():
        lm.embed.weight.copy_(state["model.embed_tokens.weight"])
        lm.norm.weight.copy_(state["model.norm.weight"])
        lm.lm_head.weight.copy_(state.get("lm_head.weight", state["model.embed_tokens.weight"]))
    for i, block in enumerate(lm.stack.blocks):
        load_hf_llama_block(block, state, f"model.layers.{i}.")
    return lm
