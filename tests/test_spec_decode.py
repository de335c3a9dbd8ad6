"""Speculative decoding with n-gram proposals (serve/spec_decode.py) against decoding without it and the dense oracle.

The n-gram verifier is the sampler itself over the chunk's k + 1 rows, each row with the noise of its output
position, so speculation must not change a single token: greedy or seeded, at p = 1, 2, 3, 4, GPT-2 and Llama with
grouped-query attention, with prefix hits, preemption and chunked prefill in the same run. Every step's collectives
are checked against the traffic model inside the engine (check_ledger raises on a difference). The distribution of
what a verified chunk emits is checked on fixed logits, with the power shown."""

import math

import pytest
import torch

from layers.models.dense import init_weights
from layers.models.lm import dense_lm
from layers.sampling.sampler import SamplingBatch, sample
from serve.block_manager import KVCacheManager
from serve.config import EngineConfig
from serve.request import Request
from serve.sampling_params import SamplingParams
from serve.scheduler import Scheduler
from serve.spec_decode import SpeculativeConfig, accept, check_request, propose_ngram
from tests.common import step_engine
from tests.harness import run_ranks
from tests.test_sampling import GPT2, LLAMA, chi2, expected, reference_generate, serve

# K proposals every step (the counters are then the same at every p); the Tuner's choice: the seeded-request test
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}


# ---- the pieces ---------------------------------------------------------------------------------------------------


def test_ngram_proposals_follow_an_earlier_match_of_the_longest_suffix():
    tokens = [5, 6, 7, 1, 2, 9, 5, 6, 7, 3, 4, 5, 6, 7]
    assert propose_ngram(tokens, 1, 3, 2) == [3, 4]  # [5, 6, 7] last seen before at 6: then 3, 4
    assert propose_ngram(tokens, 1, 3, 9) == [1, 2, 9, 5, 6, 7, 3, 4, 5]  # only the match at 0 has 9 after it
    assert propose_ngram(tokens, 1, 3, 11) == [1, 2, 9, 5, 6, 7, 3, 4, 5, 6, 7]  # none has 11: the earliest
    assert propose_ngram([1, 2, 3, 4], 1, 3, 2) == []  # no suffix occurs earlier
    assert propose_ngram([1, 2, 1], 2, 3, 2) == []  # only [1] repeats, shorter than prompt_lookup_min
    assert propose_ngram([1, 2, 1], 1, 3, 2) == [2, 1]
    assert propose_ngram([4, 4, 4], 1, 2, 3) == [4]  # [4, 4] seen at 0 only; what follows it is one 4
    assert propose_ngram([8] * 9, 1, 3, 4) == [8] * 4  # the latest [8, 8, 8] with 4 tokens after it
    assert propose_ngram([1, 2, 9, 1, 2, 7, 1, 2], 2, 2, 3) == [7, 1, 2]  # the latest match (at 3) has 3 after it
    assert propose_ngram([1, 2, 9, 1, 2, 7, 1, 2], 2, 2, 4) == [9, 1, 2, 7]  # it has not 4: the match at 0
    assert propose_ngram([1, 2, 1], 1, 3, 0) == []


def test_accept_takes_matching_proposals_then_the_targets_token():
    assert accept([7, 8, 9, 4], (7, 8, 9)) == [7, 8, 9, 4]  # all accepted: the bonus token too
    assert accept([7, 5, 9, 4], (7, 8, 9)) == [7, 5]  # x_2 rejected: the target's own token instead
    assert accept([1, 8, 9, 4], (7, 8, 9)) == [1]
    assert accept([3], ()) == [3]


@pytest.mark.parametrize("value,message", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0 must be"),
    ({"method": "eagle"}, "method='eagle': choose ngram or draft_model"),
    ({"method": "draft_model"}, "needs a model"),
    ({"num_speculative_tokens": 2}, "needs a method"),
    ({"method": "ngram", "k": 2}, "unknown key 'k'"),
    ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min=3 is larger"),
    ("ngram", "must be a dict")])
def test_bad_speculative_configs_are_one_line_errors(value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=value)


def test_pipeline_stages_and_pd_with_speculation_are_refused():
    from serve.pd import Layout
    from serve.pd.run import serve_pd

    with pytest.raises(ValueError, match="pp > 1"):
        EngineConfig(speculative_config=NGRAM).check_pipeline(2)
    with pytest.raises(ValueError, match="P/D disaggregation is not built yet"):  # before any collective: no group
        serve_pd(None, None, Layout(1, 1), [], EngineConfig(speculative_config=NGRAM), eos_token_ids=())


