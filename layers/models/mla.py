"""DeepSeek-V3's block on the TP stack: multi-head latent attention (MLA), then a dense SwiGLU FFN (the first
first_k_dense_replace layers) or DeepSeekMoE (shared experts beside group-limited routed ones).

    x -> RMSNorm -> h
      queries   q [d -> H·(n+r)]  (or q_a [d -> q_lora] -> RMSNorm -> q_b [q_lora -> H·(n+r)])   per head: nope n, rope r
      latent    kv_a [d -> c + r] -> c_KV = RMSNorm(first c), k_R = RoPE(last r)                  one per token, all heads
      per head  K = [W_UK·c_KV ; k_R] (n + r), V = W_UV·c_KV (v), W_UK|W_UV = kv_b's rows [H·(n+v), c]
      attention causal, scale (n+r)^-1/2 (YaRN: times mscale²) -> o [H·v -> d] -> +x
      -> RMSNorm -> dense SwiGLU, or DeepSeekMoE: Σ_j w_j·FFN_{e_j}(h) + shared FFN(h) -> +x

The cache holds c_KV and k_R only: c + r values per token per layer, the same for every head (V3: 512 + 64 = 576).
Two ways to attend, equal in exact arithmetic (tested to 1e-12 in float64):

    decompressed   K, V built per head from the latent, attention as MHA over the rank's heads (compute-friendly:
                   a prompt's keys are computed anyway). The path without a cache (the dense oracle, run_block).
    absorbed       W_UK folded into the query, q̃ = [q_nope·W_UK ; q_rope] (c + r wide), attention as MQA over the
                   latent itself (keys [c_KV ; k_R], values c_KV), W_UV applied after: out·W_UVᵀ (data-movement
                   friendly: nothing per head is ever read from the cache). Serving: decodes and chunks after a
                   cached prefix, through the same attention backends as the other families
                   (layers/attention/backends.py) over a one-plane pool; prompt chunks from position 0 are written
                   by the backend and attended decompressed (PREFILL), their keys being their own rows.

Tensor parallel: the H query heads split (q or q_b and kv_b column-parallel by heads, o row-parallel, ★ one
all-reduce [T, d]); the latent path (q_a, kv_a, their norms, the rope key) is computed whole on every rank: the
replication MLA brings under TP. Every rank caches the whole latent (vLLM: "tp 8 causes 8x KV cache duplication"):
bytes per token per rank = L·(c + r)·e at every p (tp/partition.mla_kv_bytes_per_token).

DeepSeekMoE: router logits in float32 at least, sigmoid scores; the choice adds the correction bias, keeps the
topk_group groups (of n_group) with the highest sum of their two best biased scores, then the top_k experts inside
them; weights are the unbiased scores of the chosen, normalized when norm_topk_prob, times routed_scaling_factor
(transformers' DeepseekV3TopkRouter). Placements as Mixtral's (layers/models/moe.py): tp (every routed expert split
f'/p) or ep (E/p whole routed experts per rank); the shared experts are split f_s/p in both, their partial output joins
the routed one before ★ the one all-reduce [T, d]. The dense layers' FFN is Llama's (column gate|up, row down).
Checkpoints: layers/models/hf_deepseek.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from layers.attention.attention import PagedLayer, positions_of
from layers.attention.kv_quant import QuantizedLayer, reference_round_trip
from layers.attention.varlen import Requests
from layers.models.config import FamilyConfig
from layers.models.llama import RMSNorm, rope
from layers.models.moe import expert_parts, moe_local, swiglu
from layers.parallel.linear import ColumnParallelLinear, RowParallelLinear
from layers.parallel.shard import Part, cols, even, heads_range, rows, whole
from tp.comm import reduce_from_region
from tp.dist import ConfigError

DEEPSEEK_PARALLEL = ("tp", "ep")
# How served prompt chunks that start at position 0 attend: "decompressed" (K, V rebuilt per head from their own
# latents, MHA: the compute-friendly form, DeepSeek's and vLLM's prefill) or "absorbed" (as decodes and chunks after a
# cached prefix always do). Both are the same attention; the tests serve with each.
PREFILL = "decompressed"


@dataclass(frozen=True)
class DeepseekConfig(FamilyConfig):
    d_model: int = 64
    n_heads: int = 4
    q_lora_rank: int = 0  # 0: the queries through one q [d -> H·(n+r)] (V2-Lite); V3: 1536
    kv_lora_rank: int = 16  # c: the latent's width (V3: 512)
    qk_rope_head_dim: int = 16  # r: the shared rotary key's width, and each query head's rope part (V3: 64)
    qk_nope_head_dim: int = 32  # n: each head's key/query part without positions (V3: 128)
    v_head_dim: int = 32  # v (V3: 128)
    d_ffn: int = 96  # the dense layers' FFN (intermediate_size)
    moe_d_ffn: int = 32  # each routed expert's FFN (moe_intermediate_size)
    n_routed_experts: int = 8
    n_shared_experts: int = 1  # one SwiGLU of n_shared·moe_d_ffn
    top_k: int = 2  # num_experts_per_tok
    n_group: int = 2
    topk_group: int = 1
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 1  # layers [0, k) have the dense FFN
    n_layers: int = 3
    max_seq_len: int = 256
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_interleave: bool = True  # rotary pairs (x0, x1), (x2, x3), ... as DeepSeek's checkpoints lay them out
    # YaRN (rope_type "yarn", V3's config: factor 40 over 4096 original positions, mscale = mscale_all_dim = 1):
    # frequencies blended between interpolated and original over a ramp of dimensions, cos/sin times an attention
    # factor, the softmax scale times mscale(factor, mscale_all_dim)² (transformers' DeepseekV3 is the oracle)
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_original_max_position: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 0.0
    rope_mscale_all_dim: float = 0.0
    rope_attention_factor: float = 0.0  # 0: derived from factor, mscale and mscale_all_dim
    rope_truncate: bool = True
    vocab_size: int = 1000
    tie_word_embeddings: bool = False

    family = "deepseek_v3"

    @property
    def k(self) -> int:
        """The attention output's width, o's input: H·v (the traffic model's k)."""
        return self.n_heads * self.v_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token per layer: c_KV and k_R."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def scale(self) -> float:
        """The softmax scale: (n + r)^-1/2, times mscale(factor, mscale_all_dim)² under YaRN."""
        m = yarn_mscale(self.rope_factor, self.rope_mscale_all_dim) if self.yarn and self.rope_mscale_all_dim else 1.0
        return self.qk_head_dim ** -0.5 * m * m

    @property
    def yarn(self) -> bool:
        return self.rope_type == "yarn"

    def moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace


DEEPSEEK_TINY = DeepseekConfig(q_lora_rank=32)  # = conf/model/deepseek_tiny.yaml
# DeepSeek-V3's shape (config.json of deepseek-ai/DeepSeek-V3): the cost tables' numbers, never built here
DEEPSEEK_V3_SHAPE = DeepseekConfig(d_model=7168, n_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
                                   qk_nope_head_dim=128, v_head_dim=128, d_ffn=18432, moe_d_ffn=2048,
                                   n_routed_experts=256, n_shared_experts=1, top_k=8, n_group=8, topk_group=4,
                                   first_k_dense_replace=3, n_layers=61, max_seq_len=163840, vocab_size=129280)


def _unsplittable(cfg: DeepseekConfig, p: int, placement: str) -> list[str]:
    """The sizes ("name=value") that p ranks would split and that p does not divide."""
    need = [("n_heads", cfg.n_heads), ("n_shared_experts*moe_d_ffn", cfg.n_shared_experts * cfg.moe_d_ffn)]
    if cfg.first_k_dense_replace > 0:
        need.append(("d_ffn", cfg.d_ffn))
    if cfg.n_layers > cfg.first_k_dense_replace:
        need.append(("moe_d_ffn", cfg.moe_d_ffn) if placement == "tp" else ("n_routed_experts", cfg.n_routed_experts))
    return [f"{name}={value}" for name, value in need if value % p]


def validate_deepseek(cfg: DeepseekConfig, p: int, placement: str = "tp") -> None:
    """ConfigError naming the setting to change; pure, so every rank reaches the same verdict before any collective."""
    if placement not in DEEPSEEK_PARALLEL:
        raise ConfigError(f"moe_parallel={placement!r} is not built for DeepSeek models: choose tp or ep")
    cfg.check_positive(("d_model", "n_heads", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                        "d_ffn", "moe_d_ffn", "n_routed_experts", "top_k", "n_group", "topk_group", "n_layers",
                        "max_seq_len", "vocab_size"))
    if cfg.q_lora_rank < 0 or cfg.n_shared_experts < 0 or cfg.first_k_dense_replace < 0:
        raise ConfigError("model.q_lora_rank, n_shared_experts and first_k_dense_replace must be 0 or more")
    if cfg.qk_rope_head_dim % 2:
        raise ConfigError(f"qk_rope_head_dim={cfg.qk_rope_head_dim} must be even: rotary positions rotate pairs")
    if cfg.rope_type not in ("default", "yarn"):
        raise ConfigError(f"rope_type={cfg.rope_type!r}: the MLA blocks implement default and yarn rotary positions")
    if cfg.yarn and not (cfg.rope_factor >= 1 and cfg.rope_original_max_position >= 1):
        raise ConfigError(f"yarn needs factor >= 1 and original_max_position_embeddings >= 1 (got "
                          f"{cfg.rope_factor}, {cfg.rope_original_max_position})")
    if cfg.n_routed_experts % cfg.n_group or cfg.n_routed_experts // cfg.n_group < 2:
        raise ConfigError(f"n_routed_experts={cfg.n_routed_experts} must be n_group={cfg.n_group} groups of at least "
                          f"2 experts (a group scores by its two best experts)")
    if not 1 <= cfg.topk_group <= cfg.n_group:
        raise ConfigError(f"topk_group={cfg.topk_group} must be between 1 and n_group={cfg.n_group}")
    if cfg.top_k > cfg.topk_group * (cfg.n_routed_experts // cfg.n_group):
        raise ConfigError(f"top_k={cfg.top_k} exceeds the experts in topk_group={cfg.topk_group} groups of "
                          f"{cfg.n_routed_experts // cfg.n_group}")
    bad = _unsplittable(cfg, p, placement)
    if bad:
        valid = [q for q in range(1, 65) if not _unsplittable(cfg, q, placement)]
        raise ConfigError(f"{', '.join(bad)} cannot be split over p={p} ranks (moe_parallel={placement}); valid "
                          f"tensor-parallel sizes: {', '.join(map(str, valid))}")


# ---- the attention ----------------------------------------------------------------------------------------------


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(cfg: DeepseekConfig, dtype: torch.dtype, device=None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [r/2], the factor on cos and sin), in float32 at least. Default: θ^(-2i/r), 1. YaRN: the
    interpolated frequencies (÷ factor) on the slow dimensions, the original ones on the fast, a linear ramp between
    the dimensions that turn beta_fast and beta_slow times over the original context."""
    r, theta = cfg.qk_rope_head_dim, cfg.rope_theta
    table = torch.promote_types(dtype, torch.float32)
    base = theta ** (torch.arange(0, r, 2, dtype=table, device=device) / r)
    if not cfg.yarn:
        return 1.0 / base, 1.0

    def correction_dim(rotations: float) -> float:
        return r * math.log(cfg.rope_original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(cfg.rope_beta_fast), correction_dim(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, r - 1)
    ramp = ((torch.arange(r // 2, dtype=table, device=device) - low) / (high - low if high > low else 0.001)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency (fast dimensions), 0: interpolated
    inv_freq = (1.0 / (cfg.rope_factor * base)) * (1 - keep) + (1.0 / base) * keep
    factor = cfg.rope_attention_factor or (
        yarn_mscale(cfg.rope_factor, cfg.rope_mscale) / yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim)
        if cfg.rope_mscale and cfg.rope_mscale_all_dim else yarn_mscale(cfg.rope_factor))
    return inv_freq, factor


def rope_cos_sin(positions: torch.Tensor, cfg: DeepseekConfig, dtype: torch.dtype):
    """cos, sin [T, r] at each row's position (angles in float32 at least, rounded to dtype as transformers does)."""
    inv_freq, factor = rope_frequencies(cfg, dtype, positions.device)
    angles = positions.to(inv_freq.dtype)[:, None] * inv_freq[None, :]
    return tuple((torch.cat([f, f], dim=-1) * factor).to(dtype) for f in (angles.cos(), angles.sin()))


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """RoPE on x [..., T, r]. Interleaved (DeepSeek's layout): dimensions (2i, 2i+1) rotate together; the result is
    laid out [evens | odds] rotated, as transformers' apply_rotary_pos_emb_interleave returns it (q and k alike, so
    their dot products are those of the interleaved rotation)."""
    if interleave:
        x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
    return rope(x, cos, sin)


def latent_and_queries(q: torch.Tensor, kv: torch.Tensor, cfg: DeepseekConfig, requests, norm: RMSNorm):
    """q [T, H·(n+r)] (this rank's heads), kv [T, c + r] (kv_a's output) -> q_nope [H, T, n], q_rope [H, T, r] (rotated),
    latent [T, c + r]: the normed c_KV, then the rotated k_R (what the cache holds)."""
    c, r = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    tables = requests.batch.tables if isinstance(requests, PagedLayer) else {}  # serving: once an iteration
    key = ("mla rope", cfg, q.dtype)
    if key not in tables:
        tables[key] = rope_cos_sin(positions_of(requests, q.shape[0], q.device), cfg, q.dtype)
    cos, sin = tables[key]
    q = rearrange(q, "t (h d) -> h t d", d=cfg.qk_head_dim)
    q_nope, q_rope = q.split([cfg.qk_nope_head_dim, r], dim=-1)
    latent = torch.cat([norm(kv[:, :c]), rotary(kv[:, c:], cos, sin, cfg.rope_interleave)], dim=-1)
    return q_nope, rotary(q_rope, cos, sin, cfg.rope_interleave), latent


def decompress(latent: torch.Tensor, kv_b: torch.Tensor, cfg: DeepseekConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """latent [N, c + r], kv_b [H·(n+v), c] -> K [H, N, n + r] = [W_UK·c_KV ; k_R], V [H, N, v] = W_UV·c_KV."""
    c = cfg.kv_lora_rank
    kv = rearrange(F.linear(latent[:, :c], kv_b), "t (h d) -> h t d", d=cfg.qk_nope_head_dim + cfg.v_head_dim)
    k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
    k_rope = latent[None, :, c:].expand(k_nope.shape[0], -1, -1)
    return torch.cat([k_nope, k_rope], dim=-1), v


def absorb(q_nope: torch.Tensor, q_rope: torch.Tensor, kv_b: torch.Tensor, cfg: DeepseekConfig) -> torch.Tensor:
    """q̃ [H, T, c + r] = [q_nope·W_UK ; q_rope]: the query that scores the latent directly (q̃·[c_KV ; k_R] =
    q_nope·(W_UK c_KV) + q_rope·k_R)."""
    w = kv_b.view(q_nope.shape[0], cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
    return torch.cat([torch.einsum("htn,hnc->htc", q_nope, w[:, :cfg.qk_nope_head_dim]), q_rope], dim=-1)


def unabsorb(out: torch.Tensor, kv_b: torch.Tensor, cfg: DeepseekConfig) -> torch.Tensor:
    """out [T, H·c] (attention-weighted c_KV per head) -> [T, H·v]: W_UV applied after attention."""
    heads = out.shape[1] // cfg.kv_lora_rank
    w = kv_b.view(heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)[:, cfg.qk_nope_head_dim:]
    return torch.einsum("thc,hvc->thv", out.view(-1, heads, cfg.kv_lora_rank), w).flatten(1)


def mla_attention(q: torch.Tensor, kv: torch.Tensor, kv_b: torch.Tensor, cfg: DeepseekConfig, norm: RMSNorm,
                  requests: Requests | PagedLayer | None) -> torch.Tensor:
    """q [T, H·(n+r)], kv [T, c + r] (kv_a's output), kv_b [H·(n+v), c] -> [T, H·v]. With a paged cache: absorbed,
    the latent written and read by the iteration's backend; without: decompressed, causal within each request."""
    q_nope, q_rope, latent = latent_and_queries(q, kv, cfg, requests, norm)
    if not isinstance(requests, PagedLayer):  # (inside kv_quant.pseudo_quantized: the latent as a cache gives it)
        latent = reference_round_trip(latent[None, None])[0, 0]
        return decompressed(q_nope, q_rope, latent, kv_b, cfg, [(0, q.shape[0])] if requests is None else requests.spans)
    batch = requests.batch
    fresh = batch.fresh if PREFILL == "decompressed" else ()
    q_tilde = absorb(q_nope, q_rope, kv_b, cfg)  # [H, T, c + r]
    if isinstance(requests.pool, QuantizedLayer):  # a quantized cache: every latent as the cache gives it back
        latent = requests.pool.prepare(latent[None, None])[0, 0]
    out = batch.backend.forward(q_tilde, latent[None, None], requests.pool, batch, scale=cfg.scale,
                                v_dim=cfg.kv_lora_rank, skip_fresh=bool(fresh))  # every latent written; MQA over them
    out = unabsorb(out, kv_b, cfg)
    for s, e in fresh:  # prompt chunks from position 0: their keys are their own rows, decompressed
        out[s:e] = decompressed(q_nope[:, s:e], q_rope[:, s:e], latent[s:e], kv_b, cfg, [(0, e - s)])
    return out


def decompressed(q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, kv_b: torch.Tensor,
                 cfg: DeepseekConfig, spans) -> torch.Tensor:
    """MHA over K, V decompressed from the latent, causal within each span of rows (a request from position 0)."""
    k, v = decompress(latent, kv_b, cfg)
    q = torch.cat([q_nope, q_rope], dim=-1)
    out = torch.cat([F.scaled_dot_product_attention(q[None, :, s:e], k[None, :, s:e], v[None, :, s:e], is_causal=True,
                                                    scale=cfg.scale)[0] for s, e in spans], dim=1)
    return rearrange(out, "h t d -> t (h d)")


# ---- DeepSeekMoE routing ---------------------------------------------------------------------------------------


def route_grouped(h: torch.Tensor, router: torch.Tensor, bias: torch.Tensor, cfg: DeepseekConfig):
    """h [T, d] -> (weights [T, k], expert ids [T, k]), DeepseekV3TopkRouter's rule in float32 at least."""
    stats = torch.promote_types(h.dtype, torch.float32)
    scores = F.linear(h.to(stats), router.to(stats)).sigmoid()  # [T, E]
    choice = scores + bias.to(stats)
    T, G = scores.shape[0], cfg.n_group
    group_scores = choice.view(T, G, -1).topk(2, dim=-1).values.sum(-1)  # [T, G]: each group's two best
    groups = group_scores.topk(cfg.topk_group, dim=-1, sorted=False).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
    choice = choice.masked_fill(~keep.repeat_interleave(cfg.n_routed_experts // G, dim=1), float("-inf"))
    ids = choice.topk(cfg.top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids


# ---- the blocks --------------------------------------------------------------------------------------------------


class _DeepseekParts(nn.Module):
    """The parameters, named as the dense block names them; TP blocks hold their slices under the same names."""

    def _ffn(self, cfg: DeepseekConfig, layer: int, experts: int, expert_ffn: int, shared_ffn: int, dense_ffn: int,
             dtype, device) -> None:
        kw = dict(dtype=dtype, device=device)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, **kw)
        self.moe = cfg.moe_layer(layer)
        if not self.moe:
            self.gate_up = nn.Parameter(torch.empty(2 * dense_ffn, cfg.d_model, **kw))  # rows [gate | up]
            self.down = nn.Parameter(torch.empty(cfg.d_model, dense_ffn, **kw))
            return
        # the router in float32 at least, whatever the run's dtype (transformers keeps gate.weight and the correction
        # bias in float32): a bfloat16 bias would move group and expert choices
        stats = dict(dtype=torch.promote_types(dtype, torch.float32), device=device)
        self.router = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.d_model, **stats))
        self.router_bias = nn.Parameter(torch.empty(cfg.n_routed_experts, **stats))  # e_score_correction_bias
        self.gate_up = nn.Parameter(torch.empty(experts, 2 * expert_ffn, cfg.d_model, **kw))
        self.down = nn.Parameter(torch.empty(experts, cfg.d_model, expert_ffn, **kw))
        if cfg.n_shared_experts:
            self.shared_gate_up = nn.Parameter(torch.empty(2 * shared_ffn, cfg.d_model, **kw))
            self.shared_down = nn.Parameter(torch.empty(cfg.d_model, shared_ffn, **kw))

    def ffn_partial(self, h: torch.Tensor, first: int) -> torch.Tensor:
        """This rank's share of the FFN output [T, d] (the whole of it on one device)."""
        if not self.moe:
            return swiglu(h, self.gate_up, self.down)
        weights, ids = route_grouped(h, self.router, self.router_bias, self.cfg)
        out = moe_local(h, weights, ids, self.gate_up, self.down, first)
        return out + swiglu(h, self.shared_gate_up, self.shared_down) if self.cfg.n_shared_experts else out


class DenseDeepseekBlock(_DeepseekParts):
    """The single-device block: the oracle the TP block and the served model are checked against."""

    def __init__(self, cfg: DeepseekConfig, layer: int, dtype=torch.float32, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device, bias=False)
        self.cfg, H = cfg, cfg.n_heads
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype, device)
        if cfg.q_lora_rank:
            self.q_a = nn.Linear(cfg.d_model, cfg.q_lora_rank, **kw)
            self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps, dtype, device)
            self.q_b = nn.Linear(cfg.q_lora_rank, H * cfg.qk_head_dim, **kw)
        else:
            self.q = nn.Linear(cfg.d_model, H * cfg.qk_head_dim, **kw)
        self.kv_a = nn.Linear(cfg.d_model, cfg.latent_dim, **kw)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.norm_eps, dtype, device)
        self.kv_b = nn.Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), **kw)
        self.o = nn.Linear(H * cfg.v_head_dim, cfg.d_model, **kw)
        self._ffn(cfg, layer, cfg.n_routed_experts, cfg.moe_d_ffn, cfg.n_shared_experts * cfg.moe_d_ffn, cfg.d_ffn,
                  dtype, device)

    def queries(self, h: torch.Tensor) -> torch.Tensor:
        return self.q_b(self.q_norm(self.q_a(h))) if self.cfg.q_lora_rank else self.q(h)

    def attend(self, x: torch.Tensor, requests) -> torch.Tensor:
        h = self.attn_norm(x)
        return x + self.o(mla_attention(self.queries(h), self.kv_a(h), self.kv_b.weight, self.cfg, self.kv_norm,
                                        requests))

    def forward(self, x: torch.Tensor, requests: Requests | PagedLayer | None = None) -> torch.Tensor:
        x = self.attend(x, requests)
        return x + self.ffn_partial(self.mlp_norm(x), 0)


