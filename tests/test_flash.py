"""FlashAttention-2 and FlashDecoding as readable PyTorch (layers/attention/flash.py), and the `flash` backend.

Oracles: attention with its scores materialized (context_parallel.materialized_attention), in float64, for outputs
and log-sum-exps; the dense model recomputed with no cache for the served tokens and logprobs; the memory traffic
counted tile by tile as the loops run against the closed forms written for this tiling and the paper's
materializing algorithm."""

import math

import pytest
import torch

from layers.attention.context_parallel import materialized_attention
from layers.attention.flash import (Traffic, flash_attention, flash_decoding, flash_traffic, sram_blocks,
                                    standard_traffic)
from layers.models.config import ModelConfig
from layers.models.dense import init_weights
from layers.models.llama import LlamaConfig
from layers.models.lm import dense_lm, shard_lm
from serve.config import EngineConfig
from serve.engine import LLMEngine
from tests.common import greedy_logprobs, named, serve_greedy
from tests.harness import run_ranks

CASES = [  # (h, h_kv, queries, keys, d, d_v, first query's position, B_r, B_c)
    (4, 4, 37, 37, 16, 16, 0, 16, 8),  # a fresh prompt: causal square, tiles that do not divide it
    (8, 2, 5, 70, 8, 8, 65, 4, 16),  # a chunk after a cached prefix, grouped-query heads
    (2, 1, 100, 130, 32, 24, 30, 32, 32),  # values narrower than keys (MLA's latent reads its first v_dim)
    (4, 2, 64, 64, 16, 16, 0, 64, 64),  # one tile
]


@pytest.mark.parametrize("h,h_kv,n_q,n_k,d,d_v,q_start,b_r,b_c", CASES)
def test_tiles_equal_materialized_attention_and_count_the_formula(h, h_kv, n_q, n_k, d, d_v, q_start, b_r, b_c):
    g = torch.Generator().manual_seed(n_q)
    q = torch.randn(h, n_q, d, dtype=torch.float64, generator=g)
    k = torch.randn(h_kv, n_k, d, dtype=torch.float64, generator=g)
    v = torch.randn(h_kv, n_k, d_v, dtype=torch.float64, generator=g)
    q_pos, k_pos = torch.arange(q_start, q_start + n_q), torch.arange(n_k)
    counted = Traffic()
    o, lse = flash_attention(q, k, v, q_pos, k_pos, block_q=b_r, block_k=b_c, traffic=counted)
    want_o, want_lse = materialized_attention(q, k, v, k_pos[None, :] <= q_pos[:, None])
    assert (o - want_o).abs().max() < 1e-12 and (lse - want_lse).abs().max() < 1e-12
    assert counted.total == flash_traffic(n_q, n_k, d, b_r, b_c, causal=True, q_start=q_start, d_v=d_v)
    # the batch-invariant mode's padded tiles (padding queries dropped, padding keys masked): the same attention
    o_pad, lse_pad = flash_attention(q, k, v, q_pos, k_pos, block_q=b_r, block_k=b_c, pad=True)
    assert (o_pad - want_o).abs().max() < 1e-12 and (lse_pad - want_lse).abs().max() < 1e-12
    # an explicit mask (KV eviction's window) with rows that see nothing: zero rows, lse -inf
    mask = (torch.rand(n_q, n_k, generator=g) < 0.3) & (k_pos[None, :] <= q_pos[:, None])
    mask[0] = False
    o, lse = flash_attention(q, k, v, mask=mask, block_q=b_r, block_k=b_c)
    want_o, want_lse = materialized_attention(q, k, v, mask)
    assert (o - want_o).abs().max() < 1e-12 and torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    assert (lse[~torch.isinf(lse)] - want_lse[~torch.isinf(want_lse)]).abs().max() < 1e-12


def test_flash_decoding_splits_the_keys_and_merges_exactly():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(8, 1, 16, dtype=torch.float64, generator=g)
    k, v = (torch.randn(2, 300, 16, dtype=torch.float64, generator=g) for _ in range(2))
    want_o, want_lse = materialized_attention(q, k, v, torch.ones(1, 300, dtype=torch.bool))
    for split in (1, 7, 64, 300, 512):
        counted = Traffic()
        o, lse = flash_decoding(q, k, v, split=split, traffic=counted)
        assert (o - want_o).abs().max() < 1e-12 and (lse - want_lse).abs().max() < 1e-12
        chunks = math.ceil(300 / split)
        # each chunk: its query read, its keys and values, its (o, lse) written; the merge reads them back
        assert counted.total == chunks * (16 + 17) + 300 * 32 + chunks * 17


