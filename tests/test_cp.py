"""Context parallelism (layers/attention/context_parallel.py, launch/cp_check.py): the log-sum-exp merge over random
partitions, ring-attention prefill and decode over a split cache against the single-device stack at cp = 2, 3, 4 with
tp = 1 and 2 (GPT-2 and Llama with GQA, prompts not a multiple of 2·cp), every rank's collectives and ring messages against
the traffic model, and the zigzag layout's balance beside the naive split's."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from layers.attention.context_parallel import (causal_pairs, chunk_bounds, contiguous_positions, merge,
                                               partial_attention, zigzag_positions)
from tests.harness import run_ranks


def full_attention(q, k, v, q_pos, k_pos, scale):
    """Plain softmax attention in float64, written here: o [h, Tq, d] and lse [h, Tq]."""
    h_kv = k.shape[0]
    k, v = (t.repeat_interleave(q.shape[0] // h_kv, dim=0) for t in (k, v))
    s = (q @ k.transpose(1, 2)) * scale
    s = s.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], -math.inf)
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


@settings(max_examples=30, deadline=None)
@given(keys=st.integers(1, 40), parts=st.integers(1, 6), seed=st.integers(0, 2**31 - 1), gqa=st.sampled_from([1, 2]))
def test_merging_any_partition_of_the_keys_is_the_whole_attention(keys, parts, seed, gqa):
    """Keys cut into `parts` random parts (empty ones included), each attended alone and merged: the same output and
    log-sum-exp as one softmax over all keys, to 1e-12 in float64; a query that sees no key in a part gets −∞ there."""
    gen = torch.Generator().manual_seed(seed)
    h, d, tq = 4, 8, 5
    q = torch.randn(h, tq, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(h // gqa, keys, d, generator=gen, dtype=torch.float64) for _ in range(2))
    k_pos = torch.randperm(keys, generator=gen)  # positions in any order
    q_pos = torch.randint(0, keys, (tq,), generator=gen)
    want, want_lse = full_attention(q, k, v, q_pos, k_pos, d ** -0.5)
    owner = torch.randint(0, parts, (keys,), generator=gen)
    outs, lses = [], []
    for part in range(parts):
        idx = (owner == part).nonzero().flatten()
        o, lse = partial_attention(q, k[:, idx], v[:, idx], q_pos, k_pos[idx])
        assert bool(torch.isneginf(lse).all()) if idx.numel() == 0 else True
        outs.append(o)
        lses.append(lse)
    got, lse = merge(outs, lses)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_an_all_empty_row_merges_to_nothing():
    o = torch.ones(2, 3, 4, dtype=torch.float64)
    lse = torch.full((2, 3), -math.inf, dtype=torch.float64)
    got, got_lse = merge([o, 2 * o], [lse, lse])
    assert torch.equal(got, torch.zeros_like(o)) and bool(torch.isneginf(got_lse).all())


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_zigzag_balances_the_causal_work_and_the_naive_split_does_not(cp):
    """With 2·cp dividing S every rank's unmasked (query, key) pairs are equal; otherwise they differ by at most
    1.5·(S + 1) (about a row and a half at the end of the sequence; measured over S up to 400). The naive split's last
    rank does about 2·cp − 1 times its first's."""
    for n in range(2 * cp, 400):
        held = [zigzag_positions(n, cp, r) for r in range(cp)]
        assert sorted(p for rows in held for p in rows) == list(range(n))
        pairs = [causal_pairs(rows) for rows in held]
        if n % (2 * cp) == 0:
            assert len(set(pairs)) == 1, (n, pairs)
        assert max(pairs) - min(pairs) <= 1.5 * (n + 1), (n, pairs)
        sizes = [b - a for a, b in chunk_bounds(n, cp)]
        assert max(sizes) - min(sizes) <= 1
    naive = [causal_pairs(contiguous_positions(8 * cp, cp, r)) for r in range(cp)]
    assert naive[-1] / naive[0] == pytest.approx((2 * cp - 1) * 8 * cp / (8 * cp + cp), rel=0.2)


