"""Sampling under the vocab-parallel head (layers/sampling/sampler.py) against a sampler written here from the
definitions.

Exactness: the same tokens at p = 1, 2, 3, 4 as the plain reference below applied to the dense model's logits
with the same noise. The noise is an input, E_i ~ Exp(1) as a function of (seed, position, id) alone; the reference
computes it here from its definition (splitmix64 over Python ints), not with the sampler's code. Distribution:
frequencies against softmax(z / T) restricted and renormalised by each filter, every filter alone and combined, at
temperatures below and above 1, on both of the sampler's paths, at p = 1 and at a p that pads the vocabulary; each
chi-square threshold is stated and its power shown (the same counts against the wrong distributions fail). Across
positions: two consecutive tokens of many seeded requests, jointly, against the product the model's logits give."""

import math
import random

import pytest
import torch

from layers.models.config import ModelConfig
from layers.models.dense import init_weights
from layers.models.llama import LlamaConfig
from layers.models.lm import dense_lm, shard_lm
from layers.sampling.sampler import SamplingBatch, exponential_noise, gumbel_noise, request_seed, sample
from serve.config import EngineConfig
from serve.engine import LLMEngine
from serve.sampling_params import SamplingParams
from tests.common import step_engine
from tests.harness import run_ranks

GPT2 = ModelConfig(d_model=64, n_heads=12, d_head=8, d_ffn=192, n_layers=2, max_seq_len=64, vocab_size=1001)  # pads at p=2,3,4
LLAMA = LlamaConfig(d_model=64, n_heads=8, n_kv_heads=2, d_head=8, d_ffn=96, n_layers=2, max_seq_len=64,
                    vocab_size=1001)  # grouped-query attention; its K,V heads replicated at p = 4


# ---- the reference: one row, plain Python, from the definitions --------------------------------------------------

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment and its finaliser's multipliers (Steele, Lea, Flood 2014)


def _splitmix(x: int) -> int:
    x &= MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def reference_noise(seed: int, position: int, ids) -> list[float]:
    """E_i ~ Exp(1) for ids at (seed, position), from the definition: a row key mix(mix(seed + G) + position·G), each
    id's 64 bits mix(row + (id + 1)·G), u = (top 53 bits + 1/2) / 2^53 in (0, 1), E = -log u."""
    row = _splitmix(_splitmix(seed + GOLDEN) + position * GOLDEN)
    return [-math.log(((_splitmix(row + (i + 1) * GOLDEN) >> 11) + 0.5) / 2.0 ** 53) for i in ids]


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
        E = reference_noise(seed, pos, range(V))
        t = reference_pick(z.tolist(), q.temperature, q.top_k, q.top_p, q.min_p, E)
        lp = torch.log_softmax(z, -1)
        logprobs.append((float(lp[t]), lp.topk(5)))
        out.append(t)
        tokens.append(t)
        if t in stop:
            break
    return out, logprobs


PARAMS = [SamplingParams(temperature=0.0, max_tokens=6),  # greedy beside sampled rows
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
          eos=(), draft=None):
    """reqs: (name, prompt, params, add at step). Every rank steps; rank 0's finished outputs by name, plus the
    internal id each got (for the seed of an unseeded request) and how many times a request was preempted. draft:
    (its config, its weights' seed) for speculative decoding with a draft model, whole on every rank."""
    from serve.build import own_group

    dense = init_weights(dense_lm(cfg, torch.float64), seed=0)
    draft_lm = None if draft is None else \
        shard_lm(init_weights(dense_lm(draft[0], torch.float64), seed=draft[1]), "v2", own_group(ctx))
    engine = LLMEngine(shard_lm(dense, "v2", ctx.group), ctx, config, eos_token_ids=eos, seed=0, draft_lm=draft_lm)
    done, ids = {}, {}

    def before(engine, step):
        for name, prompt, q, at in reqs:
            if at == step:
                ids[name] = engine._next
                engine.add_request(name, prompt, q)

    def sink(outputs, step):
        done.update({o.request_id: o.outputs[0] for o in outputs if o.finished})

    step_engine(engine, before, max(r[3] for r in reqs), sink)
    if not ctx.is_main:
        return None
    return done, ids, engine.scheduler.preemptions, engine.scheduler.blocks.num_free


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


