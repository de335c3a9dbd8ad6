"""Sampling under the vocab-parallel head (layers/sampler.py) against a sampler written here from the definitions.

Exactness: the same tokens at p = 1, 2, 3, 4 as the plain reference below applied to the dense model's logits
with the same noise (the noise is an input: E_i ~ Exp(1) as a function of (seed, position, id)). Distribution:
frequencies over 100,000 draws against softmax(z / T) restricted and renormalised by each filter, with a
chi-square threshold that the wrong filters fail."""

import math
import random

import pytest
import torch

from layers.config import ModelConfig
from layers.dense import init_weights
from layers.lm import dense_lm, shard_lm
from layers.llama import LlamaConfig
from layers.sampler import SamplingBatch, exponential_noise, request_seed, sample
from serve.config import EngineConfig
from serve.engine import LLMEngine
from serve.sampling_params import SamplingParams
from tests.harness import run_ranks

GPT2 = ModelConfig(d_model=64, n_heads=12, d_head=8, d_ffn=192, n_layers=2, max_seq_len=64, vocab_size=1001)  # pads at p=2,3,4
LLAMA = LlamaConfig(d_model=64, n_heads=8, n_kv_heads=2, d_head=8, d_ffn=96, n_layers=2, max_seq_len=64,
                    vocab_size=1001)  # grouped-query attention; its K,V heads replicated at p = 4


# ---- the reference: one row, plain Python, from the definitions --------------------------------------------------


def reference_pick(z: list[float], T: float, top_k: int, top_p: float, min_p: float, E: list[float]) -> int:
    """temperature, then min-p, top-k, top-p (vLLM's order), then argmax over the kept ids of z/T - log E."""
    V = len(z)
    if T == 0:
        return max(range(V), key=lambda i: (z[i], -i))
    s = [x / T for x in z]
    m = max(s)
    order = sorted(range(V), key=lambda i: (-z[i], i))  # by probability, ties to the lower id
    kept = [i for i in order if min_p == 0 or math.exp(s[i] - m) >= min_p]  # p_i >= min_p * p_max
    if top_k > 0:
        kept = kept[:top_k]
    if top_p < 1:
        total = sum(math.exp(s[i] - m) for i in kept)
        out, before = [], 0.0
        for i in kept:  # the smallest prefix whose mass reaches top_p: keep while the mass before it is < top_p
            if before < top_p:
                out.append(i)
            before += math.exp(s[i] - m) / total
        kept = out
    return max(kept, key=lambda i: (s[i] - math.log(E[i]), -i))


def reference_generate(dense, prompt, q: SamplingParams, seed: int, stop=()):
    tokens, out, logprobs = list(prompt), [], []
    V = dense.cfg.vocab_size
    for pos in range(q.max_tokens):
        with torch.no_grad():
            z = dense.logits(torch.tensor(tokens))[-1].double()  # [V], no cache
        E = exponential_noise(torch.tensor([seed]), torch.tensor([pos]), torch.arange(V))[0]
        t = reference_pick(z.tolist(), q.temperature, q.top_k, q.top_p, q.min_p, E.tolist())
        lp = torch.log_softmax(z, -1)
        logprobs.append((float(lp[t]), lp.topk(5)))
        out.append(t)
        tokens.append(t)
        if t in stop:
            break
    return out, logprobs


PARAMS = [SamplingParams(max_tokens=6),  # greedy beside sampled rows
          SamplingParams(max_tokens=6, temperature=0.7, seed=1),
          SamplingParams(max_tokens=6, temperature=1.3, top_k=5, seed=2),
          SamplingParams(max_tokens=6, temperature=1.0, top_p=0.8, seed=3),
          SamplingParams(max_tokens=6, temperature=0.9, min_p=0.05, seed=4),
          SamplingParams(max_tokens=6, temperature=1.1, top_k=40, top_p=0.9, min_p=0.01, seed=5),
          SamplingParams(max_tokens=6, temperature=1.3, top_p=0.999, seed=6),  # past 32 candidates: more rounds
          SamplingParams(max_tokens=6, temperature=1.0, top_k=3, logprobs=4, seed=7),
          SamplingParams(max_tokens=6, temperature=0.8)]  # no seed: one drawn from the engine's seed and its id


