"""KV eviction (serve/eviction.py, layers/attention/eviction.py) in the paged engine: StreamingLLM's sinks + window,
and H2O's heavy hitters at block granularity.

Oracles: the dense model recomputed with no cache, its attention masked by a rule written here on its own.
  streaming   query i reads key j iff j <= i and (j < sink or i - j < window)
  h2o         query i reads key j iff j <= i and j's block was not evicted at a step that had computed <= i
              positions (the engine's log of what went when, per admission: a preemption starts again); an h2o
              request takes no prefix hit, so the same prompt is decided by the same queries
The engine, with blocks freed as it goes, equals it to 1e-12 in float64 at p = 1 and 2, in every backend, with
chunked prefill, prefix hits and preemption in the run: greedy tokens, their logprobs and the prompt's logprobs. H2O's
choices are recomputed too: each block evicted had the least attention (every query before, every head and layer of
the dense model, under the same masks) among the blocks it could have been. A window that covers every sequence
changes nothing, token for token and bit for bit; the masked reference does differ from plain attention (the checks
can fail)."""

import random
from unittest.mock import patch

import pytest
import torch

import layers.attention.attention as attention_module
from layers.models.config import ModelConfig
from layers.models.dense import init_weights
from layers.models.llama import LlamaConfig
from layers.models.lm import dense_lm, shard_lm
from serve.config import EngineConfig
from serve.engine import LLMEngine
from serve.sampling_params import SamplingParams
from tests.common import greedy_logprobs, step_engine
from tests.harness import run_ranks

GPT2 = ModelConfig(d_model=64, n_heads=4, d_head=16, d_ffn=128, n_layers=2, max_seq_len=96, vocab_size=257)
LLAMA = LlamaConfig(d_model=64, n_heads=8, n_kv_heads=2, d_head=8, d_ffn=96, n_layers=2, max_seq_len=96,
                    vocab_size=257)
SINK, WINDOW = 3, 9  # a sink that ends inside a block, a window of two blocks and a bit
SMALL = dict(long_prefill_token_threshold=5, max_num_batched_tokens=12, max_num_seqs=4, block_size=4,
             num_gpu_blocks_override=12)  # chunked prompts; a pool small enough that requests are preempted
STREAMING = {"policy": "streaming", "sink_tokens": SINK, "window_tokens": WINDOW}


def workload(seed: int) -> list[tuple[list[int], int, int, bool]]:
    """(prompt, max_tokens, step it arrives, prompt logprobs): prompts longer than the window; two share a prefix
    with the first (prefix hits); the last is longer than the pool holds (eviction keeps it within)."""
    rng = random.Random(seed)
    first = [rng.randrange(257) for _ in range(30)]
    reqs = [(first, 8, 0, True), (first[:24] + [7, 8, 9], 6, 3, False), (list(first), 5, 6, False)]
    for i in range(3):
        reqs.append(([rng.randrange(257) for _ in range(rng.randint(4, 34))], rng.randint(3, 9), 1 + 2 * i, i == 1))
    reqs.append(([rng.randrange(257) for _ in range(50)], 8, 2, False))  # 57 positions: more than the pool's 48
    return reqs