def test_the_samplers_noise_is_its_definition():
    """exponential_noise and gumbel_noise against reference_noise: seeds up to 2**53, positions far apart, ids across
    the vocabulary (a noise keyed by a rank's local id, or missing the position or the seed, differs here)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.cat([torch.arange(8), torch.randint(0, 150_000, (56,), generator=g)])
    for seed, position in [(0, 0), (1, 0), (0, 1), (7, 1000), (2 ** 53 - 1, 3), (123456789, 2 ** 20)]:
        want = torch.tensor(reference_noise(seed, position, ids.tolist()), dtype=torch.float64)
        E = exponential_noise(torch.tensor([seed]), torch.tensor([position]), ids)[0]
        G = gumbel_noise(torch.tensor([seed]), torch.tensor([position]), ids)[0]
        assert torch.allclose(E, want, rtol=1e-15, atol=0) and torch.allclose(G, -torch.log(want), rtol=1e-14, atol=0)


# ---- the distribution -----------------------------------------------------------------------------------------------

LOGITS = torch.tensor([2.0, 1.5, 1.4, 1.0, 0.7, 0.5, 0.2, 0.0, -0.3, -0.8, -1.5, -2.5, 0.9], dtype=torch.float64)
DRAWS = 25_000  # every wrong sampler below still reaches noncentrality POWER somewhere in the grid
CHI2_LIMIT = 45.0  # above chi-square's 99.99% point at 12 degrees of freedom (~37.3): a right sampler passes
POWER = 4 * CHI2_LIMIT  # a wrong distribution is checked where its noncentrality N·sum((p - q)^2 / q) is this or more
FILTERS = [dict(), dict(top_k=4), dict(top_p=0.7), dict(min_p=0.2), dict(top_k=5, top_p=0.8),
           dict(top_p=0.8, min_p=0.1), dict(top_k=6, top_p=0.9, min_p=0.05)]
GRID = [dict(T=T, **f) for T in (0.6, 1.6) for f in FILTERS]


def expected(T, top_k=0, top_p=1.0, min_p=0.0, scale_first=True, min_p_raw=False, top_p_shift=0, logits=LOGITS):
    """softmax(z/T) restricted to the kept ids and renormalised, from the definitions, and the kept ids (z: logits).
    The other arguments make a wrong sampler: scale_first=False, the filters see softmax(z) and the temperature
    comes after them; min_p_raw, min-p alone sees softmax(z); top_p_shift, top-p's prefix one id shorter (-1) or
    longer (+1)."""
    z = logits
    probs = torch.softmax(z / T if scale_first else z, -1)
    for_min_p = torch.softmax(z, -1) if min_p_raw else probs
    order = sorted(range(len(z)), key=lambda i: (-float(z[i]), i))
    kept = [i for i in order if for_min_p[i] >= min_p * for_min_p.max()]
    kept = kept[:top_k] if top_k else kept
    if top_p < 1:
        total, n, before = sum(float(probs[i]) for i in kept), 0, 0.0
        for i in kept:  # the smallest prefix whose mass reaches top_p: keep while the mass before it is < top_p
            n += before < top_p
            before += float(probs[i]) / total
        kept = kept[:max(1, n + top_p_shift)]
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


def wrong_distributions(case: dict) -> dict[str, torch.Tensor]:
    """What a broken sampler would draw for this case: no temperature, no filter, filters before the temperature,
    min-p on the raw logits, top-k one too many, top-p's cut one candidate early or late."""
    T, k, top_p, min_p = case["T"], case.get("top_k", 0), case.get("top_p", 1.0), case.get("min_p", 0.0)
    out = {"untempered": expected(1.0, k, top_p, min_p)[0], "unfiltered": expected(T)[0],
           "filters before temperature": expected(T, k, top_p, min_p, scale_first=False)[0]}
    if min_p:
        out["min-p on raw logits"] = expected(T, k, top_p, min_p, min_p_raw=True)[0]
    if k:
        out["top-k + 1"] = expected(T, k + 1, top_p, min_p)[0]
    if top_p < 1:
        out["top-p early"] = expected(T, k, top_p, min_p, top_p_shift=-1)[0]
        out["top-p late"] = expected(T, k, top_p, min_p, top_p_shift=1)[0]
    return out


def noncentrality(right: torch.Tensor, wrong: torch.Tensor, n: int) -> float:
    """The chi-square statistic's mean shift when draws come from `right` and are tested against `wrong`."""
    if ((right > 0) & (wrong == 0)).any():
        return float("inf")
    mask = wrong > 0
    return float(n * ((right[mask] - wrong[mask]) ** 2 / wrong[mask]).sum())