class TPDeepseekBlock(_DeepseekParts):
    """Rank r's block: query heads [r·H/p, (r+1)·H/p) (q or q_b, and kv_b, column-parallel by heads; o row-parallel,
    ★ all-reduce #1), the latent path whole; the FFN's share (★ all-reduce #2): the dense FFN's f/p, or the routed
    experts (tp: f'/p of each; ep: E/p whole) plus the shared experts' f_s/p."""

    def __init__(self, cfg: DeepseekConfig, layer: int, group: dist.ProcessGroup, placement: str = "tp",
                 dtype=torch.float32, device=None):
        super().__init__()
        p = dist.get_world_size(group)
        validate_deepseek(cfg, p, placement)
        kw = dict(dtype=dtype, device=device, bias=False)
        self.cfg, self.group, self.placement, self.layer = cfg, group, placement, layer
        self.heads = cfg.n_heads // p
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype, device)
        if cfg.q_lora_rank:  # q_a and its norm: replicated, computed whole on every rank
            self.q_a = nn.Linear(cfg.d_model, cfg.q_lora_rank, **kw)
            self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps, dtype, device)
            self.q_b = ColumnParallelLinear(cfg.q_lora_rank, cfg.n_heads * cfg.qk_head_dim, group,
                                            site="attn/q_b dx", **kw)
        else:
            self.q = ColumnParallelLinear(cfg.d_model, cfg.n_heads * cfg.qk_head_dim, group, site="attn/q dx", **kw)
        self.kv_a = nn.Linear(cfg.d_model, cfg.latent_dim, **kw)  # replicated: the latent is every head's
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.norm_eps, dtype, device)
        self.kv_b = ColumnParallelLinear(cfg.kv_lora_rank, cfg.n_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                                         group, site="attn/kv_b dx", **kw)
        self.o = RowParallelLinear(cfg.n_heads * cfg.v_head_dim, cfg.d_model, group, site="attn/all-reduce #1", **kw)
        experts, expert_ffn = ((cfg.n_routed_experts, cfg.moe_d_ffn // p) if placement == "tp"
                               else (cfg.n_routed_experts // p, cfg.moe_d_ffn))
        self._ffn(cfg, layer, experts, expert_ffn, cfg.n_shared_experts * cfg.moe_d_ffn // p, cfg.d_ffn // p,
                  dtype, device)
        self.first = 0 if placement == "tp" else dist.get_rank(group) * experts

    queries = DenseDeepseekBlock.queries

    @property
    def cache_layout(self) -> tuple[int, int, int]:
        """(planes, heads, width) of this block's cache: one latent plane, one "head" of c + r, on every rank."""
        return 1, 1, self.cfg.latent_dim

    def forward(self, x: torch.Tensor, requests: Requests | PagedLayer | None = None) -> torch.Tensor:
        h = self.attn_norm(x)
        x = x + self.o(mla_attention(self.queries(h), self.kv_a(h), self.kv_b.weight, self.cfg, self.kv_norm,
                                     requests))  # ★ all-reduce #1: partial [T, d] summed over the heads' ranks
        partial = self.ffn_partial(self.mlp_norm(x), self.first)  # [T, d]: this rank's share
        return x + reduce_from_region(partial, self.group, "mlp/all-reduce #2")  # ★ all-reduce #2

    def plan(self) -> list[Part]:
        """This rank's slices of DenseDeepseekBlock's parameters (the rules: layers/parallel/shard.py)."""
        c, rank, p = self.cfg, dist.get_rank(self.group), dist.get_world_size(self.group)
        mine = range(rank * self.heads, (rank + 1) * self.heads)
        q = "q_b.weight" if c.q_lora_rank else "q.weight"  # the heads' queries: from the query LoRA's q_b, or q
        out = whole("attn_norm.weight", "kv_a.weight", "kv_norm.weight", "mlp_norm.weight")
        out += whole("q_a.weight", "q_norm.weight") if c.q_lora_rank else []
        out += [Part(q, q, rows(heads_range(mine, c.qk_head_dim))),
                Part("kv_b.weight", "kv_b.weight", rows(heads_range(mine, c.qk_nope_head_dim + c.v_head_dim))),
                Part("o.weight", "o.weight", cols(heads_range(mine, c.v_head_dim)))]
        if not self.moe:
            (a, b), f = even(c.d_ffn, rank, p, "d_ffn"), c.d_ffn
            return out + [Part("gate_up", "gate_up", rows((a, b), (f + a, f + b))), Part("down", "down", cols((a, b)))]
        out += whole("router", "router_bias") + expert_parts(self.placement, c.moe_d_ffn, c.n_routed_experts, rank, p,
                                                               ("moe_d_ffn", "n_routed_experts"))
        if c.n_shared_experts:
            (a, b), f = even(c.n_shared_experts * c.moe_d_ffn, rank, p, "shared ffn"), c.n_shared_experts * c.moe_d_ffn
            out += [Part("shared_gate_up", "shared_gate_up", rows((a, b), (f + a, f + b))),
                    Part("shared_down", "shared_down", cols((a, b)))]
        return out


@torch.no_grad()
def routing_margin(blocks, x: torch.Tensor, requests: Requests | None) -> float:
    """The smallest gap, over every MoE layer and token, between the last group kept and the first dropped (by group
    score) and between the top_k-th and the next expert inside the kept groups (by biased score): a routing that a
    rounding could flip makes it tiny (the tests' guard against near-ties)."""
    gaps = []
    for block in blocks:
        x_mid = block.attend(x, requests)
        if block.moe:
            cfg, h = block.cfg, block.mlp_norm(x_mid)
            stats = torch.promote_types(h.dtype, torch.float32)
            choice = F.linear(h.to(stats), block.router.to(stats)).sigmoid() + block.router_bias.to(stats)
            per_group = choice.view(h.shape[0], cfg.n_group, -1)
            groups = per_group.topk(2, -1).values.sum(-1)  # [T, G]
            ranked = groups.sort(-1, descending=True).values
            if cfg.topk_group < cfg.n_group:
                gaps.append(float((ranked[:, cfg.topk_group - 1] - ranked[:, cfg.topk_group]).min()))
            kept = groups >= ranked[:, cfg.topk_group - 1:cfg.topk_group]
            inside = choice.masked_fill(~kept.repeat_interleave(per_group.shape[2], dim=1), float("-inf"))
            inside = inside.sort(-1, descending=True).values
            if cfg.top_k < cfg.topk_group * per_group.shape[2]:
                gaps.append(float((inside[:, cfg.top_k - 1] - inside[:, cfg.top_k]).min()))
        x = block(x, requests)
    return min(gaps, default=1.0)
