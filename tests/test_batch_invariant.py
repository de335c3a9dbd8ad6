"""The batch-invariant mode (EngineConfig.batch_invariant; docs/flash.md): one request's tokens and logprobs, bit for
bit, whatever other requests share its steps, how its prompt is chunked, its place in the batch and the pool's block
size; at tensor-parallel sizes 1 and 2.

No oracle computes bits: the check is equality (==) of the same request's chosen logprobs across runs that differ in
everything else, float32. Its parts: a product in fixed tiles of rows gives a row the same bits alone or among
others (a plain F.linear does not, measured beside it)."""

import pytest
import torch
import torch.nn.functional as F

from layers.models.config import ModelConfig
from layers.models.dense import init_weights
from layers.models.llama import LlamaConfig
from layers.models.lm import dense_lm, shard_lm
from layers.parallel.weight_format import TILE_ROWS, linear
from serve.build import prepare_weights
from serve.config import EngineConfig
from serve.engine import LLMEngine
from tests.common import greedy_logprobs, serve_greedy
from tests.harness import run_ranks

GPT2 = ModelConfig(d_model=128, n_heads=4, d_head=32, d_ffn=512, n_layers=2, max_seq_len=128, vocab_size=1000)
LLAMA = LlamaConfig(d_model=128, n_heads=8, n_kv_heads=2, d_head=16, d_ffn=384, n_layers=2, max_seq_len=128,
                    vocab_size=1000)


def test_a_tiled_product_gives_a_row_the_same_bits_among_any_rows():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(512, 384, generator=g), torch.randn(512, generator=g)
    x = torch.randn(40, 384, generator=g)
    alone = linear(x[:1], w, bias=b, tile=TILE_ROWS)
    assert torch.equal(alone, F.linear(torch.cat([x[:1], x.new_zeros(7, 384)]), w, b)[:1])  # one padded tile
    for n in (2, 5, 8, 9, 40):
        order = torch.randperm(n, generator=g)
        at = int((order == 0).nonzero())
        assert torch.equal(linear(x[:n][order], w, bias=b, tile=TILE_ROWS)[at], alone[0])
    # (what the tiles fix: on this machine's BLAS, F.linear gives a row other bits among 2 rows than alone)


def serve(ctx, cfg, workload, config):
    """workload: [(name, prompt, max_tokens, step it arrives)]; rank 0's {name: (tokens, chosen logprobs)}."""
    dense = init_weights(dense_lm(cfg, torch.float32), seed=0, std=0.05)
    engine = LLMEngine(prepare_weights(shard_lm(dense, "v2", ctx.group), config), ctx, config)
    done = serve_greedy(engine, workload)
    if not ctx.is_main:
        return None
    engine.shutdown()
    return done


@pytest.mark.parametrize("cfg,p", [(GPT2, 1), (LLAMA, 2)], ids=["gpt2-p1", "llama-p2"])
def test_one_request_gets_the_same_bits_in_any_batch(cfg, p):
    g = torch.Generator().manual_seed(1)
    target = torch.randint(0, 1000, (70,), generator=g).tolist()  # two tiles of 64 keys, and queries
    others = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (5, 60, 23, 41, 9)]
    runs = [  # (workload, settings): alone; among others from the start; arriving mid-stream at another place
        ([("t", target, 8, 0)], dict(long_prefill_token_threshold=64, block_size=16)),
        ([("t", target, 8, 0)] + [(f"o{i}", o, 6, 0) for i, o in enumerate(others)],
         dict(long_prefill_token_threshold=7, block_size=4)),
        ([(f"o{i}", o, 12, 0) for i, o in enumerate(others)] + [("t", target, 8, 3)],
         dict(long_prefill_token_threshold=16, block_size=8, max_num_seqs=3)),
    ]
    got = []
    for workload, settings in runs:
        config = EngineConfig(batch_invariant=True, max_num_batched_tokens=64, **{"max_num_seqs": 8, **settings})
        got.append(run_ranks(p, serve, cfg, workload, config)[0]["t"])
    assert got[0] == got[1] == got[2]  # tokens and every chosen logprob, to the bit
    # and right: the dense model recomputed with no cache (float64) gives the same tokens, logprobs to float32's error
    dense = init_weights(dense_lm(cfg, torch.float64), seed=0, std=0.05)
    ids, lps = greedy_logprobs(dense, target, 8)
    assert got[0][0] == ids and max(abs(a - b) for a, b in zip(got[0][1], lps)) < 1e-4


def refusals(ctx, cfg):
    """What the engine itself refuses (the library's entry): a model whose products are not tiled; more than one
    intra-op thread (the count read as a second thread would report it)."""
    from unittest import mock

    from serve.model_runner import check_invariant

    dense = init_weights(dense_lm(cfg, torch.float32), seed=0, std=0.05)
    config = EngineConfig(batch_invariant=True)
    said = []
    for lm, threads in ((shard_lm(dense, "v2", ctx.group), 1),
                        (prepare_weights(shard_lm(dense, "v2", ctx.group), config), 2)):
        try:
            with mock.patch.object(torch, "get_num_threads", lambda: threads):
                check_invariant(lm, config, ctx, 1)
        except ValueError as exc:
            said.append(str(exc))
    return said


def test_what_is_not_built_is_refused_in_one_line():
    untiled, threads = run_ranks(1, refusals, GPT2)[0]
    assert "products are not tiled" in untiled and "one intra-op thread" in threads
    for settings, message in ((dict(attention="cpu"), "leave attention at auto or flash"),
                              (dict(quantization="int8"), "with quantization is not built"),
                              (dict(kv_cache_dtype="fp8"), "with kv_cache_dtype is not built")):
        with pytest.raises(ValueError, match=message):
            EngineConfig(batch_invariant=True, **settings)
    with pytest.raises(ValueError, match="tensor_parallel_size=4 is not built"):
        EngineConfig(batch_invariant=True).check_batch_invariant(4)
    with pytest.raises(ValueError, match="pp > 1"):
        EngineConfig(batch_invariant=True).check_pipeline(2)