def prompts(n, seed=0, shared=()):
    g = torch.Generator().manual_seed(seed)
    return [list(shared) + torch.randint(0, 1001, (int(torch.randint(1, 12, (1,), generator=g)),),
                                         generator=g).tolist() for _ in range(n)]


def serve(ctx, cfg, reqs, config=EngineConfig(long_prefill_token_threshold=6, max_num_batched_tokens=16, max_num_seqs=8, block_size=4),
          eos=()):
    """reqs: (name, prompt, params, add at step). Every rank steps; rank 0's finished outputs by name, plus the
    internal id each got (for the seed of an unseeded request) and how many times a request was preempted."""
    dense = init_weights(dense_lm(cfg, torch.float64), seed=0)
    engine = LLMEngine(shard_lm(dense, "v2", ctx.group), ctx, config, eos_token_ids=eos, seed=0)
    if not ctx.is_main:
        while not engine.stopped:
            engine.step()
        return None
    done, ids, step = {}, {}, 0
    while step <= max(r[3] for r in reqs) or engine.has_unfinished_requests():
        for name, prompt, q, at in reqs:
            if at == step:
                ids[name] = engine._next
                engine.add_request(name, prompt, q)
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.outputs[0]
        step += 1
    preempted = engine.scheduler.preemptions
    engine.shutdown()
    return done, ids, preempted, engine.scheduler.blocks.num_free


@pytest.mark.parametrize("cfg,sizes", [(GPT2, (1, 2, 3, 4)), (LLAMA, (1, 2, 4))], ids=["gpt2", "llama"])
def test_sampled_tokens_are_the_same_at_every_p_and_equal_the_reference(cfg, sizes):
    ps = prompts(len(PARAMS), seed=1)
    reqs = [(f"r{i}", pr, q, i % 3) for i, (pr, q) in enumerate(zip(ps, PARAMS))]
    per_p = {p: run_ranks(p, serve, cfg, reqs)[0] for p in sizes}
    dense = init_weights(dense_lm(cfg, torch.float64), seed=0)
    done, ids, _, _ = per_p[1]
    for name, pr, q, _ in reqs:
        seed = q.seed if q.seed is not None else request_seed(0, ids[name])
        want, logprobs = reference_generate(dense, pr, q, seed)
        for p, (got, _, _, _) in per_p.items():
            assert got[name].token_ids == want, (name, p)
        if q.logprobs is not None:  # the chosen id's logprob and the top 4, against log_softmax of the dense logits
            for step, (lp, top) in zip(per_p[2][0][name].logprobs, logprobs):
                assert set(top.indices.tolist()[:4]) <= set(step)
                for t, v in zip(top.indices.tolist()[:4], top.values.tolist()[:4]):
                    assert abs(step[t] - v) < 1e-12
            chosen_lps = [lp for lp, _ in logprobs]
            got_lps = [per_p[2][0][name].logprobs[i][t] for i, t in enumerate(want)]
            assert max(abs(a - b) for a, b in zip(got_lps, chosen_lps)) < 1e-12


def test_a_seeded_request_is_independent_of_its_batch():
    """The same seeded request alone, in a batch of 32 (seeded and unseeded), after preemptions, with prefix hits."""
    shared = list(range(40, 56))  # 16 tokens: 4 full blocks of 4 shared by every prompt below
    target = (list(shared) + [7, 8, 9], SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=42))
    alone = run_ranks(2, serve, GPT2, [("t", *target, 0)])[0][0]["t"].token_ids
    others = prompts(31, seed=3, shared=shared)
    rng = random.Random(0)
    batch = [("t", *target, 2)] + [(f"o{i}", pr, SamplingParams(max_tokens=rng.randint(1, 10),
                                                                  temperature=rng.choice([0.0, 0.8, 1.2]),
                                                                  seed=rng.choice([None, i])), rng.randint(0, 3))
                                   for i, pr in enumerate(others)]
    crowded = run_ranks(2, serve, GPT2, batch)[0]
    assert crowded[0]["t"].token_ids == alone
    small = EngineConfig(long_prefill_token_threshold=6, max_num_batched_tokens=16, max_num_seqs=8, block_size=4, num_gpu_blocks_override=30)
    tight = run_ranks(2, serve, GPT2, batch, small)[0]
    assert tight[2] > 0 and tight[3] == 30  # requests were preempted; every block came back
    assert tight[0]["t"].token_ids == alone