def serve(ctx, cfg, reqs, config):
    """Every rank steps its LLMEngine; rank 0 adds each request at its step. Rank 0 returns (id -> (tokens, their
    logprobs, prompt logprobs of the prompt's tokens or None), stats, id -> its eviction log (Request.evictions))."""
    dense = init_weights(dense_lm(cfg, torch.float64), seed=0, std=0.1)
    engine = LLMEngine(shard_lm(dense, "v2", ctx.group), ctx, config)
    done, logs = {}, {}

    def before(engine, step):
        for name, rid in engine._ids.items():  # the log before each step (a finished request is forgotten), and
            r = engine.scheduler.by_id.get(rid)  # h2o's totals per block with the positions they count
            if r is not None:
                logs[name] = [(start, first, list(gone)) for start, first, gone in r.evictions]
                if r.kv_scores:
                    logs[name + "/scores"] = (list(r.kv_scores), r.num_computed_tokens, len(r.evictions))
        for i, (prompt, new, at, scored) in enumerate(reqs):
            if at == step:
                engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=new, logprobs=0,
                                                                   prompt_logprobs=0 if scored else None))

    def sink(outputs, step):
        for o in outputs:
            if o.finished:
                c = o.outputs[0]
                prompt = None if o.prompt_logprobs is None else \
                    [lp[t] for lp, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])]
                done[o.request_id] = (c.token_ids, [lp[t] for lp, t in zip(c.logprobs, c.token_ids)], prompt)

    step_engine(engine, before, max(r[2] for r in reqs), sink)
    if not ctx.is_main:
        return None
    stats = engine.stats()
    engine.shutdown()
    return done, stats, logs


def streaming_mask(n: int, device=None) -> torch.Tensor:
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    return (j <= i) & ((j < SINK) | (i - j < WINDOW))


def reference(dense, prompt: list[int], n: int, masked: bool = True):
    """Greedy tokens, their logprobs and the prompt's, recomputed with no cache under the streaming mask."""
    with torch.no_grad(), patch.object(attention_module, "reference_mask", streaming_mask if masked else
                                       attention_module.reference_mask):
        whole = torch.log_softmax(dense.logits(torch.tensor(prompt)), dim=-1)
        scored = [float(whole[i - 1, prompt[i]]) for i in range(1, len(prompt))]
        ids, lps = greedy_logprobs(dense, prompt, n)
    return ids, lps, scored


@pytest.mark.parametrize("cfg,p,attention", [(GPT2, 1, "reference"), (LLAMA, 2, "cpu"), (GPT2, 2, "batched")],
                         ids=["gpt2-p1-reference", "llama-p2-cpu", "gpt2-p2-batched"])
def test_the_engine_equals_the_masked_dense_reference(cfg, p, attention):
    reqs = workload(seed=p)
    done, stats, _ = run_ranks(p, serve, cfg, reqs, EngineConfig(**SMALL, attention=attention,
                                                               kv_eviction=STREAMING))[0]
    dense = init_weights(dense_lm(cfg, torch.float64), seed=0, std=0.1)
    for i, (prompt, new, _, scored) in enumerate(reqs):
        ids, lps, prompt_lps = reference(dense, prompt, new)
        got_ids, got_lps, got_prompt = done[f"r{i}"]
        assert got_ids == ids, (i, got_ids, ids)
        assert max(abs(a - b) for a, b in zip(got_lps, lps)) < 1e-12
        if scored:
            assert max(abs(a - b) for a, b in zip(got_prompt, prompt_lps)) < 1e-12
    assert stats["preemptions"] > 0 and stats["prefix_hit_tokens"] > 0  # both took place and changed nothing
    assert stats["kv_evicted_blocks"] > 0


def test_the_mask_matters_and_a_window_over_everything_changes_nothing():
    """The check above can fail: on these prompts the masked reference's logprobs differ from plain attention's.
    And with a window longer than every sequence the engine's tokens and logprobs are bit for bit those without
    eviction, no block evicted."""
    reqs = workload(seed=1)[:-1]  # without the request longer than the pool (held only by evicting)
    dense = init_weights(dense_lm(GPT2, torch.float64), seed=0, std=0.1)
    plain, masked = reference(dense, reqs[0][0], 4, masked=False), reference(dense, reqs[0][0], 4)
    assert max(abs(a - b) for a, b in zip(plain[2], masked[2])) > 1e-3
    wide = dict(STREAMING, window_tokens=96)
    with_done, with_stats, _ = run_ranks(1, serve, GPT2, reqs, EngineConfig(**SMALL, kv_eviction=wide))[0]
    without_done, _, _ = run_ranks(1, serve, GPT2, reqs, EngineConfig(**SMALL))[0]
    assert with_done == without_done and with_stats["kv_evicted_blocks"] == 0