def test_rejected_rows_give_their_blocks_back():
    """A decode verifying 3 proposals that cross into a new block: all rejected, the new block goes back at once;
    accepted rows keep theirs, and only blocks full of accepted tokens are named for the prefix cache."""
    config = EngineConfig(block_size=4, max_num_batched_tokens=16, max_num_seqs=4,
                          speculative_config=NGRAM)
    blocks = KVCacheManager(8, 4, True)
    sched = Scheduler(config, blocks)
    r = Request(0, [1, 2, 3], 10)
    sched.add(r)
    plan = sched.schedule(0)
    sched.update_from_output(plan, {0: [9]})  # prompt computed (3 positions), token 9 sampled: 4 tokens, one block used
    assert blocks.num_free == 7
    r.spec_token_ids = [1, 2, 3]
    plan = sched.schedule(1)
    (c,) = plan.scheduled
    assert (c.q_start, c.q_end, c.spec) == (3, 7, (1, 2, 3)) and plan.sample_rows == [0, 1, 2, 3]
    assert blocks.num_free == 6  # positions 3..6: a second block
    sched.update_from_output(plan, {0: [4]})  # x_1 = 1 rejected: the target's 4
    assert r.output == [9, 4] and r.num_computed_tokens == 4 and blocks.num_free == 7
    assert blocks.hashed[0] == 1  # block 0 (tokens 1, 2, 3, 9) is full of computed tokens: named
    r.spec_token_ids = [5, 6, 7]
    plan = sched.schedule(2)
    sched.update_from_output(plan, {0: [5, 6, 8]})  # two accepted, then the target's 8: positions 4..6 hold K,V
    assert r.output == [9, 4, 5, 6, 8] and r.num_computed_tokens == 7 and blocks.num_free == 6
    # preempted, a request's blocks may come back as another request's prefix, whose draft K,V it never wrote: a
    # draft model recomputes it whole (the draft reads only what it wrote itself); no draft, nothing to reset
    r.draft_computed, other = 7, Request(1, [1, 2], 4)
    sched.add(other)
    sched.schedule(3)
    for victim in (r, other):
        sched._preempt(victim, [])
    assert (r.draft_computed, other.draft_computed) == (0, None) and r.num_computed_tokens == 0
    blocks.check()


# ---- the same tokens as without speculation ------------------------------------------------------------------------

def repetitive_prompts(n: int, seed: int = 0, shared=()) -> list[list[int]]:
    """Prompts that repeat a short phrase (what prompt lookup finds), some after a shared prefix (prefix hits)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        phrase = torch.randint(0, 1001, (int(torch.randint(2, 5, (1,), generator=g)),), generator=g).tolist()
        out.append((list(shared) if i % 2 else []) + phrase * int(torch.randint(2, 4, (1,), generator=g)))
    return out


PARAMS = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),  # greedy
          SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=1),
          SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.2, top_k=5, seed=2),
          SamplingParams(max_tokens=11, ignore_eos=True, temperature=0.9, top_p=0.8, min_p=0.05, seed=3),
          SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.7, logprobs=2, seed=4),
          SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)]


def spec_run(ctx, cfg, reqs, config, draft=None):
    """serve() (tests/test_sampling.py), and rank 0's acceptance counters."""
    from serve.engine import LLMEngine

    stats = {}
    original = LLMEngine.shutdown

    def keep(engine):
        stats.update(engine.stats())
        original(engine)

    LLMEngine.shutdown = keep
    try:
        out = serve(ctx, cfg, reqs, config, draft=draft)
    finally:
        LLMEngine.shutdown = original
    return out, stats


@pytest.mark.parametrize("cfg,sizes", [(GPT2, (1, 2, 3, 4)), (LLAMA, (1, 2, 4))], ids=["gpt2", "llama"])
def test_speculative_tokens_equal_plain_decoding_and_the_oracle(cfg, sizes):
    shared = list(range(40, 48))  # two full blocks of 4: prefix hits
    ps = repetitive_prompts(12, seed=1, shared=shared)
    reqs = [(f"r{i}", pr, PARAMS[i % len(PARAMS)], i % 4) for i, pr in enumerate(ps)]
    base = dict(long_prefill_token_threshold=6, max_num_batched_tokens=24, max_num_seqs=8, block_size=4,
                num_gpu_blocks_override=20)  # tight: preemption
    plain = run_ranks(1, serve, cfg, reqs, EngineConfig(**base))[0]
    dense = init_weights(dense_lm(cfg, torch.float64), seed=0)
    for name, pr, q, _ in reqs[:4]:  # the oracle, for a few: the plain run is checked at length in test_sampling.py
        assert plain[0][name].token_ids == reference_generate(dense, pr, q, q.seed or 0)[0], name
    spec = EngineConfig(**base, speculative_config=NGRAM)
    accepted = []
    for p in sizes:
        (done, _, preempted, free), stats = run_ranks(p, spec_run, cfg, reqs, spec)[0]
        for name, _, q, _ in reqs:
            assert done[name].token_ids == plain[0][name].token_ids, (name, p)
            if q.logprobs is not None:  # a verified chunk's rows carry each token's logprobs
                want = [step[t] for step, t in zip(plain[0][name].logprobs, plain[0][name].token_ids)]
                got = [step[t] for step, t in zip(done[name].logprobs, done[name].token_ids)]
                assert len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want)) < 1e-12
        assert free == 20  # every block came back
        accepted.append((stats["spec_decode_num_accepted_tokens"], stats["spec_decode_num_draft_tokens"], preempted))
    a, drafted, preempted = accepted[0]
    assert 0 < a < drafted and preempted > 0  # proposals accepted and rejected, requests preempted
    assert len(set(accepted)) == 1  # the same at every p