def _cp_check(ctx, family, cp, n, new):
    from launch.cp_check import run_cp_check
    from layers.models.config import ModelConfig
    from layers.models.llama import LlamaConfig

    cfg = (LlamaConfig(d_model=64, n_heads=8, n_kv_heads=2, d_head=8, d_ffn=96, n_layers=2, vocab_size=100)
           if family == "llama" else ModelConfig(d_model=64, n_heads=8, d_head=8, d_ffn=256, n_layers=2,
                                                 vocab_size=100, max_seq_len=128))
    res = run_cp_check(cfg, n=n, new_tokens=new, dtype=torch.float64, seed=3, tolerance=1e-12, cp=cp, ctx=ctx)
    return res


@pytest.mark.parametrize("family,cp,tp", [("gpt2", 2, 1), ("llama", 2, 2), ("llama", 3, 1), ("gpt2", 4, 1)])
def test_ring_prefill_and_split_cache_decode_equal_the_single_device_stack(family, cp, tp):
    """A prompt of 23 tokens (not a multiple of 2·cp) by ring attention, then 3 decodes over the split cache: every
    layer's output for every position within 1e-12 of the dense stack; every rank's all-reduces, merge all-gathers
    and pass-KV messages equal the model's, in order; each rank caches only its positions (1/cp of the request's,
    within a chunk's row), the new tokens on rank position % cp."""
    res = run_ranks(cp * tp, _cp_check, family, cp, 23, 3)[0]
    assert res["equivalent"] and res["ledger_matches_model"], res["layers"]
    assert max(layer["max_rel_err"] for layer in res["layers"]) < 1e-12
    held = {r["cp_rank"]: r["cached_positions"] for r in res["ranks"]}
    for c, n in held.items():
        assert n == len(zigzag_positions(23, cp, c)) + sum(1 for p in range(23, 26) if p % cp == c)
    assert sum(held.values()) == 26
    sent = {r["cp_rank"]: r["sent"] for r in res["ranks"]}
    assert all(s > 0 for s in sent.values())