def draw_grid(ctx, logprobs: int) -> list[tuple[list[int], bool]]:
    """Every case of GRID, DRAWS seeded rows each, through sample() on this rank's slice of LOGITS (13 ids: padded
    with -inf to 14 at p = 2): (counts per id, whether the race over the slices ran). logprobs: -1 leaves rows
    with no filter or min-p alone open (they race over the slices); a large N makes every id a candidate, so every
    row is closed (raced among the merged candidates)."""
    V, p = len(LOGITS), ctx.world_size
    n = -(-V // p)
    padded = torch.cat([LOGITS, torch.full((n * p - V,), float("-inf"), dtype=torch.float64)])
    local = padded[ctx.rank * n:(ctx.rank + 1) * n].expand(DRAWS, -1).clone()
    out = []
    for case in GRID:
        rows = [(case["T"], case.get("top_k", 0), case.get("top_p", 1.0), case.get("min_p", 0.0), seed, 0)
                for seed in range(DRAWS)]
        res = sample(local, ctx.rank * n, ctx.group, SamplingBatch.build(rows, logprobs, "cpu"), V)
        out.append((torch.bincount(res.tokens, minlength=V).tolist(), res.race))
    return out


@pytest.mark.parametrize("p,logprobs", [(1, -1), (2, -1), (2, 20)], ids=["p1", "p2-open", "p2-closed"])
def test_frequencies_match_the_filtered_softmax(p, logprobs):
    drawn = run_ranks(p, draw_grid, logprobs)[0]
    checked = set()
    for case, (counts, raced) in zip(GRID, drawn):
        counts = torch.tensor(counts, dtype=torch.float64)
        right, _ = expected(case["T"], case.get("top_k", 0), case.get("top_p", 1.0), case.get("min_p", 0.0))
        assert chi2(counts, right) < CHI2_LIMIT, case
        # the path taken: with no candidates asked beyond the filters', a row with no filter or min-p alone races
        # over the slices; with every id a candidate, every row is closed
        assert raced == (logprobs < 0 and set(case) <= {"T", "min_p"}), case
        for name, wrong in wrong_distributions(case).items():  # the power: each wrong sampler that differs enough
            if noncentrality(right, wrong, DRAWS) >= POWER:
                assert chi2(counts, wrong) > CHI2_LIMIT, (case, name)
                checked.add(name)
    assert checked == {"untempered", "unfiltered", "filters before temperature", "min-p on raw logits", "top-k + 1",
                       "top-p early", "top-p late"}


# ---- across positions -----------------------------------------------------------------------------------------------

TINY = ModelConfig(d_model=16, n_heads=2, d_head=8, d_ffn=32, n_layers=1, max_seq_len=16, vocab_size=7)  # pads at p=2
PAIRS = 4000
PAIR_PROMPT = [1, 2, 3]
PAIR_LIMIT = 90.0  # above chi-square's 99.99% point at 48 degrees of freedom (~84)


def pair_table(first: torch.Tensor, second: torch.Tensor, pairs) -> tuple[float, int]:
    """Chi-square of the pairs' counts against P(a, b) = first[a] · second[a][b], cells expected under 5 pooled."""
    V = len(first)
    probs = (first[:, None] * second).flatten()
    counts = torch.zeros(V * V, dtype=torch.float64)
    for a, b in pairs:
        counts[a * V + b] += 1
    small = probs * len(pairs) < 5
    probs = torch.cat([probs[~small], probs[small].sum()[None]])
    counts = torch.cat([counts[~small], counts[small].sum()[None]])
    return chi2(counts, probs), int((~small).sum())


def test_consecutive_tokens_are_drawn_with_fresh_noise():
    """PAIRS requests with the same prompt and seeds 0..PAIRS-1 through the engine at p = 2, two tokens each: the
    joint distribution of (first, second) against softmax(z_1)[a] · softmax(z_2 | a)[b] from the dense model. A
    sampler that reuses a position's noise at the next (the position dropped from the noise's key, or the engine
    passing the same position twice) draws correlated pairs; its chi-square, from the reference sampler with the
    position held at 0, is shown to exceed the limit by far."""
    reqs = [(f"r{i}", PAIR_PROMPT, SamplingParams(max_tokens=2, temperature=1.0, seed=i, ignore_eos=True), 0)
            for i in range(PAIRS)]
    config = EngineConfig(long_prefill_token_threshold=4096, max_num_batched_tokens=4 * PAIRS, max_num_seqs=PAIRS,
                          block_size=4)
    done = run_ranks(2, serve, TINY, reqs, config)[0][0]
    pairs = [tuple(done[f"r{i}"].token_ids) for i in range(PAIRS)]
    dense = init_weights(dense_lm(TINY, torch.float64), seed=0)
    with torch.no_grad():
        first = torch.softmax(dense.logits(torch.tensor(PAIR_PROMPT))[-1].double(), -1)
        second = torch.stack([torch.softmax(dense.logits(torch.tensor(PAIR_PROMPT + [a]))[-1].double(), -1)
                              for a in range(TINY.vocab_size)])
    stat, cells = pair_table(first, second, pairs)
    assert cells >= 20 and stat < PAIR_LIMIT, (stat, cells)
    # the power: the same test on pairs drawn with the noise of position 0 at both positions
    stale = []
    for i in range(PAIRS):
        E = reference_noise(i, 0, range(TINY.vocab_size))
        a = reference_pick(torch.log(first).tolist(), 1.0, 0, 1.0, 0.0, E)
        stale.append((a, reference_pick(torch.log(second[a]).tolist(), 1.0, 0, 1.0, 0.0, E)))
    assert pair_table(first, second, stale)[0] > 10 * PAIR_LIMIT


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