@pytest.mark.parametrize("attention", ["batched", "reference"])
def test_every_attention_backend_verifies_the_same_tokens(attention):
    """The verified chunks of k + 1 rows through the other attention backends (the default, cpu, runs above): n-gram
    and a draft model, at p = 2, the tokens of plain decoding on the cpu backend."""
    from dataclasses import replace

    ps = repetitive_prompts(6, seed=7, shared=list(range(40, 48)))
    reqs = [(f"r{i}", pr, PARAMS[i % 4], i % 2) for i, pr in enumerate(ps)]
    base = dict(long_prefill_token_threshold=6, max_num_batched_tokens=24, max_num_seqs=6, block_size=4)
    plain = run_ranks(1, serve, GPT2, reqs, EngineConfig(**base))[0][0]
    ngram = run_ranks(2, serve, GPT2, reqs, EngineConfig(**base, attention=attention, speculative_config=NGRAM))[0][0]
    drafted = run_ranks(2, serve, GPT2, reqs, EngineConfig(**base, attention=attention, speculative_config=DRAFT),
                        draft=(replace(GPT2, n_layers=1), 5))[0][0]
    for name, _, q, _ in reqs:
        assert ngram[name].token_ids == plain[name].token_ids, name
        assert drafted[name].token_ids == plain[name].token_ids, name


def test_a_seeded_request_is_the_same_alone_in_a_batch_and_preempted_at_every_p():
    """A seeded request under n-gram and under a draft model (shared noise), the Tuner choosing k: plain decoding's
    tokens alone (p = 1), in a batch of 16 (p = 2), and in a batch whose pool preempts (proposals dropped: its verify
    windows fall elsewhere; p = 4 and 1)."""
    from dataclasses import replace

    target = ([3, 4, 5, 3, 4, 5, 3, 4], SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=42,
                                                          ignore_eos=True))
    others = repetitive_prompts(15, seed=2)
    batch = [("t", *target, 1)] + [(f"o{i}", pr, SamplingParams(max_tokens=8, temperature=0.9, seed=i,
                                                                 ignore_eos=True), i % 3)
                                   for i, pr in enumerate(others)]
    want = run_ranks(1, serve, GPT2, [("t", *target, 0)], EngineConfig(block_size=4))[0][0]["t"].token_ids
    for spec, draft in (({**NGRAM, "adaptive": True}, None),
                        ({**DRAFT, "adaptive": True}, (replace(GPT2, n_layers=1), 5))):
        roomy = EngineConfig(long_prefill_token_threshold=8, max_num_batched_tokens=64, max_num_seqs=16,
                             block_size=4, speculative_config=spec)
        short = replace(roomy, num_gpu_blocks_override=24)  # a pool that preempts, so proposals are dropped
        assert run_ranks(1, serve, GPT2, [("t", *target, 0)], roomy, draft=draft)[0][0]["t"].token_ids == want
        for p, config in ((2, roomy), (4, short), (1, short)):  # in a batch, then preempted too
            done, _, preempted, _ = run_ranks(p, serve, GPT2, batch, config, draft=draft)[0]
            assert done["t"].token_ids == want, (spec["method"], p)
            assert (preempted > 0) == (config is short), (spec["method"], p)


