"""The single-device reference block against the formulas written out by hand."""

import math

import torch

from layers.models.config import ModelConfig
from layers.models.dense import DenseBlock, DenseStack, init_weights, weights_checksum

CFG = ModelConfig(d_model=48, n_heads=4, d_head=12, d_ffn=96, n_layers=3)


def naive_block(b: DenseBlock, x: torch.Tensor) -> torch.Tensor:
    """GPT-2 block with explicit loops over heads, an explicit causal mask and the tanh GeLU formula."""
    def ln(m, t):
        mu = t.mean(-1, keepdim=True)
        var = ((t - mu) ** 2).mean(-1, keepdim=True)
        return (t - mu) / torch.sqrt(var + m.eps) * m.weight + m.bias

    n, k, dh = x.shape[0], CFG.k, CFG.d_head
    qkv = ln(b.ln_1, x) @ b.qkv.weight.T + b.qkv.bias
    q, kk, v = qkv[:, :k], qkv[:, k:2 * k], qkv[:, 2 * k:]
    heads = []
    for h in range(CFG.n_heads):
        cols = slice(h * dh, (h + 1) * dh)
        scores = q[:, cols] @ kk[:, cols].T / math.sqrt(dh)
        scores = scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
        heads.append(torch.softmax(scores, -1) @ v[:, cols])
    x = x + torch.cat(heads, -1) @ b.attn_out.weight.T + b.attn_out.bias
    u = ln(b.ln_2, x) @ b.mlp_up.weight.T + b.mlp_up.bias
    g = 0.5 * u * (1 + torch.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u ** 3)))
    return x + g @ b.mlp_down.weight.T + b.mlp_down.bias


def test_dense_block_matches_the_written_out_formula():
    block = init_weights(DenseBlock(CFG, torch.float64), seed=3)
    x = torch.randn(7, CFG.d_model, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(block(x), naive_block(block, x), rtol=1e-12, atol=1e-12)


def test_dense_attention_is_causal():
    block = init_weights(DenseBlock(CFG, torch.float64), seed=3)
    x = torch.randn(7, CFG.d_model, dtype=torch.float64)
    y = x.clone()
    y[5:] += 1.0  # change only the last two tokens
    with torch.no_grad():
        torch.testing.assert_close(block(x)[:5], block(y)[:5], rtol=0, atol=0)
        assert not torch.allclose(block(x)[5:], block(y)[5:])


def test_init_is_deterministic_and_not_trivial():
    a = init_weights(DenseStack(CFG), seed=1)
    b = init_weights(DenseStack(CFG), seed=1)
    c = init_weights(DenseStack(CFG), seed=2)
    assert torch.equal(weights_checksum(a), weights_checksum(b))
    assert not torch.equal(weights_checksum(a), weights_checksum(c))
    blk = a.blocks[0]
    # Biases and LayerNorm parameters are not left at 0 and 1, so bias bugs show up.
    assert blk.attn_out.bias.abs().min() > 0 and blk.mlp_down.bias.abs().min() > 0
    assert not torch.allclose(blk.ln_1.weight, torch.ones_like(blk.ln_1.weight))


def test_checksum_sees_a_single_changed_weight():
    a = init_weights(DenseStack(CFG), seed=1)
    before = weights_checksum(a)
    with torch.no_grad():
        a.blocks[2].mlp_up.weight[3, 4] += 1e-3
    assert not torch.equal(before, weights_checksum(a))