H2O = {"policy": "h2o", "budget_tokens": 12, "recent_tokens": 4}  # 3 blocks: 1 recent, 2 heavy hitters


def epoch_of(log: list, k: int) -> list[tuple[int, int]]:
    """The evictions in force when output token k was computed: those of the last admission begun at or before it."""
    return [gone for start, _, gone in log if start <= k][-1]


def evicted_mask(gone: list[tuple[int, int]], block_size: int):
    """The rule written out: key j is hidden from query i once j's block was evicted at a step that had computed
    t <= i positions."""
    def mask(n: int, device=None) -> torch.Tensor:
        at = torch.full((n,), float("inf"), dtype=torch.float64)
        for b, t in gone:
            at[b * block_size:(b + 1) * block_size] = torch.minimum(at[b * block_size:(b + 1) * block_size],
                                                                    torch.tensor(float(t), dtype=torch.float64))
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        return (j <= i) & ~(at[None, :] <= i)
    return mask


def masked_logprobs(dense, tokens: list[int], mask) -> torch.Tensor:
    with torch.no_grad(), patch.object(attention_module, "reference_mask", mask):
        return torch.log_softmax(dense.logits(torch.tensor(tokens)), dim=-1)


def attention_totals(dense, tokens: list[int], mask) -> torch.Tensor:
    """[n, n]: query i's attention probability on key j under the mask, summed over every head and layer."""
    import layers.attention.attention as module

    total, original = [], module.F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, is_causal=False, scale=None, **kw):
        logits = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        total.append(logits.masked_fill(~attn_mask, float("-inf")).softmax(-1).sum(dim=(0, 1)))
        return original(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)

    with patch.object(module.F, "scaled_dot_product_attention", recording):
        masked_logprobs(dense, tokens, mask)
    return sum(total)


@pytest.mark.parametrize("cfg,p,attention", [(GPT2, 1, "reference"), (LLAMA, 2, "batched"), (LLAMA, 2, "cpu")],
                         ids=["gpt2-p1-reference", "llama-p2-batched", "llama-p2-cpu"])