def test_the_library_and_the_cli_speculate_against_the_oracle(capsys):
    """LLM(speculative_config=...) at p = 2: greedy and seeded requests each checked against the dense oracle on rank 0
    (check=True), the ledger against the model on every rank; its stats carry vLLM's counters. python -m serve takes
    --speculative-config JSON, and refuses bad JSON or settings in one line before any rank starts."""
    from serve import LLM
    from serve.__main__ import main

    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 9, 10, 9, 10], [1, 2, 3, 1, 2, 3, 1]]
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.9, seed=5, ignore_eos=True)]
    with LLM("llama_tiny", tensor_parallel_size=2, check=True, speculative_config=NGRAM) as llm:
        outs = llm.generate(prompts, params)
        stats = llm.stats()
    assert [o.oracle["verdict"] for o in outs] == ["match"] * 3
    assert stats["spec_decode_num_drafts"] > 0 and len(stats["spec_decode_num_accepted_tokens_per_pos"]) == 3
    assert stats["spec_decode_num_accepted_tokens"] == sum(stats["spec_decode_num_accepted_tokens_per_pos"])
    draft = {"method": "draft_model", "model": "llama_tiny", "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match="vocabulary of 50257 ids, the target 32000"):
        LLM("llama_tiny", speculative_config={**draft, "model": "article03"})
    rejection = {**draft, "draft_acceptance": "rejection_sampler"}
    with pytest.raises(ValueError, match="logprobs with speculative_config draft_acceptance="):
        check_request(SpeculativeConfig(**rejection), 1)  # LLM's driver and rank 0 both apply this rule
    check_request(SpeculativeConfig(**draft), 1)  # shared noise: a draft's tokens are plain sampling's, logprobs too
    # (a draft through LLM and the server: tests/test_api.py's server with a draft; at every p: below)
    capsys.readouterr()
    with pytest.raises(SystemExit):  # argparse's error for the flag's value
        main(["--model", "llama_tiny", "--prompt-ids", "1,2", "--speculative-config", "{nope"])
    assert "not JSON" in capsys.readouterr().err
    assert main(["--model", "llama_tiny", "--prompt-ids", "1,2", "--speculative-config",
                 '{"method": "ngram", "num_speculative_tokens": 0}']) == 2
    assert "--speculative-config num_speculative_tokens=0 must be" in capsys.readouterr().err
    assert main(["--model", "llama_tiny", "--prompt-ids", "5,6,7,5,6,7,5,6", "--max-tokens", "10", "--ignore-eos",
                 "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']) == 0
    out, err = capsys.readouterr()
    assert "proposed tokens accepted" in err


# ---- the distribution of a verified chunk's tokens ------------------------------------------------------------------

LOGITS = torch.tensor([1.2, 0.9, 0.4, 0.3, 0.0, -0.2, -0.7, -1.5], dtype=torch.float64)
DRAWS = 60_000
LIMIT = 120.0  # above chi-square's 99.99% point at 63 degrees of freedom (~114, Wilson-Hilferty): the most cells


def filtered(T: float, top_k: int, top_p: float) -> torch.Tensor:
    """softmax(LOGITS / T) after top-k and top-p, from the definitions (tests/test_sampling.py's expected)."""
    return expected(T, top_k, top_p, logits=LOGITS)[0]


def verified_pairs(ctx, proposals: tuple[int, int], T: float, top_k: int, top_p: float) -> list[int]:
    """DRAWS requests at the same fixed logits every position, each verifying `proposals` in one chunk of 3 rows
    (output positions 0, 1, 2) on this rank's slice; the first two tokens each request gets (a request that got one
    token draws its second in the next step, at output position 1, as the engine would). Counts of the 64 pairs."""
    V, p = len(LOGITS), ctx.world_size
    n = V // p
    local = LOGITS[ctx.rank * n:(ctx.rank + 1) * n]
    rows = [(T, top_k, top_p, 0.0, seed, j) for seed in range(DRAWS) for j in range(3)]
    tokens = sample(local.expand(3 * DRAWS, -1).clone(), ctx.rank * n, ctx.group,
                    SamplingBatch.build(rows, -1, "cpu"), V).tokens.view(DRAWS, 3).tolist()
    nxt = sample(local.expand(DRAWS, -1).clone(), ctx.rank * n, ctx.group,
                 SamplingBatch.build([(T, top_k, top_p, 0.0, seed, 1) for seed in range(DRAWS)], -1, "cpu"),
                 V).tokens.tolist()
    counts = [0] * (V * V)
    for row, second in zip(tokens, nxt):
        got = accept(row, proposals)
        got = got + [second] if len(got) == 1 else got
        counts[got[0] * V + got[1]] += 1
    return counts


@pytest.mark.parametrize("proposals,T,top_k,top_p", [((0, 1), 1.0, 0, 1.0), ((7, 7), 0.8, 0, 1.0),
                                                     ((2, 0), 1.3, 4, 1.0), ((1, 6), 0.9, 0, 0.8)])
def test_verified_tokens_are_distributed_as_sampling_one_at_a_time(proposals, T, top_k, top_p):
    """Fixed logits at every position: the first two tokens must be independent draws of the filtered softmax. The
    proposals are likely (0, 1), impossible under the filter (7 with top-k 4, 6 with top-p 0.8) or unlikely. Power: the
    same counts against what a verifier that always accepted the first proposal would give fail."""
    counts = torch.tensor(run_ranks(2, verified_pairs, proposals, T, top_k, top_p)[0], dtype=torch.float64)
    q = filtered(T, top_k, top_p)
    joint = (q[:, None] * q[None, :]).flatten()
    assert chi2(counts, joint) < LIMIT
    wrong = torch.zeros(len(LOGITS), dtype=torch.float64)  # the first token always the proposal
    wrong[proposals[0]] = 1.0
    assert chi2(counts, (wrong[:, None] * q[None, :]).flatten()) > 10 * LIMIT
    assert math.isfinite(chi2(counts, joint))


# ---- the rejection sampler (a draft q that is not a point mass) -------------------------------------------------------

ZP = torch.tensor([1.0, 0.6, 0.5, 0.1, -0.2, -0.4, -0.9, -1.4], dtype=torch.float64)
ZQ = torch.tensor([-0.5, 1.1, -1.0, 0.9, 0.3, -2.0, 0.4, 0.0], dtype=torch.float64)
NEG = float("-inf")
DRAFTS = {  # the draft's logits: q differs from p; q's support disjoint from p's top-4; q one-hot; q = 0 on most of
    "q != p": ZQ,  # p's support; q = p (a self-draft)
    "disjoint": torch.tensor([NEG] * 4 + [0.0, 0.2, 0.4, 0.6], dtype=torch.float64),
    "one-hot": torch.tensor([NEG, NEG, NEG, 0.0, NEG, NEG, NEG, NEG], dtype=torch.float64),
    "q = 0 where p > 0": torch.tensor([NEG, 0.5, 0.0, NEG, NEG, NEG, NEG, NEG], dtype=torch.float64),
    "self": ZP,
}
SPEC_DRAWS = 25_000


def _slice(ctx, z: torch.Tensor, rows: int) -> tuple[torch.Tensor, int]:
    n = len(z) // ctx.world_size
    return z[ctx.rank * n:(ctx.rank + 1) * n].expand(rows, -1).clone(), ctx.rank * n


def speculate(ctx, zq: torch.Tensor, first: int, T: float, top_k: int, top_p: float, K: int = 2,
              breaks: str = "", draws: int = SPEC_DRAWS) -> list[list[int]]:
    """SPEC_DRAWS requests at the fixed target logits ZP and draft logits zq (the same at every position), from
    output position `first`: the draft samples K proposals (its own noise stream), the target verifies them in K + 1
    rows; each request's tokens. breaks: a deliberately wrong verifier, to show the tests' power."""
    from layers.sampling.rejection_sampler import DRAFT_STREAM, filtered_logprobs, rejection_sample, verify

    D, V = draws, len(ZP)
    params = lambda pos, salt=0: SamplingBatch.build(  # noqa: E731
        [(T, top_k, top_p, 0.0, seed ^ salt, pos + j) for seed in range(D) for j in range(K + 1)], -1, "cpu")
    zq_local, start = _slice(ctx, zq, D * (K + 1))
    drafted = sample(zq_local, start, ctx.group, params(first, DRAFT_STREAM), V).tokens.view(D, K + 1)[:, :K]
    batch = params(first)
    proposal = torch.cat([drafted, torch.full((D, 1), -1)], dim=1).flatten()
    zp_local = _slice(ctx, ZP, D * (K + 1))[0]
    p_logp = filtered_logprobs(zp_local, start, ctx.group, batch)[0]
    q_logp = filtered_logprobs(zq_local, start, ctx.group, batch)[0]
    if breaks == "accept with p":  # q ignored: accept with probability p(x)
        q_logp = torch.zeros_like(q_logp)
    if breaks == "residual p":  # the residual drawn from p, not from max(0, p - q)
        accepted, token, _ = rejection_sample(p_logp, q_logp, proposal, zp_local, start, ctx.group, batch)
        _, residual, _ = rejection_sample(p_logp, torch.full_like(q_logp, NEG), proposal, zp_local, start,
                                          ctx.group, batch)
        token = torch.where(accepted, token, residual)
    else:
        accepted, token, _ = rejection_sample(p_logp, q_logp, proposal, zp_local, start, ctx.group, batch)
    accepted, token = accepted.view(D, K + 1).tolist(), token.view(D, K + 1).tolist()
    out = []
    for a, t in zip(accepted, token):
        got = verify(a, t)
        out.append(got[:-1] if breaks == "drop the bonus" and len(got) == K + 1 else got)
    return out


def first_two(ctx, zq, T, top_k, top_p, breaks="") -> list[int]:
    """Counts of each request's first two tokens (a request that got one token gets its second from the next step's
    verification, at output position 1)."""
    V = len(ZP)
    draws = SPEC_DRAWS if not breaks else 10_000  # a broken verifier is far off: fewer draws show it
    one, two = (speculate(ctx, zq, first, T, top_k, top_p, breaks=breaks, draws=draws) for first in (0, 1))
    counts = [0] * (V * V)
    for a, b in zip(one, two):
        pair = a[:2] if len(a) >= 2 else a + b[:1]
        counts[pair[0] * V + pair[1]] += 1
    return counts


def target(T, top_k, top_p) -> torch.Tensor:
    """The target's filtered softmax at ZP (tests/test_sampling.py's expected)."""
    return expected(T, top_k, top_p, logits=ZP)[0]


@pytest.mark.parametrize("draft,T,top_k,top_p", [("q != p", 1.0, 0, 1.0), ("q != p", 0.7, 0, 0.85),
                                                 ("disjoint", 1.2, 4, 1.0), ("one-hot", 0.9, 0, 1.0),
                                                 ("q = 0 where p > 0", 1.0, 5, 0.9)])
def test_the_rejection_sampler_draws_the_targets_distribution(draft, T, top_k, top_p):
    """Fixed logits over 8 ids at p = 2, a draft q that differs from p in each way that matters, top-k and top-p on
    the target (and the draft): the first two tokens of 25,000 seeded requests are independent draws of the target's
    filtered softmax (chi-square below LIMIT). Power, on the first case: accepting with probability p(x) (q ignored),
    or drawing the residual from p instead of max(0, p − q), exceeds the limit already over 10,000 draws."""
    q = target(T, top_k, top_p)
    joint = (q[:, None] * q[None, :]).flatten()
    counts = torch.tensor(run_ranks(2, first_two, DRAFTS[draft], T, top_k, top_p)[0], dtype=torch.float64)
    assert chi2(counts, joint) < LIMIT, chi2(counts, joint)
    if (draft, top_p) == ("q != p", 1.0):
        for wrong in ("accept with p", "residual p"):
            bad = torch.tensor(run_ranks(2, first_two, DRAFTS[draft], T, top_k, top_p, wrong)[0], dtype=torch.float64)
            assert chi2(bad, joint) > LIMIT, (wrong, chi2(bad, joint))


def test_a_self_draft_accepts_everything_and_the_bonus_is_the_targets():
    """q = p: every proposal is accepted (p/q = 1), each request gets K + 1 tokens, and the bonus (the third) is a
    draw of p. Dropping the bonus token fails here."""
    T, K = 0.8, 2
    got = run_ranks(2, speculate, DRAFTS["self"], 0, T, 0, 1.0, K)[0]
    assert all(len(g) == K + 1 for g in got)
    counts = torch.bincount(torch.tensor([g[K] for g in got]), minlength=len(ZP)).double()
    assert chi2(counts, target(T, 0, 1.0)) < 45.0
    dropped = run_ranks(2, speculate, DRAFTS["self"], 0, T, 0, 1.0, K, "drop the bonus")[0]
    assert not all(len(g) == K + 1 for g in dropped)


def filtered_grid(ctx) -> list[list[float]]:
    """filtered_logprobs of tests/test_sampling.py's LOGITS, a row per case of its GRID, on this rank's slice."""
    from layers.sampling.rejection_sampler import filtered_logprobs
    from tests.test_sampling import GRID, LOGITS

    V, p = len(LOGITS), ctx.world_size
    n = -(-V // p)
    padded = torch.cat([LOGITS, torch.full((n * p - V,), NEG, dtype=torch.float64)])
    local = padded[ctx.rank * n:(ctx.rank + 1) * n].expand(len(GRID), -1).clone()
    rows = [(c["T"], c.get("top_k", 0), c.get("top_p", 1.0), c.get("min_p", 0.0), 0, 0) for c in GRID]
    return filtered_logprobs(local, ctx.rank * n, ctx.group, SamplingBatch.build(rows, -1, "cpu"))[0].tolist()


def test_filtered_logprobs_are_the_samplers_distribution_at_every_p():
    """filtered_logprobs on each rank's slice, gathered, against softmax(z/T) restricted by the filters (the
    definitions, tests/test_sampling.py's expected) at p = 1 and 2 (13 ids, padded to 14), every filter of the grid."""
    from tests.test_sampling import GRID, LOGITS, expected

    for p in (1, 2):
        slices = run_ranks(p, filtered_grid)
        got = torch.tensor([sum((s[i] for s in slices), []) for i in range(len(GRID))], dtype=torch.float64)[:, :len(LOGITS)]
        for case, row in zip(GRID, got):
            want, _ = expected(case["T"], case.get("top_k", 0), case.get("top_p", 1.0), case.get("min_p", 0.0))
            assert torch.allclose(row.exp(), want, atol=1e-12), (p, case)


# ---- a draft model through the engine ---------------------------------------------------------------------------------

DRAFT = {"method": "draft_model", "model": "-", "num_speculative_tokens": 3,  # the engine is given the model itself
         "adaptive": False}
REJECTION = {**DRAFT, "draft_acceptance": "rejection_sampler"}


def test_a_draft_model_gives_plain_decodings_tokens_at_every_p():
    """A one-layer draft of another seed (GPT-2 shape, vocabulary 1001). Shared noise (the default): every request,
    greedy or sampled with each filter, gets the tokens (and logprobs) of plain decoding at p = 1, 2, 4. The rejection
    sampler: greedy requests get plain decoding's tokens, sampled ones the same tokens at p = 1 and 2 (the draft is
    whole on every rank, the verifier's noise keyed by seed, position and id). Prefix hits, chunked prefill and
    preemption in the run; every step's collectives equal the model on every rank; every block back."""
    from dataclasses import replace

    shared = list(range(40, 48))
    ps = repetitive_prompts(10, seed=3, shared=shared)
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
              SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.9, seed=1, logprobs=2),
              SamplingParams(max_tokens=9, ignore_eos=True, temperature=1.1, top_k=20, top_p=0.9, seed=2),
              SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.7, min_p=0.02, seed=3)]
    reqs = [(f"r{i}", pr, params[i % len(params)], i % 3) for i, pr in enumerate(ps)]
    base = dict(long_prefill_token_threshold=6, max_num_batched_tokens=24, max_num_seqs=8, block_size=4,
                num_gpu_blocks_override=20)
    plain = run_ranks(1, serve, GPT2, reqs, EngineConfig(**base))[0][0]
    draft = (replace(GPT2, n_layers=1), 5)
    for p in (1, 2, 4):
        config = EngineConfig(**base, speculative_config=DRAFT)
        (done, _, preempted, free), stats = run_ranks(p, spec_run, GPT2, reqs, config, draft)[0]
        assert free == 20 and 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
        assert preempted > 0 or p > 1
        for name, _, q, _ in reqs:
            assert done[name].token_ids == plain[name].token_ids, (name, p)
            if q.logprobs is not None:
                assert done[name].logprobs == plain[name].logprobs or max(
                    abs(a[t] - b[t]) for a, b, t in zip(done[name].logprobs, plain[name].logprobs,
                                                        done[name].token_ids)) < 1e-12, (name, p)
    no_logprobs = [(name, pr, replace(q, logprobs=None), at) for name, pr, q, at in reqs]  # refused by this rule
    runs = {p: run_ranks(p, serve, GPT2, no_logprobs, EngineConfig(**base, speculative_config=REJECTION), draft=draft)[0]
            for p in (1, 2)}
    for p, (done, _, _, free) in runs.items():
        assert free == 20
        for name, _, q, _ in reqs:
            if q.greedy:
                assert done[name].token_ids == plain[name].token_ids, (name, p)
            assert done[name].token_ids == runs[1][0][name].token_ids, (name, p)
            assert len(done[name].token_ids) == q.max_tokens
    sampled = [name for name, _, q, _ in reqs if not q.greedy]
    assert any(runs[1][0][n].token_ids != plain[n].token_ids for n in sampled)  # another coupling: other tokens


def test_a_self_draft_is_always_accepted():
    """The draft is the target itself: every proposal is accepted (acceptance rate 1.0) and every draft yields K + 1
    tokens (mean acceptance length 4 at K = 3), greedy and sampled, at p = 2; the tokens are the plain ones."""
    ps = repetitive_prompts(8, seed=4, shared=list(range(40, 48)))
    reqs = [(f"r{i}", pr, SamplingParams(max_tokens=13, ignore_eos=True, temperature=0.8 * (i % 2), seed=i), i % 3)
            for i, pr in enumerate(ps)]
    base = dict(long_prefill_token_threshold=5, max_num_batched_tokens=32, max_num_seqs=8, block_size=4,
                num_gpu_blocks_override=20)  # chunked prompts, prefix hits, preemption: the draft's cache follows
    (done, _, preempted, _), stats = run_ranks(2, spec_run, GPT2, reqs, EngineConfig(**base, speculative_config=DRAFT),
                                               (GPT2, 0))[0]
    plain = run_ranks(2, serve, GPT2, reqs, EngineConfig(**base))[0][0]
    assert preempted > 0 and stats["spec_decode_num_drafts"] > 10 and stats["spec_decode_acceptance_rate"] == 1.0
    # with room for every proposal (13 tokens: the prompt's, then 4 drafts of 3), each draft yields K + 1 tokens
    roomy = EngineConfig(max_num_batched_tokens=128, max_num_seqs=8, block_size=4, speculative_config=DRAFT)
    stats = run_ranks(2, spec_run, GPT2, reqs, roomy, (GPT2, 0))[0][1]
    assert stats["spec_decode_acceptance_rate"] == 1.0 and stats["spec_decode_mean_acceptance_length"] == 4.0
    assert stats["spec_decode_num_accepted_tokens_per_pos"] == [stats["spec_decode_num_drafts"]] * 3
    assert all(done[n].token_ids == plain[n].token_ids for n, _, q, _ in reqs if q.greedy)


def draft_distributions(ctx, reqs, config, draft_cfg, draft_seed) -> float:
    """Serve reqs at p = 1 with a draft model and record every proposal's q (the draft's distribution on the ids,
    from its paged cache); the largest difference from the dense draft model recomputed without a cache on the
    request's tokens and the proposals before it."""
    from layers.models.lm import shard_lm
    from serve.build import own_group
    from serve.engine import LLMEngine

    dense = init_weights(dense_lm(GPT2, torch.float64), seed=0)
    draft = init_weights(dense_lm(draft_cfg, torch.float64), seed=draft_seed)
    engine = LLMEngine(shard_lm(dense, "v2", ctx.group), ctx, config, seed=0,
                       draft_lm=shard_lm(draft, "v2", own_group(ctx)))
    seen, propose = [], engine.draft.propose

    def recording(plan, requests):
        plan, proposal, q = propose(plan, requests)
        i = 0
        for c in plan.scheduled:
            if c.spec:
                seen.append((list(requests[c.request].tokens), list(c.spec), q[i:i + len(c.spec)].clone()))
                i += len(c.spec) + 1
        return plan, proposal, q

    engine.draft.propose = recording

    def before(engine, step):
        for name, prompt, q, at in reqs:
            if at == step:
                engine.add_request(name, prompt, q)

    step_engine(engine, before, max(r[3] for r in reqs))
    worst = 0.0
    with torch.no_grad():
        for tokens, spec, q in seen:
            for j in range(len(spec)):
                z = draft.logits(torch.tensor(tokens + spec[:j]))[-1].double()
                worst = max(worst, float((q[j].exp() - torch.softmax(z, -1)).abs().max()))
    return worst if seen else float("inf")


def test_the_drafts_cache_holds_what_a_recompute_gives():
    """Every proposal's q, read off the draft's own paged cache through chunked prompts, prefix hits, preemption and
    steps that accepted everything (the draft then computes two rows), equals the dense draft recomputed without a
    cache, to 1e-12 (temperature 1, no filter: q is the draft's softmax)."""
    from dataclasses import replace

    ps = repetitive_prompts(8, seed=6, shared=list(range(40, 48)))
    reqs = [(f"r{i}", pr, SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=i), i % 3)
            for i, pr in enumerate(ps)]
    config = EngineConfig(long_prefill_token_threshold=5, max_num_batched_tokens=32, max_num_seqs=8, block_size=4,
                          num_gpu_blocks_override=20, speculative_config=REJECTION)
    for draft in ((GPT2, 0), (replace(GPT2, n_layers=1), 5)):  # the target itself: everything accepted; another
        assert run_ranks(1, draft_distributions, reqs, config, *draft)[0] < 1e-12, draft