def test_run_block_with_cp_end_to_end(tmp_path):
    import json

    from tests.launching import launch_on_pool

    proc, _ = launch_on_pool(4, "cp=2", "n_tokens=61", "cp_decode=2", "model=llama_tiny", "dtype=float64",
                             run_dir=tmp_path, script="run_block.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    res = report["cp_check"]
    assert report["equivalent"] and report["traffic_ok"] and res["cp"] == 2 and res["tp"] == 2
    assert "PASS: v2 at cp=2 x tp=2 matches the single-device block" in proc.stdout
    # each rank sends its own rows' K,V once per layer (cp − 1 = 1 step): 2·rows·h_kv/tp·d_head·8 bytes
    for r in res["ranks"]:
        assert r["sent"] == 4 * 2 * r["rows"] * 1 * 32 * 8


@pytest.mark.parametrize("overrides,script,message", [
    (["cp=3"], "run_block.py", "cp=3 must be a positive divisor of the world size 2"),
    (["cp=2", "pp=2"], "run_block.py", "pp=2 with cp=2 is not built"),
    (["cp=2", "n_tokens=3"], "run_block.py", "give at least 4 tokens"),
    (["cp=2", "model=mixtral_tiny"], "run_block.py", "mixtral blocks are not built for context parallelism"),
    (["cp=2", "variants=[v1]"], "run_block.py", "cp=2 runs variant v2"),
    (["cp=2", "block_size=3"], "serve.py", "block_size=3, not a multiple of 2; use block_size=2 or block_size=4"),
    (["cp=2", "model=deepseek_tiny"], "serve.py", "deepseek_v3 models are not built for context parallelism"),
    (["cp=2", "pp=2"], "serve.py", "cp=2 with pp is not built"),
])
def test_bad_cp_settings_fail_in_one_line(overrides, script, message):
    from tests.launching import refused

    refused(overrides, message, script=script)


# ---- serving over a split cache ------------------------------------------------------------------------------------


def _serve_cp(ctx, family, cp, block_size, pool_blocks, attention="auto"):
    from layers.attention.context_parallel import rank_groups
    from layers.models.config import ModelConfig
    from layers.models.dense import init_weights
    from layers.models.llama import LlamaConfig
    from layers.models.lm import dense_lm, greedy_reference, shard_lm
    from serve.config import EngineConfig
    from serve.offline import OfflineEngine
    from serve.request import Request

    cfg = (LlamaConfig(d_model=64, n_heads=8, n_kv_heads=2, d_head=8, d_ffn=96, n_layers=2, vocab_size=100,
                       max_seq_len=128) if family == "llama" else
           ModelConfig(d_model=64, n_heads=8, d_head=8, d_ffn=256, n_layers=2, vocab_size=100, max_seq_len=128))
    tp_group, cp_group = rank_groups(ctx.world_size, cp, ctx.rank)
    dense = init_weights(dense_lm(cfg, torch.float64), 0)
    lm = shard_lm(dense, "v2", tp_group)
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(0, 100, (12,), generator=gen).tolist()  # a prefix the later requests share
    prompts = [shared + torch.randint(0, 100, (n,), generator=gen).tolist() for n in (1, 5, 10, 3)]
    prompts[0] = prompts[0][:7]  # 7 and 13..22 tokens: none a multiple of 2·cp everywhere
    want = [greedy_reference(dense, p, 6) for p in prompts]
    config = EngineConfig(long_prefill_token_threshold=5, max_num_batched_tokens=16, max_num_seqs=16,
                          block_size=block_size, num_gpu_blocks_override=pool_blocks, attention=attention)
    res = OfflineEngine(lm, ctx, config, cp_group=cp_group).run([Request(i, p, 6, 2 * i) for i, p in
                                                                  enumerate(prompts)])
    same = all(r["output_ids"] == w.ids and all(abs(a - b) <= 1e-12 * max(1.0, abs(b))
                                               for a, b in zip(r["logits"], w.logits))
               for r, w in zip(res.requests, want))
    slots = res.num_blocks * block_size // cp  # this rank's pool: block_size/cp positions of every block
    per_slot = 2 * cfg.n_layers * max(cfg.n_kv_heads // dist_size(tp_group), 1) * cfg.d_head * 8
    return same, res.ledger_matches_model, res.kv_pool_bytes_per_rank == slots * per_slot, res.prefix_hit_tokens, \
        res.preemptions


def dist_size(group) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group)


@pytest.mark.parametrize("family,cp,tp,block_size,pool", [("gpt2", 2, 1, 4, None), ("llama", 2, 2, 4, 9),
                                                          ("llama", 3, 1, 6, None), ("gpt2", 4, 1, 8, 7)])
def test_serving_over_a_split_cache_equals_the_dense_recompute(family, cp, tp, block_size, pool):
    """Requests arriving over time, chunked prefill (5 tokens), prefix hits on a shared 12-token prefix and, with a
    small pool, preemption: greedy tokens and their logits (1e-12) equal the cache-free dense recompute; every step's
    collectives (the cp merges among them) equal the model's; each rank's pool is block_size/cp slots per block."""
    same, ledger_ok, pool_ok, hits, preemptions = run_ranks(cp * tp, _serve_cp, family, cp, block_size, pool)[0]
    assert same and ledger_ok and pool_ok
    assert hits > 0
    if pool is not None:
        assert preemptions > 0


def test_llm_with_context_parallel_size_against_the_oracle():
    """LLM(context_parallel_size=2): every finished request checked against the dense model (greedy and sampled), the
    last step's ledger equal to the model; what is not built refused in one line."""
    from serve import LLM, SamplingParams

    with LLM("llama_tiny", context_parallel_size=2, dtype="float64", check=True, block_size=8) as llm:
        outs = llm.generate([[1, 2, 3, 4, 5] * 5, [7, 8, 9]], SamplingParams(temperature=0.0, max_tokens=8))
        outs += llm.generate([[3, 1, 4, 1, 5, 9, 2, 6]], SamplingParams(max_tokens=8, temperature=0.8, seed=1))
        assert [o.oracle["verdict"] for o in outs] == ["match"] * 3
        assert llm.stats()["last_iteration"]["ledger_matches_model"]
    for kw, message in ((dict(block_size=6), "block_size=6, not a multiple of 4"),
                        (dict(pipeline_parallel_size=2), "with pipeline_parallel_size > 1 is not built"),
                        (dict(model="mixtral_tiny"), "mixtral models are not built for context parallelism")):
        with pytest.raises(ValueError, match=message):
            LLM(**{"model": "llama_tiny", "context_parallel_size": 4, **kw})
