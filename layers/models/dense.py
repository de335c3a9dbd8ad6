"""The single-device reference: a GPT-2 pre-LN block and a stack of them.

This is the model a user already has. Tensor-parallel modules are built from
its weights (see layers/parallel/shard.py), and the equivalence check compares against it.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from layers.attention.attention import causal_attention
from layers.attention.varlen import Requests, check_cu_seqlens
from layers.models.config import ModelConfig
from layers.models.families import of


class DenseBlock(nn.Module):
    """x -> LN1 -> QKV [d x 3k] -> causal MHA -> out proj [k x d] -> +x -> LN2 -> up -> GeLU -> down -> +."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.cfg = cfg
        self.ln_1 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps, **kw)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.k, **kw)  # weight [3k, d], rows [Q | K | V]
        self.attn_out = nn.Linear(cfg.k, cfg.d_model, **kw)
        self.ln_2 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps, **kw)
        self.mlp_up = nn.Linear(cfg.d_model, cfg.d_ffn, **kw)
        self.mlp_down = nn.Linear(cfg.d_ffn, cfg.d_model, **kw)

    def forward(self, x: torch.Tensor, requests: Requests | None = None) -> torch.Tensor:  # x: [n, d]
        a = causal_attention(self.qkv(self.ln_1(x)), self.cfg.d_head, requests)  # [n, k]
        x = x + self.attn_out(a)
        h = F.gelu(self.mlp_up(self.ln_2(x)), approximate="tanh")  # [n, ffn]
        return x + self.mlp_down(h)


class Stack(nn.Module):
    """L blocks in sequence. `forward` returns every layer's output; the last one is the stack's output.

    x is [T, d]: one sequence, or many requests flattened, with `cu_seqlens` (e.g. [0, 10, 40])
    marking where each starts; `padded=True` runs the padded-attention baseline instead of varlen. A
    tensor-parallel stack changes what its blocks take through `enter` and `layer` (layers/models/tp_block.SPStack).
    """

    def __init__(self, cfg: ModelConfig, blocks: list[nn.Module]):
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor, cu_seqlens=None, padded: bool = False) -> tuple[torch.Tensor, ...]:
        requests = None if cu_seqlens is None else \
            Requests(check_cu_seqlens(cu_seqlens, x.shape[0], self.cfg.max_seq_len), padded)
        n, x = x.shape[0], self.enter(x)
        outs = []
        for block in self.blocks:
            x = self.layer(block, x, requests, n)
            outs.append(x)
        return tuple(outs)

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """What the first block takes from the stack's input [n, d]: all of it (SPStack: this rank's rows)."""
        return x

    def layer(self, block: nn.Module, x: torch.Tensor, requests, n: int) -> torch.Tensor:
        """One block on what the previous one returned (n: the stack input's rows; SPStack's blocks need it)."""
        return block(x, requests)


class DenseStack(Stack):
    """The single-device model: the L blocks of cfg's family (layers/models/families.py)."""

    def __init__(self, cfg, dtype: torch.dtype = torch.float32, device=None):
        super().__init__(cfg, of(cfg).dense_blocks(cfg, dtype, device))


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, std: float = 0.02) -> nn.Module:
    """Deterministic init, identical on every rank and device (drawn on the CPU).

    Biases and LayerNorm parameters are random too, so a bias added p times or a
    LayerNorm applied to the wrong slice cannot hide behind zeros and ones.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if ".ln_" in f".{name}" or "norm." in name:  # GPT-2's LayerNorms, Llama's RMSNorms (layers/models/llama.py)
            base = 1.0 if name.endswith("weight") else 0.0
            values = base + 0.1 * torch.randn(param.shape, generator=gen, dtype=torch.float64)
        else:
            values = std * torch.randn(param.shape, generator=gen, dtype=torch.float64)
        param.copy_(values.to(param.dtype))
    return model


def weights_checksum(model: nn.Module) -> torch.Tensor:
    """Two float64 numbers that differ, with overwhelming likelihood, when any weight differs."""
    total = torch.zeros(2, dtype=torch.float64)
    for i, param in enumerate(model.parameters()):
        flat = param.detach().to("cpu", torch.float64).flatten()
        ramp = torch.linspace(1.0, 2.0, flat.numel(), dtype=torch.float64)
        total += torch.stack([flat.sum(), (flat * ramp).sum() * (i + 1)])
    return total