# ---- the Tuner: how many tokens to propose --------------------------------------------------------------------------

def simulate(tuner, acceptance: float, base: float, per_token: float, steps: int = 3000, batch: int = 4,
             seed: int = 0) -> float:
    """Tokens per second of simulated time: each step costs base + per_token * k per request, each slot is accepted
    with probability `acceptance` while the ones before it were (k = tuner's choice, or a fixed int)."""
    import random

    rng = random.Random(seed)
    tokens = elapsed = 0.0
    for _ in range(steps):
        k = tuner if isinstance(tuner, int) else tuner.choose(batch)
        elapsed += batch * (base + per_token * k) * rng.uniform(0.9, 1.1)  # a noisy clock
        for _ in range(batch):
            accepted = 0
            while accepted < k and rng.random() < acceptance:
                accepted += 1
            tokens += accepted + 1
            if not isinstance(tuner, int) and k:
                tuner.observe(k, accepted)
        if not isinstance(tuner, int):
            tuner.observe_step(batch, k, batch * (base + per_token * k) * rng.uniform(0.9, 1.1))
    return tokens / elapsed


@pytest.mark.parametrize("acceptance,per_token", [(0.8, 0.1), (0.5, 0.2), (0.3, 0.5), (0.9, 2.0), (0.0, 0.05)])
def test_the_tuner_is_never_slower_than_no_speculation_and_keeps_the_gain(acceptance, per_token):
    """Simulated steps (cost 1 + per_token * k per request, each proposal accepted with a fixed probability): the
    Tuner's tokens per second are at least 95% of the better of no speculation and the best fixed k: it turns itself
    off where speculation loses (a costly draft, nothing accepted) and keeps most of the gain where it pays. Always
    proposing K, or never, fails some of these cases."""
    from serve.spec_decode import Tuner

    K = 4
    fixed = {k: simulate(k, acceptance, 1.0, per_token) for k in range(K + 1)}
    tuned = simulate(Tuner(K), acceptance, 1.0, per_token)
    assert tuned >= 0.95 * max(fixed.values()), (tuned, fixed)
    assert tuned >= 0.97 * fixed[0], (tuned, fixed[0])


