"""KV eviction (serve/eviction.py, layers/attention/eviction.py): StreamingLLM's sinks + window in the paged engine.

Oracle: the dense model recomputed with no cache, its attention masked by the rule written here on its own (query i
reads key j iff j <= i and (j < sink or i - j < window)). The engine, with blocks freed as the window slides, equals
it to 1e-12 in float64 at p = 1 and 2, in every backend, with chunked prefill, prefix hits and preemption in the run:
greedy tokens, their logprobs and the prompt's logprobs. A window that covers every sequence changes nothing, token
for token and bit for bit; the masked reference does differ from plain attention (the check can fail)."""

import random

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
from tests.common import step_engine
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
    with the first (prefix hits)."""
    rng = random.Random(seed)
    first = [rng.randrange(257) for _ in range(30)]
    reqs = [(first, 8, 0, True), (first[:24] + [7, 8, 9], 6, 3, False), (list(first), 5, 6, False)]
    for i in range(3):
        reqs.append(([rng.randrange(257) for _ in range(rng.randint(4, 34))], rng.randint(3, 9), 1 + 2 * i, i == 1))
    return reqs


def serve(ctx, cfg, reqs, config):
    """Every rank steps its LLMEngine; rank 0 adds each request at its step. Rank 0 returns (id -> (tokens, their
    logprobs, prompt logprobs of the prompt's tokens or None), stats)."""
    dense = init_weights(dense_lm(cfg, torch.float64), seed=0, std=0.1)
    engine = LLMEngine(shard_lm(dense, "v2", ctx.group), ctx, config)
    done = {}

    def before(engine, step):
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
    return done, stats


def streaming_mask(n: int, device=None) -> torch.Tensor:
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    return (j <= i) & ((j < SINK) | (i - j < WINDOW))


def reference(dense, prompt: list[int], n: int, masked: bool = True):
    """Greedy tokens, their logprobs and the prompt's, recomputed with no cache under the streaming mask."""
    saved = attention_module.reference_mask
    if masked:
        attention_module.reference_mask = streaming_mask
    try:
        tokens, ids, lps = list(prompt), [], []
        with torch.no_grad():
            whole = torch.log_softmax(dense.logits(torch.tensor(prompt)), dim=-1)
            scored = [float(whole[i - 1, prompt[i]]) for i in range(1, len(prompt))]
            for _ in range(n):
                logp = torch.log_softmax(dense.logits(torch.tensor(tokens))[-1], dim=-1)
                t = int(logp.argmax())
                ids.append(t)
                lps.append(float(logp[t]))
                tokens.append(t)
    finally:
        attention_module.reference_mask = saved
    return ids, lps, scored


@pytest.mark.parametrize("cfg,p,attention", [(GPT2, 1, "reference"), (LLAMA, 2, "cpu"), (GPT2, 2, "batched")],
                         ids=["gpt2-p1-reference", "llama-p2-cpu", "gpt2-p2-batched"])
def test_the_engine_equals_the_masked_dense_reference(cfg, p, attention):
    reqs = workload(seed=p)
    done, stats = run_ranks(p, serve, cfg, reqs, EngineConfig(**SMALL, attention=attention, kv_eviction=STREAMING))[0]
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
    reqs = workload(seed=1)
    dense = init_weights(dense_lm(GPT2, torch.float64), seed=0, std=0.1)
    plain, masked = reference(dense, reqs[0][0], 4, masked=False), reference(dense, reqs[0][0], 4)
    assert max(abs(a - b) for a, b in zip(plain[2], masked[2])) > 1e-3
    wide = dict(STREAMING, window_tokens=96)
    (with_done, with_stats), = [r for r in run_ranks(1, serve, GPT2, reqs, EngineConfig(**SMALL, kv_eviction=wide))]
    without_done, _ = run_ranks(1, serve, GPT2, reqs, EngineConfig(**SMALL))[0]
    assert with_done == without_done and with_stats["kv_evicted_blocks"] == 0


@pytest.mark.parametrize("settings,words", [
    (dict(kv_eviction={"policy": "streaming", "window_tokens": 8}, block_size=16), "smaller than a block"),
    (dict(kv_eviction={"policy": "h2o", "window_tokens": 32}), "choose streaming"),
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
