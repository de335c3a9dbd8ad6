"""Qwen3 (transformers' Qwen3ForCausalLM): the Llama block with an RMSNorm on every query and key head before RoPE.

    x -> RMSNorm -> q [d -> h·dh], k, v [d -> h_kv·dh] -> RMSNorm each q head, each k head (over dh) -> RoPE(q, k)
      -> causal GQA -> o [h·dh -> d] -> +x -> RMSNorm -> gate|up -> silu(gate)·up -> down -> +x      (no biases)

q_norm and k_norm hold dh weights each, shared by all heads; head_dim is explicit (Qwen3-8B: h·dh = 4096 = d, Qwen3-
0.6B: 16·128 = 2048 ≠ d = 1024). Everything else is Llama's (layers/models/llama.py): this module adds the two norms and
nothing more.

Tensor parallel: each rank holds whole heads (Llama's head-aligned cut), so each head is normalized on the rank that
holds it: the norms are replicated, whole on every rank, and the forward adds no collective (2 all-reduces per block,
as Llama). In backward each rank's gradient of the norm weights covers its own heads only: ★ one all-reduce of
[2·dh] per block (copy_to_region; transformers' tensor-parallel plan: "replicated_with_grad_allreduce").

Checkpoints: Llama's layout (layers/models/hf_llama.py) and, per layer, self_attn.q_norm.weight and
self_attn.k_norm.weight.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from layers.attention.attention import PagedLayer
from layers.attention.varlen import Requests
from layers.models import hf_llama
from layers.models.families import Family, same_blocks
from layers.models.llama import (DenseLlamaBlock, LlamaConfig, RMSNorm, TPLlamaBlock, TPLlamaBlockSP, rms_norm,
                                 rotary_attention, validate_llama)
from layers.parallel.shard import Part, whole
from tp.comm import copy_to_region
from tp.dist import ConfigError


@dataclass(frozen=True)
class Qwen3Config(LlamaConfig):
    """A Llama shape whose attention normalizes each query and key head (norm_eps, as the block's norms)."""

    norm_eps: float = 1e-6

    family = "qwen3"
    qk_norm = True  # the analytic models (tp/): q_norm and k_norm, replicated, their gradients all-reduced


QWEN3_TINY = Qwen3Config(d_model=128, n_heads=8, n_kv_heads=4, d_head=32, d_ffn=384, n_layers=2, max_seq_len=512,
                         vocab_size=1000)  # = conf/model/qwen3_tiny.yaml; h·dh = 256 ≠ d


def qk_norm_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                      k_weight: torch.Tensor, cfg: Qwen3Config, requests: Requests | PagedLayer | None) -> torch.Tensor:
    """q [T, h·dh], k, v [T, h_kv·dh] (this rank's whole heads): each q and k head RMS-normalized over its dh values
    and scaled by the shared weights [dh], then Llama's RoPE and causal GQA. Returns [T, h·dh]."""
    q, k = (rms_norm(t.unflatten(-1, (-1, cfg.d_head)), w, cfg.norm_eps).flatten(-2)
            for t, w in ((q, q_weight), (k, k_weight)))
    return rotary_attention(q, k, v, cfg, requests)


class DenseQwen3Block(DenseLlamaBlock):
    def __init__(self, cfg: Qwen3Config, dtype=torch.float32, device=None):
        super().__init__(cfg, dtype, device)
        self.q_norm = RMSNorm(cfg.d_head, cfg.norm_eps, dtype, device)
        self.k_norm = RMSNorm(cfg.d_head, cfg.norm_eps, dtype, device)

    def attention(self, q, k, v, requests):
        return qk_norm_attention(q, k, v, self.q_norm.weight, self.k_norm.weight, self.cfg, requests)


class TPQwen3Block(TPLlamaBlock):
    """TPLlamaBlock (column q|k|v of this rank's heads, row o; column gate|up, row down) with the norms whole here."""

    def __init__(self, cfg: Qwen3Config, group: dist.ProcessGroup, dtype=torch.float32, device=None):
        super().__init__(cfg, group, dtype, device)
        self.q_norm = RMSNorm(cfg.d_head, cfg.norm_eps, dtype, device)
        self.k_norm = RMSNorm(cfg.d_head, cfg.norm_eps, dtype, device)

    def attention(self, q, k, v, requests):
        # forward: identity (no collective); backward: ★ all-reduce of the norms' gradients [2·dh], partial over heads
        weights = copy_to_region(torch.cat([self.q_norm.weight, self.k_norm.weight]), self.group, "attn/qk_norm dw")
        return qk_norm_attention(q, k, v, *weights.chunk(2), self.cfg, requests)

    def plan(self) -> list[Part]:
        return super().plan() + whole("q_norm.weight", "k_norm.weight")


class TPQwen3BlockSP(TPQwen3Block, TPLlamaBlockSP):
    """v2sp: TPLlamaBlockSP's forward (rows split between sub-layers) with Qwen3's attention."""


# ---- checkpoints: Llama's layout and two keys per layer -------------------------------------------------------------


def config_from_hf(hf: dict) -> Qwen3Config:
    """Qwen3Config from a Qwen3 config.json: Llama's fields and refusals (layers/models/hf_llama.py); sliding-window
    layers are refused by name."""
    if hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or ()):
        raise ConfigError("use_sliding_window=true is not supported: the blocks attend to the whole prefix")
    return Qwen3Config(**dataclasses.asdict(hf_llama.config_from_hf(hf)))


def layer_keys(cfg: Qwen3Config, state, prefix: str, i: int) -> dict[str, tuple[str, ...]]:
    return {**hf_llama.layer_keys(cfg, state, prefix, i), "q_norm.weight": (f"{prefix}{i}.self_attn.q_norm.weight",),
            "k_norm.weight": (f"{prefix}{i}.self_attn.k_norm.weight",)}


def toy_config(s: dict, ids: dict):
    """transformers' Qwen3Config of the toy model (serve/toy_model.py): head_dim 32, so h·dh = 2d."""
    import transformers

    return transformers.Qwen3Config(intermediate_size=s["hidden"] * 3, head_dim=32, **hf_llama.toy_shape(s, ids))


FAMILY = Family(
    "qwen3", "Qwen3", Qwen3Config, config_from_hf,
    names=lambda cfg, state, n_layers, lm: hf_llama.layout_names(cfg, state, n_layers, lm, layer_keys),
    expected_shapes=lambda cfg, state, lm: hf_llama.layout_shapes(cfg, state, lm, layer_keys, "Qwen3"),
    validate=lambda cfg, p, moe_parallel="tp": validate_llama(cfg, p),
    **same_blocks(DenseQwen3Block, {"v2": TPQwen3Block, "v2sp": TPQwen3BlockSP}),
    toy=toy_config,
)