def test_stop_ids_eos_and_ignore_eos():
    pr = prompts(1, seed=5)[0]
    free = run_ranks(1, serve, GPT2, [("a", pr, SamplingParams(max_tokens=8, temperature=1.0, seed=9), 0)])[0]
    tokens = free[0]["a"].token_ids
    eos = tokens[3]
    cut = tokens[:tokens.index(eos) + 1]
    runs = run_ranks(2, serve, GPT2, [("eos", pr, SamplingParams(max_tokens=8, temperature=1.0, seed=9), 0),
                                      ("ignore", pr, SamplingParams(max_tokens=8, temperature=1.0, seed=9,
                                                                    ignore_eos=True), 0),
                                      ("stop", pr, SamplingParams(max_tokens=8, temperature=1.0, seed=9,
                                                                  stop_token_ids=[eos], ignore_eos=True), 0)],
                     eos=(eos,))[0][0]
    assert runs["eos"].token_ids == cut and runs["eos"].finish_reason == "stop"
    assert runs["ignore"].token_ids == tokens and runs["ignore"].finish_reason == "length"
    assert runs["stop"].token_ids == cut and runs["stop"].stop_reason == eos


# ---- the distribution -----------------------------------------------------------------------------------------------

LOGITS = torch.tensor([2.0, 1.5, 1.4, 1.0, 0.7, 0.5, 0.2, 0.0, -0.3, -0.8, -1.5, -2.5], dtype=torch.float64)
DRAWS = 100_000
CHI2_LIMIT = 45.0  # far above chi-square's 99.99% point at 11 degrees of freedom (~35): a right sampler passes


def expected(T, top_k=0, top_p=1.0, min_p=0.0, scale_first=True):
    """softmax(z/T) restricted to the kept ids and renormalised, from the definitions. scale_first=False is a wrong
    sampler: the filters see softmax(z) and the temperature comes after them."""
    z = LOGITS
    probs = torch.softmax(z / T if scale_first else z, -1)
    order = sorted(range(len(z)), key=lambda i: (-float(z[i]), i))
    kept = [i for i in order if probs[i] >= min_p * probs.max()]
    kept = kept[:top_k] if top_k else kept
    if top_p < 1:
        total, out, before = sum(float(probs[i]) for i in kept), [], 0.0
        for i in kept:
            if before < top_p:
                out.append(i)
            before += float(probs[i]) / total
        kept = out
    final = torch.softmax(z / T, -1)
    w = torch.zeros_like(z)
    w[kept] = final[kept]
    return w / w.sum(), kept


def chi2(counts, probs):
    mask = probs > 0
    if (counts[~mask] > 0).any():
        return float("inf")  # drew an id that should never be drawn
    e = probs[mask] * counts.sum()
    return float(((counts[mask] - e) ** 2 / e).sum())


def draw(T, top_k=0, top_p=1.0, min_p=0.0):
    rows = [(T, top_k, top_p, min_p, seed, 0) for seed in range(DRAWS)]
    batch = SamplingBatch.build(rows, -1, "cpu")
    tokens = sample(LOGITS.expand(DRAWS, -1).clone(), 0, None, batch, len(LOGITS)).tokens
    return torch.bincount(tokens, minlength=len(LOGITS)).double()