def test_the_traffic_is_the_papers():
    """Θ(N²d²/M) for the paper's blocks against the materializing Θ(Nd + N²): the closed form for this tiling, at
    on-chip memories M between d and N·d, stays within constant factors of N²d²/M as N grows, and falls below the
    standard count once N is larger than a few tiles."""
    d = 64
    for m in (4 * d * 16, 4 * d * 64):  # on-chip memory of 16 and 64 key rows of 4·d
        b_r, b_c = sram_blocks(m, d)
        assert (b_r, b_c) == (min(m // (4 * d), d), m // (4 * d))
        ratios = []
        for n in (512, 1024, 2048, 4096, 8192):
            flash = flash_traffic(n, n, d, b_r, b_c)
            assert flash == 2 * n * d + n + 2 * d * n * math.ceil(n / b_r)  # Q, O, lse once; K, V per query block
            assert standard_traffic(n, n, d) == 4 * n * d + 4 * n * n
            ratios.append(flash / (n * n * d * d / m))
        assert max(ratios) / min(ratios) < 1.2  # Θ(N²d²/M): the ratio settles (about 8 with these blocks)
        # the paper's regime is d² < M: at M = 4·d² flash moves fewer elements than materializing, at M = d² more
        # (this tiling crosses over between d² and 2·d²)
        assert (flash_traffic(8192, 8192, d, b_r, b_c) < standard_traffic(8192, 8192, d)) == (m == 4 * d * d)


GPT2 = ModelConfig(d_model=64, n_heads=4, d_head=16, d_ffn=128, n_layers=2, max_seq_len=96, vocab_size=257)
LLAMA = LlamaConfig(d_model=64, n_heads=8, n_kv_heads=2, d_head=8, d_ffn=96, n_layers=2, max_seq_len=96,
                    vocab_size=257)


def serve_flash(ctx, cfg, reqs, config):
    """The engine with attention="flash" on small tiles (4 x 4, key chunks of 8: prompts span several tiles, decodes
    several chunks); rank 0's outputs (tokens, chosen logprobs) and stats."""
    from layers.attention.backends import BACKENDS

    flash = BACKENDS["flash"]
    saved = flash.block_q, flash.block_k, flash.split
    flash.block_q, flash.block_k, flash.split = 4, 4, 8
    try:
        dense = init_weights(dense_lm(cfg, torch.float64), seed=0, std=0.1)
        engine = LLMEngine(shard_lm(dense, "v2", ctx.group), ctx, config)
        done = serve_greedy(engine, named(reqs))
    finally:
        flash.block_q, flash.block_k, flash.split = saved
    if not ctx.is_main:
        return None
    stats = engine.stats()
    engine.shutdown()
    return done, stats


@pytest.mark.parametrize("cfg,p", [(GPT2, 1), (LLAMA, 2)], ids=["gpt2-p1", "llama-p2"])
def test_the_flash_backend_serves_the_oracles_tokens(cfg, p):
    g = torch.Generator().manual_seed(p)
    first = torch.randint(0, 257, (30,), generator=g).tolist()
    reqs = [(first, 5, 0), (first[:17] + [3, 4], 6, 2), (torch.randint(0, 257, (9,), generator=g).tolist(), 7, 2),
            (list(first), 4, 6)]
    config = EngineConfig(attention="flash", long_prefill_token_threshold=7, max_num_batched_tokens=16,
                          max_num_seqs=3, block_size=4, num_gpu_blocks_override=14)
    done, stats = run_ranks(p, serve_flash, cfg, reqs, config)[0]
    dense = init_weights(dense_lm(cfg, torch.float64), seed=0, std=0.1)
    for i, (prompt, new, _) in enumerate(reqs):
        ids, lps = greedy_logprobs(dense, prompt, new)
        assert done[f"r{i}"][0] == ids, i
        assert max(abs(a - b) for a, b in zip(done[f"r{i}"][1], lps)) < 1e-12
    assert stats["prefix_hit_tokens"] > 0 and stats["preemptions"] > 0  # chunks after a prefix, and recomputes


def test_the_backward_recomputes_the_tiles_and_equals_autograd():
    from layers.attention.flash import flash_causal

    g = torch.Generator().manual_seed(5)
    for h, h_kv, n, d, b_q, b_k in [(4, 4, 37, 16, 8, 16), (8, 2, 50, 8, 16, 8), (2, 1, 64, 32, 64, 64)]:
        q = torch.randn(h, n, d, dtype=torch.float64, generator=g, requires_grad=True)
        k, v = (torch.randn(h_kv, n, d, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(2))
        do = torch.randn(h, n, d, dtype=torch.float64, generator=g)
        got = torch.autograd.grad(flash_causal(q, k, v, b_q, b_k), (q, k, v), do)
        pos = torch.arange(n)
        want = torch.autograd.grad(materialized_attention(q, k, v, pos[None, :] <= pos[:, None])[0], (q, k, v), do)
        for a, b in zip(got, want):
            assert (a - b).abs().max() < 1e-12


def train_both_ways(ctx, cfg):
    """One Trainer step from the same weights and batch with attention sdpa and flash (float64): the loss, the
    gradient norm, and every gradient (as clipped; the step leaves them on the parameters)."""
    from train.step import Trainer, TrainConfig, train_lm

    ids = torch.randint(0, cfg.vocab_size, (3, 33), generator=torch.Generator().manual_seed(2))
    out = {}
    for attention in ("sdpa", "flash"):
        dense = init_weights(dense_lm(cfg, torch.float64), seed=0, std=0.1)
        trainer = Trainer(train_lm(dense, ctx.group), TrainConfig(attention=attention), ctx.group)
        got = trainer.step([ids])
        out[attention] = (got["loss"], got["grad_norm"],
                          {n: p.grad.clone() for n, p in trainer.lm.named_parameters()})
    return out


@pytest.mark.parametrize("cfg,p", [(GPT2, 1), (LLAMA, 2)], ids=["gpt2-p1", "llama-p2"])
def test_the_train_step_with_flash_attention_equals_sdpa(cfg, p):
    for out in run_ranks(p, train_both_ways, cfg):
        (loss, norm, grads), (f_loss, f_norm, f_grads) = out["sdpa"], out["flash"]
        assert abs(loss - f_loss) < 1e-12 and abs(norm - f_norm) < 1e-11 * norm
        assert max((grads[n] - f_grads[n]).abs().max().item() for n in grads) < 1e-12
