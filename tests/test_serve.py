"""The serving engine against its oracles: a cache-free dense recompute, schedule invariance, the traffic model."""

import dataclasses
import random

import pytest
import torch
import torch.nn.functional as F

from layers.attention.attention import PagedLayer, causal_attention
from layers.attention.backends import prefix_causal_mask
from layers.models.config import ModelConfig
from layers.models.dense import init_weights
from layers.models.lm import DenseLM, greedy_reference, shard_lm
from serve.offline import OfflineEngine
from serve.config import EngineConfig
from serve.control import PlanMismatch
from serve.hooks import StepHook
from serve.request import Request
from tests.harness import run_ranks

CFG = ModelConfig(d_model=64, n_heads=8, d_head=8, d_ffn=256, n_layers=3, max_seq_len=96, vocab_size=1001)
# (prompt length, max_new_tokens, arrival iteration)
WORKLOAD = [(9, 6, 0), (17, 4, 0), (3, 8, 2), (25, 5, 3), (1, 3, 3), (12, 7, 6), (4, 1, 60)]  # the last: long idle


def make_requests(workload=WORKLOAD, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return [Request(i, torch.randint(0, CFG.vocab_size, (n,), generator=gen).tolist(), new, arrival)
            for i, (n, new, arrival) in enumerate(workload)]


def dense_lm(dtype=torch.float64, device=None):
    return init_weights(DenseLM(CFG, dtype), seed=0).to(device)


# ---- attention with a cache, single device ---------------------------------------------------


def test_prefix_causal_mask():
    mask = prefix_causal_mask(q_start=3, q_rows=2, kv_length=5)
    assert mask.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]
    assert torch.equal(prefix_causal_mask(0, 4, 4), torch.ones(4, 4, dtype=torch.bool).tril())


