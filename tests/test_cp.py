"""Context parallelism (layers/context_parallel.py, launch/cp_check.py): the log-sum-exp merge over random partitions,
ring-attention prefill and decode over a split cache against the single-device stack at cp = 2, 3, 4 with tp = 1
and 2 (GPT-2 and Llama with GQA, prompts not a multiple of 2·cp), every rank's collectives and ring messages against
the traffic model, and the zigzag layout's balance beside the naive split's."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from layers.context_parallel import (causal_pairs, chunk_bounds, contiguous_positions, merge, partial_attention,
                                     zigzag_positions)
from tests.harness import run_ranks


def full_attention(q, k, v, q_pos, k_pos, scale):
    """Plain softmax attention in float64, written here: o [h, Tq, d] and lse [h, Tq]."""
    h_kv = k.shape[0]
    k, v = (t.repeat_interleave(q.shape[0] // h_kv, dim=0) for t in (k, v))
    s = (q @ k.transpose(1, 2)) * scale
    s = s.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], -math.inf)
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


@settings(max_examples=60, deadline=None)
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
    from layers.config import ModelConfig
    from layers.llama import LlamaConfig

    cfg = (LlamaConfig(d_model=64, n_heads=8, n_kv_heads=2, d_head=8, d_ffn=96, n_layers=2, vocab_size=100)
           if family == "llama" else ModelConfig(d_model=64, n_heads=8, d_head=8, d_ffn=256, n_layers=2,
                                                 vocab_size=100, max_seq_len=128))
    res = run_cp_check(cfg, n=n, new_tokens=new, dtype=torch.float64, seed=3, tolerance=1e-12, cp=cp, ctx=ctx)
    return res


@pytest.mark.parametrize("family,cp,tp", [("gpt2", 2, 1), ("llama", 2, 2), ("llama", 3, 1), ("gpt2", 3, 2),
                                          ("llama", 4, 1), ("gpt2", 4, 2)])
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


@pytest.mark.parametrize("overrides,message", [
    (["cp=3"], "cp=3 must be a positive divisor of the world size 2"),
    (["cp=2", "pp=2"], "pp=2 with cp=2 is not built"),
    (["cp=2", "n_tokens=3"], "give at least 4 tokens"),
    (["cp=2", "model=mixtral_tiny"], "mixtral blocks are not built for context parallelism"),
    (["cp=2", "variants=[v1]"], "cp=2 runs variant v2"),
])
def test_bad_cp_settings_fail_in_one_line(overrides, message):
    from tests.launching import settings_phase

    proc = settings_phase(overrides, world=2, script="run_block.py")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