@pytest.mark.parametrize("T,top_k,top_p,min_p", [(1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.3, 4, 1.0, 0.0),
                                                 (2.0, 0, 0.6, 0.0), (1.0, 0, 1.0, 0.3), (1.2, 6, 0.8, 0.05)])
def test_frequencies_match_the_filtered_softmax(T, top_k, top_p, min_p):
    counts = draw(T, top_k, top_p, min_p)
    probs, kept = expected(T, top_k, top_p, min_p)
    assert chi2(counts, probs) < CHI2_LIMIT
    if top_p < 1:  # the test would catch a top-p cut one candidate too early ...
        early = torch.zeros_like(probs)
        early[kept[:-1]] = probs[kept[:-1]]
        assert chi2(counts, early / early.sum()) > 100 * CHI2_LIMIT
        wrong, wrong_kept = expected(T, top_k, top_p, min_p, scale_first=False)
        if wrong_kept != kept:  # ... and the temperature applied after the filter, where that keeps another set
            assert chi2(counts, wrong) > 100 * CHI2_LIMIT
    if (T, top_p) == (2.0, 0.6):  # the case above where the order of temperature and filter matters
        assert expected(T, top_k, top_p, min_p, scale_first=False)[1] != kept


def top_p_rounds(ctx, slope: float):
    """A 20,000-id vocabulary split over the ranks, logits -slope·log(rank) with the ids shuffled: the nucleus inside
    the first candidates (steep), inside the second round's (medium), or past them (flat: the logits gathered)."""
    from tp.ledger import TrafficLedger
    from tp.traffic_model import predict_sampler

    V, S = 20000, 4
    z = -slope * torch.log(torch.randperm(V, generator=torch.Generator().manual_seed(1)).double() + 1)
    z = z.expand(S, -1).clone()
    n = V // ctx.world_size
    rows = [(1.0, 0, 0.9, 0.0, seed, 0) for seed in range(S)]
    batch = SamplingBatch.build(rows, -1, "cpu")
    ledger = TrafficLedger(ctx.world_size)
    with ledger.recording():
        res = sample(z[:, ctx.rank * n:(ctx.rank + 1) * n], ctx.rank * n, ctx.group, batch, V)
    E = exponential_noise(batch.seed, batch.position, torch.arange(V))
    want = [reference_pick(z[i].tolist(), 1.0, 0, 0.9, 0.0, E[i].tolist()) for i in range(S)]
    model = predict_sampler(ctx.world_size, S, (res.rounds, batch.normalisers, res.race), V, torch.float64)
    return res.tokens.tolist() == want, res.rounds, [r.traffic() for r in ledger.records] == model


@pytest.mark.parametrize("slope,rounds", [(2.0, (64,)), (1.3, (64, 1024)), (0.5, (64, 1024, 0))])
def test_top_p_past_the_candidates_stays_exact(slope, rounds):
    for exact, got, ledger_ok in run_ranks(2, top_p_rounds, slope):
        assert exact and got == rounds and ledger_ok


def tied_top_k(ctx):
    """Logits tied across both ranks' slices: top-k keeps the lowest ids among equals, at every p."""
    V, S = 100, 8
    z = torch.cat([torch.zeros(50), torch.ones(50)]).double().expand(S, -1).clone()
    n = V // ctx.world_size
    batch = SamplingBatch.build([(1.0, 5, 1.0, 0.0, seed, 0) for seed in range(S)], 2, "cpu")
    res = sample(z[:, ctx.rank * n:(ctx.rank + 1) * n], ctx.rank * n, ctx.group, batch, V)
    return res.tokens.tolist(), res.top_ids.tolist()


def test_top_k_ties_go_to_the_lower_ids_at_every_p():
    one, two = run_ranks(1, tied_top_k)[0], run_ranks(2, tied_top_k)[0]
    assert one == two
    assert all(50 <= t < 55 for t in one[0]) and all(ids == [50, 51] for ids in one[1])


def test_a_temperature_near_zero_is_greedy():
    assert SamplingParams(temperature=1e-320).temperature == 0.0 and SamplingParams(temperature=1e-5).temperature > 0