@pytest.mark.parametrize("mode", ["batched", "cpu", "reference"])
@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("chunks", [[10], [1] * 10, [3, 3, 3, 1], [4, 6], [7, 1, 1, 1]])
def test_chunked_attention_over_blocks_equals_causal_attention(chunks, block_size, mode):
    """One request's chunks written into scattered blocks of a pool, read back through its block table."""
    from serve.model_runner import prepare_step
    from serve.plan import ScheduledRequest, SchedulerOutput

    h, dh, n = 4, 8, sum(chunks)
    qkv = torch.randn(n, 3 * h * dh, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    full = causal_attention(qkv, dh)  # [n, h*dh], no cache
    n_blocks = -(-n // block_size)
    table = tuple(range(2 * n_blocks - 1, -1, -2))  # every other block of a pool twice as large, backwards
    pool = torch.zeros(2, 2 * n_blocks * block_size, h, dh, dtype=torch.float64)
    out, start = [], 0
    for i, c in enumerate(chunks):
        plan = SchedulerOutput(i, (ScheduledRequest(0, start, start + c, decode=c == 1 and start > 0, sample=True, blocks=table),))
        step = prepare_step(plan, {0: list(range(n))}, block_size, "cpu", mode)
        layer = PagedLayer(step.batch, pool)
        out.append(causal_attention(qkv[start:start + c], dh, layer))
        start += c
    torch.testing.assert_close(torch.cat(out), full, rtol=1e-12, atol=1e-14)
    unused = torch.ones(pool.shape[1], dtype=torch.bool)
    unused[[b * block_size + t for b in table for t in range(block_size)]] = False
    assert pool[:, unused].abs().sum() == 0  # nothing written outside the request's blocks


def test_top_left_causal_is_wrong_for_a_chunk_after_a_prefix():
    # The reason for the explicit mask: SDPA's is_causal on a [2 x 5] block hides cached keys.
    q, k, v = torch.randn(3, 1, 1, 5, 4, dtype=torch.float64)
    right = F.scaled_dot_product_attention(q[:, :, 3:], k, v, attn_mask=prefix_causal_mask(3, 2, 5))
    wrong = F.scaled_dot_product_attention(q[:, :, 3:], k, v, is_causal=True)
    assert not torch.allclose(right, wrong)


# ---- the engine on p ranks ---------------------------------------------------------------------


def serve(ctx, variant="v2", vocab_parallel=True, long_prefill_token_threshold=5, budget=12, max_num_seqs=None, requests=None,
          dtype=torch.float64, **paging):
    dense = dense_lm(dtype, ctx.device)
    lm = shard_lm(dense, variant, ctx.group, vocab_parallel)
    reqs = requests if requests is not None else make_requests()
    engine = OfflineEngine(lm, ctx, EngineConfig(long_prefill_token_threshold=long_prefill_token_threshold, max_num_batched_tokens=budget,
                                                 max_num_seqs=max_num_seqs or budget, **paging))
    return dense, reqs, engine.run(reqs)


def against_dense_oracle(ctx, variant):
    dense, reqs, res = serve(ctx, variant)
    out = []
    for r, served in zip(reqs, res.requests):
        ref = greedy_reference(dense, r.prompt, r.max_new_tokens)
        assert min(ref.margins) > 1e-9, "near-tie in the oracle: pick another seed"
        rel = max(abs(a - b) / abs(b) for a, b in zip(served["logits"], ref.logits))
        out.append((served["output_ids"], ref.ids, rel))
    iterations = [(it["ledger_matches_model"], it["collectives"], it["sampled"], it["decodes"], it["prefill_chunks"],
                   it["control_payload"]) for it in res.iterations]
    return out, iterations, res.kv_bytes_per_token_per_rank, res.kv_peak_bytes_per_rank


@pytest.mark.nccl
@pytest.mark.parametrize("variant", ["v2", "v1"])
@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_tokens_equal_dense_oracle_and_ledger_equals_model(p, variant):
    results = run_ranks(p, against_dense_oracle, variant)
    out, iterations, kv_per_token, kv_peak = results[0]
    assert all(r[0] == out for r in results)  # every rank emitted the same tokens
    for got, want, rel in out:
        assert got == want
        assert rel < 1e-12
    assert all(ok for ok, *_ in iterations)
    L = CFG.n_layers
    for ok, counts, sampled, decodes, chunks, payload in iterations:
        if p == 1:
            assert counts == {}
            continue
        # rank 0's control message: its header, and the new requests when some arrive before this step
        assert counts.pop("broadcast") == 1 + (payload > 0)
        if variant == "v2":  # embedding all-reduce + 2L; plan check + the head's pairs gather (when sampling)
            assert counts == {"all_reduce": 2 * L + 1, "all_gather": 1 + (sampled > 0)}
        else:
            assert counts == {"all_reduce": 1, "all_gather": 4 * L + 1 + (sampled > 0)}
    assert any(d and c for _, _, _, d, c, _ in iterations)  # some iteration mixed decodes and prompt chunks
    # KV cache bytes per rank: exactly 1/p of the dense cache (h/p heads of K and V per layer per token)
    dense_per_token = CFG.n_layers * 2 * CFG.n_heads * CFG.d_head * 8
    assert kv_per_token * p == dense_per_token
    # an upper bound on positions held at once: every request at its largest, rounded up to whole blocks of 16 (the
    # last request arrives after all others left)
    capacity = sum(-(-(n + new - 1) // 16) * 16 for n, new, _ in WORKLOAD[:-1])
    assert 0 < kv_peak <= capacity * dense_per_token // p


def peak_kv(ctx):
    return serve(ctx, long_prefill_token_threshold=64, budget=64, requests=make_requests([(10, 3, 0), (20, 2, 0)]),
                 block_size=1)[2].kv_peak_bytes_per_rank


def test_kv_bytes_per_rank_are_dense_over_p():
    dense_peak = run_ranks(1, peak_kv)[0]
    # Paged, one position per block: the peak is what is computed, not what may be generated later. At iteration 1
    # request 0 holds its 10 prompt positions + 1 decode, request 1 its 20 + 1 (a contiguous reservation: 12 + 21).
    assert dense_peak == (10 + 1 + 20 + 1) * CFG.n_layers * 2 * CFG.n_heads * CFG.d_head * 8
    for p in (2, 4, 8):
        assert run_ranks(p, peak_kv)[0] * p == dense_peak


def replicated(ctx):
    _, _, vp = serve(ctx, vocab_parallel=True)
    _, _, rep = serve(ctx, vocab_parallel=False)
    return ([r["output_ids"] for r in vp.requests], [r["output_ids"] for r in rep.requests],
            rep.ledger_matches_model, [{k: v for k, v in it["collectives"].items() if k != "broadcast"}
                                       for it in rep.iterations])


def test_replicated_embedding_gives_the_same_tokens_without_vocab_collectives():
    vp, rep, ok, counts = run_ranks(2, replicated)[0]
    assert vp == rep and ok
    assert all(c == {"all_reduce": 2 * CFG.n_layers, "all_gather": 1} for c in counts)  # blocks + plan check only
    # (besides rank 0's control broadcast, checked with the rest against the model: ok)


# ---- schedule invariance -----------------------------------------------------------------------


def invariance(ctx):
    """The same token streams under every chunk size, budget, arrival pattern and request order."""
    dense = dense_lm()
    lm = shard_lm(dense, "v2", ctx.group)
    base = make_requests()
    streams, paths = {}, {"mixed": False, "chunk_after_prefix": False, "finish_then_admit": False}
    longest = max(len(r.prompt) for r in base)
    settings = [(c, b, arr, perm) for c, b in [(1, 6), (3, 8), (7, 10), (16, 24), (longest, 64)]
                for arr, perm in [("staggered", False), ("together", True)]]
    for chunk, budget, arrivals, permute in settings:
        order = list(range(len(base)))
        if permute:
            random.Random(chunk).shuffle(order)
        reqs = [Request(i, base[j].prompt, base[j].max_new_tokens, base[j].arrival if arrivals == "staggered" else 0)
                for i, j in enumerate(order)]
        res = OfflineEngine(lm, ctx, EngineConfig(long_prefill_token_threshold=chunk, max_num_batched_tokens=budget, max_num_seqs=min(budget, 4))).run(reqs)
        assert res.ledger_matches_model
        streams[(chunk, budget, arrivals, permute)] = {tuple(base[j].prompt): r["output_ids"]
                                                       for j, r in zip(order, res.requests)}
        finished_so_far = False
        for it in res.iterations:
            paths["mixed"] |= it["decodes"] > 0 and it["prefill_chunks"] > 0
            paths["chunk_after_prefix"] |= any(kv > qe - qs > 1 for _, qs, qe, kv in it["triples"])
            paths["finish_then_admit"] |= finished_so_far and bool(it["admitted"])
            finished_so_far |= bool(it["finished"])
    return streams, paths


def test_schedule_invariance():
    streams, paths = run_ranks(2, invariance)[0]
    first = next(iter(streams.values()))
    for key, stream in streams.items():
        assert stream == first, key
    assert paths == {"mixed": True, "chunk_after_prefix": True, "finish_then_admit": True}


# ---- ranks that disagree -------------------------------------------------------------------------


class Drift(StepHook):
    """Rank 1 chunks prompts differently from iteration 1 on."""

    def __init__(self, rank):
        self.rank = rank

    def before_schedule(self, engine):
        if self.rank == 1 and engine.index == 1:
            engine.scheduler.config = dataclasses.replace(engine.scheduler.config, long_prefill_token_threshold=3)


def disagree(ctx, how):
    try:
        if how == "chunk_size":  # a different schedule on every rank
            serve(ctx, long_prefill_token_threshold=5 + ctx.rank)
        else:  # the same plans until one rank's scheduler changes its mind mid-run (a bug's effect)
            lm = shard_lm(dense_lm(), "v2", ctx.group)
            OfflineEngine(lm, ctx, EngineConfig(long_prefill_token_threshold=4, max_num_batched_tokens=8, max_num_seqs=8), hooks=Drift(ctx.rank)).run(
                [Request(0, list(range(1, 13)), 2)])
    except PlanMismatch as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("how,message", [("chunk_size", "requests or scheduler settings differ"),
                                         ("stop", "ranks scheduled different rows")])
def test_ranks_that_disagree_stop_with_a_clear_error(how, message):
    messages = run_ranks(2, disagree, how, timeout=60)
    assert all(m is not None and message in m for m in messages), messages


def test_idle_ranks_skip_ahead_without_forwards():
    _, iterations, _, _ = run_ranks(1, against_dense_oracle, "v2")[0]
    assert len(iterations) < 60  # the last request arrives at iteration 60: the idle stretch costs no forward


def with_eos(ctx):
    dense = dense_lm(device=ctx.device)
    lm = shard_lm(dense, "v2", ctx.group)
    prompt = make_requests()[0].prompt
    free = OfflineEngine(lm, ctx, EngineConfig(long_prefill_token_threshold=4, max_num_batched_tokens=8, max_num_seqs=8)).run([Request(0, prompt, 6)]).requests[0]["output_ids"]
    eos = free[2]  # a token the model does produce, third
    stopped = OfflineEngine(lm, ctx, EngineConfig(long_prefill_token_threshold=4, max_num_batched_tokens=8, max_num_seqs=8), eos_token_ids=(eos,)).run([Request(0, prompt, 6)])
    ref = greedy_reference(dense, prompt, 6, eos_id=eos)
    return free, stopped.requests[0]["output_ids"], ref.ids, stopped.kv_peak_bytes_per_rank > 0


def test_eos_stops_a_request_as_the_oracle_does():
    for free, stopped, ref, _ in run_ranks(2, with_eos):
        assert stopped == ref == free[:free.index(free[2]) + 1]
        assert len(stopped) < len(free)


def timeline(ctx):
    _, reqs, res = serve(ctx)
    return [(it["start_s"], it["time_s"], it["iteration"], [t[0] for t in it["triples"]]) for it in res.iterations], \
        [(r["generated"], r["token_times_s"], r["ttft_s"], r["max_tbt_s"]) for r in res.requests], res.time_s


def test_timeline_fields_are_consistent():
    """start_s and token_times_s (what the serving benchmarks plot and compute TBT from) agree with each other."""
    iterations, requests, total = run_ranks(1, timeline)[0]
    starts = [s for s, _, _, _ in iterations]
    assert starts == sorted(starts) and starts[0] >= 0 and starts[-1] < total
    ends = {i: s + t for s, t, i, _ in iterations}
    for generated, times, ttft, max_tbt in requests:
        assert len(times) == generated and times == sorted(times)
        assert all(any(abs(t - e) < 1e-9 for e in ends.values()) for t in times)  # a token is ready when its iteration ends
        gaps = [b - a for a, b in zip(times, times[1:])]
        assert max_tbt == (max(gaps) if gaps else None) and ttft is not None and ttft > 0


def test_pool_is_one_tensor_and_measures_its_bytes_per_token():
    from serve.kv_cache import KVPool

    pool = KVPool(3, 5, 4, 2, 4, torch.float64)  # L=3, 5 blocks of 4 positions, 2 K,V heads of 4
    assert pool.kv.shape == (3, 2, 20, 2, 4) and pool.bytes == 3 * 2 * 20 * 2 * 4 * 8
    assert pool.measured_bytes_per_token() == 3 * 2 * 2 * 4 * 8 and pool.bytes_per_block == 4 * 3 * 2 * 2 * 4 * 8
    values = torch.randn(3, 2, 1, 6, 4, dtype=torch.float64)  # K,V head 1 of positions at slots 9..3, every layer
    slots = torch.tensor([9, 8, 7, 5, 4, 3])
    pool.write(slots, slice(1, 2), values)
    assert torch.equal(pool.read(slots, slice(1, 2)), values) and torch.equal(pool.read(slots, slice(1, 2), 2), values[2])
    assert pool.kv[:, :, :, 0].abs().sum() == 0 and pool.kv[:, :, [0, 1, 2, 6]].abs().sum() == 0