def test_h2o_equals_the_dense_reference_and_evicts_the_least_attended_blocks(cfg, p, attention):
    reqs = workload(seed=p + 10)
    done, stats, logs = run_ranks(p, serve, cfg, reqs, EngineConfig(**SMALL, attention=attention, kv_eviction=H2O))[0]
    dense = init_weights(dense_lm(cfg, torch.float64), seed=0, std=0.1)
    bs, decisions, totals_checked = SMALL["block_size"], 0, 0
    for i, (prompt, new, _, scored) in enumerate(reqs):
        got_ids, got_lps, got_prompt = done[f"r{i}"]
        log = logs.get(f"r{i}", [])
        for k, (token, lp) in enumerate(zip(got_ids, got_lps)):  # each token under the masks of its admission
            logp = masked_logprobs(dense, prompt + got_ids[:k], evicted_mask(epoch_of(log, k), bs))[-1]
            assert int(logp.argmax()) == token and abs(float(logp[token]) - lp) < 1e-12, (i, k)
        if scored:  # the prompt, scored again at its last admission
            whole = masked_logprobs(dense, prompt, evicted_mask(log[-1][2], bs))
            want = [float(whole[j - 1, prompt[j]]) for j in range(1, len(prompt))]
            assert max(abs(a - b) for a, b in zip(got_prompt, want)) < 1e-12
        if f"r{i}/scores" in logs:  # the totals rank 0 holds: every rank's heads, every layer, this admission's queries
            kv_scores, computed, admission = logs[f"r{i}/scores"]
            _, first, gone = log[admission - 1]
            totals = attention_totals(dense, (prompt + got_ids)[:computed], evicted_mask(gone, bs))
            want = [float(totals[first:computed, b * bs:(b + 1) * bs].sum()) for b in range(len(kv_scores))]
            assert max(abs(a - b) for a, b in zip(kv_scores, want)) < 1e-9, (i, kv_scores, want)
            totals_checked += 1
        for start, first, gone in log:  # each eviction: the least attended of the blocks it could have taken, by
            tokens = prompt + got_ids  # the queries this admission ran (from `first`: a prefix hit's ran elsewhere)
            totals = attention_totals(dense, tokens, evicted_mask(gone, bs))
            for t in sorted({t for _, t in gone}):
                before = {b for b, u in gone if u < t}
                held = [b for b in range(-(-t // bs)) if b not in before]
                old = [b for b in held if (b + 1) * bs <= t - H2O["recent_tokens"]]
                score = {b: float(totals[first:t, b * bs:(b + 1) * bs].sum()) for b in old}
                over = len(held) - H2O["budget_tokens"] // bs
                want = sorted(sorted(old, key=lambda b: (score[b], b))[:over])
                assert sorted(b for b, u in gone if u == t) == want, (i, t, score)
                decisions += 1
    assert stats["kv_evicted_blocks"] > 0 and decisions > 0 and stats["preemptions"] > 0 and totals_checked > 0
    assert stats["prefix_hit_tokens"] == 0  # h2o decides by a request's own queries: it takes no prefix hit


@pytest.mark.parametrize("settings,words", [
    (dict(kv_eviction={"policy": "streaming", "window_tokens": 8}, block_size=16), "smaller than a block"),
    (dict(kv_eviction={"policy": "snapkv", "budget_tokens": 32}), "choose streaming or h2o"),
    (dict(kv_eviction={"policy": "h2o", "window_tokens": 32}), "window_tokens is not a setting of policy='h2o'"),
    (dict(kv_eviction={"policy": "h2o"}), "needs budget_tokens"),
    (dict(kv_eviction={"policy": "h2o", "budget_tokens": 64, "recent_tokens": 8}, block_size=16),
     "recent_tokens=8 is smaller than a block"),
    (dict(kv_eviction={"policy": "h2o", "budget_tokens": 40, "recent_tokens": 32}, block_size=16),
     "leaves no block for heavy hitters"),
    (dict(kv_eviction={"policy": "streaming"}), "needs window_tokens"),
    (dict(kv_eviction={"policy": "streaming", "window_tokens": 32, "sinks": 4}), "unknown key 'sinks'"),
    (dict(kv_eviction={"policy": "streaming", "window_tokens": 32, "sink_tokens": -1}), "sink_tokens=-1"),
    (dict(kv_eviction={"policy": "streaming", "window_tokens": 32},
          speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "with speculative_config"),
    (dict(kv_eviction="streaming"), "must be a dict"),
])
def test_bad_settings_are_refused_in_one_line(settings, words):
    with pytest.raises(ValueError, match=words) as info:
        EngineConfig(**settings)
    assert "\n" not in str(info.value)


def test_a_request_longer_than_the_pool_is_refused_without_eviction():
    """The long request of the workload is served above only because eviction keeps it within the pool: without
    eviction it is refused when added, naming the blocks it needs."""
    from serve.scheduler import SchedulerError, Scheduler
    from serve.block_manager import KVCacheManager
    from serve.request import Request

    long = workload(seed=1)[-1]
    for eviction, refused in ((None, True), (STREAMING, False), (H2O, False)):
        config = EngineConfig(**SMALL, kv_eviction=eviction)
        sched = Scheduler(config, KVCacheManager(SMALL["num_gpu_blocks_override"], SMALL["block_size"]))
        if refused:
            with pytest.raises(SchedulerError, match="15 KV blocks"):
                sched.add(Request(0, long[0], long[1]))
        else:
            sched.add(Request(0, long[0], long[1]))


def drive_host_only(config: EngineConfig, num_blocks: int, reqs) -> tuple[int, list]:
    """The scheduler and block manager without a model (token 5 every step): the most blocks any request held at an
    iteration's end (what was left after its evictions) or during one (what it reached), and the requests."""
    from serve.block_manager import EVICTED, KVCacheManager
    from serve.request import Request
    from serve.scheduler import Scheduler, next_plan

    sched = Scheduler(config, KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching))
    requests = [Request(i, prompt, new, at) for i, (prompt, new, at) in enumerate(reqs)]
    for r in requests:
        sched.add(r)
    most, index = 0, 0
    while sched.has_work():
        plan, index = next_plan(sched, index)
        if plan is None:
            break
        most = max([most] + [sum(b != EVICTED for b in c.blocks) for c in plan.scheduled])  # as the step runs
        sched.update_from_output(plan, {c.request: 5 for c in plan.scheduled if c.sample})
        sched.blocks.check()
        index += 1
    return most, requests


def test_a_prefix_hit_larger_than_eviction_holds_is_computed_again():
    """A request whose prompt is cached whole, in more blocks than eviction lets it hold, would wait for blocks that
    nothing gives back: it is computed again instead, and both requests finish."""
    config = EngineConfig(block_size=4, long_prefill_token_threshold=8, max_num_batched_tokens=16, max_num_seqs=4,
                          kv_eviction={"policy": "streaming", "sink_tokens": 0, "window_tokens": 8})
    prompt = list(range(1, 49))
    _, requests = drive_host_only(config, 12, [(prompt, 1, 0), (prompt + list(range(60, 70)), 4, 20)])
    assert all(r.finished for r in requests) and requests[1].prefix_hit == 0


@pytest.mark.parametrize("eviction", [{"policy": "streaming", "sink_tokens": 3, "window_tokens": 9},
                                      {"policy": "h2o", "budget_tokens": 15, "recent_tokens": 7}],
                         ids=["streaming", "h2o"])
def test_no_request_holds_more_than_peak_blocks_and_the_smallest_pool_finishes(eviction):
    """peak_blocks is the bound admission relies on: over random workloads at the smallest pool it admits (a request
    alone at its peak), no request ever holds more, and every workload finishes (nothing waits forever)."""
    rng = random.Random(0)
    for trial in range(40):
        config = EngineConfig(block_size=4, long_prefill_token_threshold=rng.randint(1, 12),
                              max_num_batched_tokens=16, max_num_seqs=rng.randint(1, 4), kv_eviction=eviction,
                              scheduling_policy=rng.choice(["fcfs", "priority"]))
        reqs = [([rng.randrange(1, 9) for _ in range(rng.randint(1, 60))], rng.randint(1, 12), rng.randint(0, 6))
                for _ in range(rng.randint(1, 6))]
        most, requests = drive_host_only(config, config.peak_blocks(), reqs)
        assert most <= config.peak_blocks() and all(r.finished for r in requests), (trial, most)


def test_llm_checks_h2o_against_its_log_and_refuses_what_is_not_built():
    """LLM(check=True) under h2o at p = 2: each request's oracle replays the engine's log of what went when
    (layers/attention/eviction.logged_reference), and every token matches; unbuilt combinations are refused before any
    rank starts."""
    from serve import LLM

    prompts = [[random.Random(i).randrange(1, 1000) for _ in range(30 + 7 * i)] for i in range(3)]
    with LLM("llama_tiny", tensor_parallel_size=2, dtype="float64", check=True, block_size=4,
             long_prefill_token_threshold=8, kv_eviction=H2O) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        assert [o.oracle["verdict"] for o in outs] == ["match"] * 3
        assert llm.stats()["kv_evicted_blocks"] > 0
    for kwargs, words in ((dict(pipeline_parallel_size=2), "with pipeline stages"),
                          (dict(context_parallel_size=2), "context_parallel_size=2 with kv_eviction")):
        with pytest.raises(ValueError, match=words):
            LLM("llama_tiny", kv_eviction=STREAMING | {"window_tokens": 16}, **kwargs)