def test_the_tuner_counts_offered_slots_and_probes_its_neighbours():
    from serve.spec_decode import Regime, Tuner

    t = Tuner(3)
    t.observe(3, 1)  # slot 0 hit, slot 1 tried and missed, slot 2 never reached
    assert t.trials[True] == [1, 1, 0] and t.hits[True] == [1, 0, 0] and t.trials[False] == [0, 0, 0]
    assert t.acceptance() == [0.75, 0.375, 0.375]  # (hits + the slot before's estimate) / (trials + 1)
    t.observe(2, 0)  # the first proposal rejected, or none made (n-gram found nothing): no token from the slot
    assert t.trials[True][0] == 2 and t.hits[True][0] == 1
    g = Regime(times={0: [1.0, 1.0], 3: [1.2, 1.2]})
    assert t.step_time(g, 0) == 1.0 and abs(t.step_time(g, 3) - 1.2) < 1e-12  # the line from T(0) to T(3)
    g.times[1] = [1.5, 1.5]  # a fixed cost of proposing at all (a draft's first forward): k = 0 is not on the line
    assert abs(t.step_time(g, 2) - 1.35) < 1e-9 and t.step_time(g, 0) == 1.0
    g.times[1] = [1.5, 1.5, 1.5, 1.5, 60.0]  # one slow step moves nothing: the median of the last five
    assert abs(t.step_time(g, 2) - 1.35) < 1e-9
    cost = {0: 1.0, 1: 1.3, 2: 1.4, 3: 1.5}  # seconds per step at each k
    for accepted, best, probe in (("none", 0, [1, 1, 1]), ("all", 3, [2, 2, 2, 0, 0, 0])):
        t, spent = Tuner(3), []

        def step() -> int:  # as the engine: choose, run, observe
            k = t.choose(1)
            if k:
                t.observe(k, 0 if accepted == "none" else k)
            t.observe_step(1, k, cost[k])
            spent.append((cost[k], 1 + (k if accepted == "all" else 0)))
            return k

        chosen = [step() for _ in range(600)]
        # k = 0 until two kept measurements (a regime's first step and one after a switch are not kept), then 1
        assert chosen[:6] == [0, 0, 0, 1, 1, 1] and max(set(chosen), key=chosen.count) == best, chosen
        # then the best, with probes of PROBE_RUN steps (up, down, off in turn where they exist), ever rarer...
        at = [i for i, k in enumerate(chosen) if i >= 6 and k != best]
        starts = [i for i in at if i - 1 not in at]
        gaps = [b - a for a, b in zip(starts, starts[1:])]
        assert [chosen[i] for i in at] == (probe * 9)[:len(at)] and len(starts) >= 4
        assert all(gap >= 8 * 2 ** i + 2 for i, gap in enumerate(gaps)), gaps
        # ... and within PROBE_BUDGET: tokens per second after the first six steps within 3% of the best k's
        took, tokens = (sum(x) for x in zip(*spent[6:]))
        assert tokens / took >= 0.97 * spent[-1][1] / cost[best] and chosen[-1] == best
    assert t.choose(1, greedy=False) == 0 and (0, False) in t.regimes  # sampling is a regime of its own
