"""Mixture-of-experts blocks: Llama attention, then Mixtral's routed FFN, on one device and on p ranks.

    x -> RMSNorm -> attention (layers/models/llama.py: RoPE, GQA) -> +x
      -> RMSNorm -> h -> router [d -> E] -> softmax (float32 at least) -> top-k experts per token, the k weights
         renormalized to sum to 1 -> Σ_j w_j · FFN_{e_j}(h), each expert a SwiGLU FFN [d -> 2f -> d] -> +x

Parameters grow with E, the work per token with k. Three placements on p ranks (setting `moe_parallel`):

    tp      every expert split like the dense FFN: rank r holds f/p of each expert's gate|up rows and of its down
            columns, computes every routed (token, expert) pair on that slice; ★ one all-reduce [T, d]
    ep      rank r holds experts [r·E/p, (r+1)·E/p) whole and computes only the pairs routed to them; ★ one
            all-reduce [T, d] sums the ranks' partial outputs: tp's bytes, the work following the routing
    ep_a2a  data-parallel attention (DeepSeek): each rank holds its own tokens and the whole attention; experts as
            in ep. ★ all-to-all dispatch sends each (token, expert) pair's row to its expert's rank, the experts
            run, ★ all-to-all combine brings the rows back, and the token's rank weights and sums them. The split
            sizes come first (★ an all-to-all of p counts) and are read on the host

The pairs are grouped by expert with one stable sort and each group's size is read on the host: the waits MoE adds
per layer, one (tp, ep) or two (ep_a2a: the split sizes, then the received rows' groups); fused MoE kernels keep
them on the device.

Each expert's group runs as one matmul (a loop over the E/p local experts, never over requests or tokens). Expert weights are stacked as transformers stores them:
gate_up [E, 2f, d] (each expert's gate rows, then its up rows) and down [E, d, f].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from layers.attention.attention import PagedLayer
from layers.attention.varlen import Requests
from layers.models.llama import LlamaConfig, RMSNorm, TPLlamaBlock, dense_attention, rotary_attention, validate_llama
from layers.parallel.shard import Cut, Part, even, whole
from tp.comm import all_to_all_rows, reduce_from_region
from tp.dist import ConfigError

MOE_PARALLEL = ("tp", "ep", "ep_a2a")


@dataclass(frozen=True)
class MoEConfig(LlamaConfig):
    """A Llama shape whose FFN is routed: n_experts SwiGLU experts of d_ffn each, top_k of them per token."""

    n_experts: int = 8
    top_k: int = 2

    family = "mixtral"


MIXTRAL_TINY = MoEConfig(d_model=128, n_heads=8, n_kv_heads=2, d_head=16, d_ffn=192, n_layers=2, max_seq_len=256,
                         vocab_size=1000, n_experts=8, top_k=2)


def validate_moe(cfg: MoEConfig, p: int, placement: str) -> None:
    """ConfigError naming the setting to change; the same verdict on every rank."""
    if placement not in MOE_PARALLEL:
        raise ConfigError(f"unknown moe_parallel {placement!r}; choose tp, ep or ep_a2a")
    if not 1 <= cfg.top_k <= cfg.n_experts:
        raise ConfigError(f"model.top_k={cfg.top_k} must be between 1 and model.n_experts={cfg.n_experts}")
    if placement in ("ep", "ep_a2a") and cfg.n_experts % p:
        raise ConfigError(f"moe_parallel={placement}: model.n_experts={cfg.n_experts} is not divisible by p={p} "
                          f"(each rank holds n_experts/p whole experts)")
    validate_llama(cfg, 1 if placement == "ep_a2a" else p)  # ep_a2a's attention is replicated: its shape alone


# ---- routing and the experts --------------------------------------------------------------------------------------


def route(h: torch.Tensor, router: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """h [T, d] -> (weights [T, k], expert ids [T, k]): softmax over the E router logits in float32 at least (as
    transformers' MixtralTopKRouter), the top k by torch.topk, their weights renormalized to sum to 1."""
    stats = torch.promote_types(h.dtype, torch.float32)
    probs = torch.softmax(F.linear(h, router).to(stats), dim=-1)
    top, ids = probs.topk(k, dim=-1)
    return top / top.sum(dim=-1, keepdim=True), ids


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One expert: x [n, d], gate_up [2f', d], down [d, f'] -> [n, d]."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def group_by_expert(local: torch.Tensor, n_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """local [n]: each pair's local expert index, or anything outside [0, n_local) for pairs not here. Returns
    (the pairs' order grouped by local expert, stable, [n]; each local expert's count [n_local], on the device).
    No boolean-mask indexing and no bincount (both make the host wait on a GPU): the pairs not here go to one
    extra bin, counted by a scatter-add."""
    slot = torch.where((local >= 0) & (local < n_local), local, n_local)
    counts = torch.zeros(n_local + 1, dtype=torch.long, device=local.device).scatter_add_(0, slot, torch.ones_like(slot))
    return torch.argsort(slot, stable=True), counts[:n_local]


def experts_apply(x: torch.Tensor, rows: torch.Tensor, counts: list[int], gate_up: torch.Tensor,
                  down: torch.Tensor) -> torch.Tensor:
    """x[rows] through their experts, one matmul per expert (rows grouped by local expert, counts[e] of expert e's):
    [sum(counts), d], in the order of rows."""
    outs, at = [], 0
    for e, n in enumerate(counts):
        if n:
            outs.append(swiglu(x[rows[at:at + n]], gate_up[e], down[e]))
            at += n
    return torch.cat(outs) if outs else x.new_zeros((0, down.shape[1]))


def moe_local(h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
              first: int) -> torch.Tensor:
    """Σ over the (token, j) pairs whose expert is one of [first, first + E_local) of w_tj · FFN_e(h_t): [T, d].
    Each output is weighted in the weights' dtype, then rounded to h's (transformers' order)."""
    k = ids.shape[1]
    order, counts = group_by_expert(ids.flatten() - first, gate_up.shape[0])
    counts = counts.tolist()  # the layer's one host wait: the group sizes, which shape the matmuls
    pairs = order[:sum(counts)]  # pair i is token i // k's j = i % k
    y = experts_apply(h, pairs // k, counts, gate_up, down)
    y = (y * weights.flatten()[pairs, None]).to(h.dtype)
    return torch.zeros_like(h).index_add_(0, pairs // k, y)


def expert_parts(placement: str, ffn: int, experts: int, rank: int, p: int, names: tuple[str, str]) -> list[Part]:
    """This rank's slices of the stacked experts gate_up [E, 2f, d] and down [E, d, f]: tp, every expert's f/p (its
    rows of gate and of up, its columns of down); ep, E/p whole experts. names: f's and E's, for the messages."""
    if placement == "tp":
        (a, b), f = even(ffn, rank, p, names[0]), ffn
        return [Part("gate_up", "gate_up", Cut(1, ((a, b), (f + a, f + b)))), Part("down", "down", Cut(2, ((a, b),)))]
    mine = Cut(0, (even(experts, rank, p, names[1]),))
    return [Part("gate_up", "gate_up", mine), Part("down", "down", mine)]


# ---- blocks ---------------------------------------------------------------------------------------------------


class _MoEFFN(nn.Module):
    """The routed FFN's parameters: router [E, d] (replicated), experts gate_up [E', 2f', d] and down [E', d, f']."""

    def _make_ffn(self, cfg: MoEConfig, experts: int, ffn: int, dtype, device) -> None:
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype, device)
        self.router = nn.Parameter(torch.empty(cfg.n_experts, cfg.d_model, dtype=dtype, device=device))
        self.gate_up = nn.Parameter(torch.empty(experts, 2 * ffn, cfg.d_model, dtype=dtype, device=device))
        self.down = nn.Parameter(torch.empty(experts, cfg.d_model, ffn, dtype=dtype, device=device))


class DenseMoEBlock(_MoEFFN):
    """The single-device MoE block: the reference every placement is checked against."""

    def __init__(self, cfg: MoEConfig, dtype=torch.float32, device=None):
        super().__init__()
        self.cfg = cfg
        dense_attention(self, cfg, dtype, device)
        self._make_ffn(cfg, cfg.n_experts, cfg.d_ffn, dtype, device)

    def attend(self, x: torch.Tensor, requests) -> torch.Tensor:
        h = self.attn_norm(x)
        return x + self.o(rotary_attention(self.q(h), self.k(h), self.v(h), self.cfg, requests))

    def routing(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(h, weights, expert ids) of the block's FFN input x (after attention)."""
        h = self.mlp_norm(x)
        return (h, *route(h, self.router, self.cfg.top_k))

    def forward(self, x: torch.Tensor, requests: Requests | PagedLayer | None = None) -> torch.Tensor:
        x = self.attend(x, requests)
        h, weights, ids = self.routing(x)
        return x + moe_local(h, weights, ids, self.gate_up, self.down, 0)


class TPMoEBlock(TPLlamaBlock, _MoEFFN):
    """tp or ep: TP attention (TPLlamaBlock's head-aligned q|k|v, row-parallel o, ★ all-reduce #1), then the routed
    FFN with every expert split (tp) or whole experts per rank (ep), ★ all-reduce #2 of the partial [T, d]."""

    def __init__(self, cfg: MoEConfig, group: dist.ProcessGroup, placement: str = "tp", dtype=torch.float32,
                 device=None):
        p = dist.get_world_size(group)
        validate_moe(cfg, p, placement)
        super().__init__(cfg, group, dtype, device)
        del self.gate_up, self.down, self.mlp_norm  # the dense FFN's: replaced by the experts
        self.placement = placement
        experts, ffn = (cfg.n_experts, cfg.d_ffn // p) if placement == "tp" else (cfg.n_experts // p, cfg.d_ffn)
        self._make_ffn(cfg, experts, ffn, dtype, device)
        self.first = 0 if placement == "tp" else dist.get_rank(group) * experts  # the first expert held here

    def forward(self, x: torch.Tensor, requests: Requests | PagedLayer | None = None) -> torch.Tensor:
        q, k, v = self.qkv(self.attn_norm(x)).split(self.qkv_split, dim=-1)  # this rank's query heads, its K,V heads
        x = x + self.o(rotary_attention(q, k, v, self.cfg, requests))  # ★ all-reduce #1: partial [T, d] summed
        h = self.mlp_norm(x)
        weights, ids = route(h, self.router, self.cfg.top_k)  # replicated router, replicated h: the same routing
        partial = moe_local(h, weights, ids, self.gate_up, self.down, self.first)  # [T, d]: this rank's share
        return x + reduce_from_region(partial, self.group, "mlp/all-reduce #2")  # ★ all-reduce #2: [T, d]

    def plan(self) -> list[Part]:
        c, rank, p = self.cfg, dist.get_rank(self.group), dist.get_world_size(self.group)
        attention = [part for part in super().plan() if part.param.split(".")[0] in ("attn_norm", "qkv", "o")]
        return (attention + whole("mlp_norm.weight", "router")
                + expert_parts(self.placement, c.d_ffn, c.n_experts, rank, p, ("d_ffn", "n_experts")))


class EPAllToAllBlock(DenseMoEBlock):
    """ep_a2a: data-parallel attention (this rank's own tokens, the whole attention replicated), whole experts
    [r·E/p, (r+1)·E/p) per rank, tokens moved to their experts and back by all-to-alls."""

    def __init__(self, cfg: MoEConfig, group: dist.ProcessGroup, dtype=torch.float32, device=None):
        p = dist.get_world_size(group)
        validate_moe(cfg, p, "ep_a2a")
        nn.Module.__init__(self)
        self.cfg, self.group = cfg, group
        dense_attention(self, cfg, dtype, device)  # replicated: data-parallel attention
        self.per_rank = cfg.n_experts // p
        self._make_ffn(cfg, self.per_rank, cfg.d_ffn, dtype, device)

    def forward(self, x: torch.Tensor, requests: Requests | PagedLayer | None = None) -> torch.Tensor:
        """x: this rank's own tokens [T_r, d] (T_r may be 0); returns their outputs [T_r, d]."""
        g, k, per = self.group, self.cfg.top_k, self.per_rank
        p = dist.get_world_size(g)
        x = self.attend(x, requests) if x.shape[0] else x
        h, weights, ids = self.routing(x)
        self.routed = ids  # the routing this rank took (run_block predicts the all-to-alls from it)
        flat = ids.flatten()  # [T_r·k] pairs, token-major
        by_dest = torch.argsort(flat // per, stable=True)  # grouped by the rank holding each pair's expert
        send = group_by_expert(flat, per * p)[1].view(p, per)  # pairs for each (rank, its local expert)
        recv = all_to_all_rows(send, [1] * p, [1] * p, g, "mlp/dispatch counts")  # ★ [p, E/p] counts, int64
        # the layer's one host wait: the split sizes both ways and the received rows' group sizes
        sizes = torch.cat([send.sum(1), recv.sum(1), recv.sum(0)]).tolist()
        send_counts, recv_counts, counts = sizes[:p], sizes[p:2 * p], sizes[2 * p:]
        rows = h[by_dest // k]
        got = all_to_all_rows(rows, send_counts, recv_counts, g, "mlp/dispatch")  # ★ all-to-all: [Σ recv, d]
        experts = all_to_all_rows((flat[by_dest] % per)[:, None], send_counts, recv_counts, g,
                                  "mlp/dispatch experts")[:, 0]  # ★ each row's expert, local to its rank, int64
        order = torch.argsort(experts, stable=True)
        out = torch.empty_like(got).index_copy_(0, order, experts_apply(got, order, counts, self.gate_up, self.down))
        back = all_to_all_rows(out, recv_counts, send_counts, g, "mlp/combine")  # ★ all-to-all: [T_r·k, d]
        pairs = by_dest  # back[i] is the output of pair by_dest[i]
        y = (back * weights.flatten()[pairs, None]).to(h.dtype)
        return x + torch.zeros_like(h).index_add_(0, pairs // k, y)

    def plan(self) -> list[Part]:
        rank, p = dist.get_rank(self.group), dist.get_world_size(self.group)
        return (whole("attn_norm.weight", "q.weight", "k.weight", "v.weight", "o.weight", "mlp_norm.weight", "router")
                + expert_parts("ep", self.cfg.d_ffn, self.cfg.n_experts, rank, p, ("d_ffn", "n_experts")))


# ---- building and loading -------------------------------------------------------------------------------------

# our dense parameter -> transformers' MixtralDecoderLayer key (5.x keeps the experts stacked, as we do)
HF_LAYER_KEYS = {"attn_norm.weight": "input_layernorm.weight", "q.weight": "self_attn.q_proj.weight",
                 "k.weight": "self_attn.k_proj.weight", "v.weight": "self_attn.v_proj.weight",
                 "o.weight": "self_attn.o_proj.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
                 "router": "mlp.gate.weight", "gate_up": "mlp.experts.gate_up_proj", "down": "mlp.experts.down_proj"}


@torch.no_grad()
def dense_routing(stack, x: torch.Tensor, requests: Requests | None) -> tuple[list[torch.Tensor], float]:
    """Every layer's expert ids [T, k] in a dense MoE stack, and the smallest gap between a token's k-th and (k+1)-th
    router probability over all layers: a routing that a rounding could flip (a near-tie) makes it tiny."""
    ids, gaps = [], []
    for block in stack.blocks:
        h, _, chosen = block.routing(block.attend(x, requests))
        ids.append(chosen)
        if block.cfg.top_k < block.cfg.n_experts:
            top = torch.softmax(F.linear(h, block.router).to(torch.promote_types(h.dtype, torch.float32)), -1)
            top = top.sort(-1, descending=True).values
            gaps.append(float((top[:, block.cfg.top_k - 1] - top[:, block.cfg.top_k]).min()) if len(top) else 1.0)
        x = block(x, requests)
    return ids, min(gaps, default=1.0)


def moe_block(cfg: MoEConfig, placement: str, group: dist.ProcessGroup, dtype=torch.float32, device=None):
    """This rank's block of one placement, its parameters not yet loaded (load_plan fills them from block.plan())."""
    if placement == "ep_a2a":
        return EPAllToAllBlock(cfg, group, dtype, device)
    return TPMoEBlock(cfg, group, placement, dtype, device)
