"""KV cache quantization (layers/attention/kv_quant.py): fp8_e4m3, fp8_e5m2 and int8 codes with per-layer, per-K|V,
per-head scales in the paged pool.

Oracles: a float64 quantizer written here (the codes and the round trip); the dense model recomputed without a
cache with its K,V round-tripped through the same scales (kv_quant.pseudo_quantized: the pseudo-quantized
reference), against which the engine is exact to 1e-12 at p = 1, 2, 4 in every backend, with chunked prefill,
prefix hits and preemption; the first-prefill rule recomputed here layer by layer. The quantization error itself
(against the unquantized cache) is measured and bounded per dtype."""

import random

import pytest
import torch

import layers.attention.attention as attention_module
from layers.attention.kv_quant import HEADROOM, LARGEST, pseudo_quantized, quantize, round_trip, scales_from
from layers.models.config import ModelConfig
from layers.models.dense import init_weights
from layers.models.llama import LlamaConfig
from layers.models.lm import dense_lm, shard_lm
from serve.config import EngineConfig
from serve.engine import LLMEngine
from serve.kv_cache import KVPool, cache_layout_of
from serve.request import validate_prompt
from serve.sampling_params import SamplingParams
from tests.common import greedy_logprobs, named, serve_greedy, step_engine
from tests.harness import run_ranks
from tp.partition import kv_bytes_per_token, kv_head_range

GPT2 = ModelConfig(d_model=64, n_heads=4, d_head=16, d_ffn=128, n_layers=2, max_seq_len=96, vocab_size=257)
LLAMA = LlamaConfig(d_model=64, n_heads=8, n_kv_heads=2, d_head=8, d_ffn=96, n_layers=2, max_seq_len=96,
                    vocab_size=257)
SMALL = dict(long_prefill_token_threshold=5, max_num_batched_tokens=12, max_num_seqs=4, block_size=4,
             num_gpu_blocks_override=8)  # chunked prompts; a pool small enough that requests are preempted


def quantize64(x: torch.Tensor, scale: torch.Tensor, name: str) -> torch.Tensor:
    """The round trip written out in float64, scale broadcast over x [planes, h, T, d] by plane and head."""
    s = scale.to(torch.float64)[:, :, None, None]
    y = x.to(torch.float64) / s
    if name == "int8":
        return y.round().clamp(-127, 127) * s
    dtype = torch.float8_e4m3fn if name == "fp8_e4m3" else torch.float8_e5m2
    return y.clamp(-LARGEST[name], LARGEST[name]).to(dtype).to(torch.float64) * s


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2", "int8"])
def test_the_round_trip_is_the_float64_quantizers_and_bounded(name):
    torch.manual_seed(0)
    kv = torch.randn(2, 3, 50, 16, dtype=torch.float64) * torch.tensor([1.0, 20.0, 0.01])[None, :, None, None]
    scale = scales_from(kv, name)
    amax = kv.abs().amax(dim=(-2, -1))
    assert torch.allclose(scale.double(), amax * HEADROOM / LARGEST[name], rtol=1e-6)  # float32 scales
    got = round_trip(kv, scale, name)
    assert torch.equal(got, quantize64(kv, scale, name))
    err = (got - kv).abs()
    s = scale.double()[:, :, None, None]
    if name == "int8":
        assert (err <= s / 2 + 1e-15).all()  # half a step, everywhere below the clip
    else:  # fp8: a relative half ulp of its mantissa (3 bits e4m3, 2 bits e5m2) for normal values
        mantissa = 3 if name == "fp8_e4m3" else 2
        normal = kv.abs() / s >= (2.0 ** -6 if name == "fp8_e4m3" else 2.0 ** -14)
        assert (err[normal] <= kv.abs()[normal] * 2.0 ** -(mantissa + 1) + 1e-15).all()
    # codes round-trip: quantizing what the cache gave back gives the same codes
    rows = kv.transpose(1, 2)
    codes = quantize(rows, scale, name)
    assert torch.equal(quantize(got.transpose(1, 2), scale, name), codes)
    # beyond the headroom a value is clipped to the largest code, never wrapped
    wide = kv * 4
    assert (round_trip(wide, scale, name).abs() <= LARGEST[name] * s * (1 + 1e-6)).all()


def test_one_scale_per_head_keeps_a_small_head_whose_neighbour_dwarfs_it():
    """Head 0's values reach 1000, head 1's 1: with its own scale head 1 keeps int8's resolution (error within
    1/127 of its range); with one scale for the layer (head 0's) every value of head 1 rounds to 0."""
    torch.manual_seed(1)
    kv = torch.randn(2, 2, 64, 8, dtype=torch.float64)
    kv[:, 0] *= 1000 / kv[:, 0].abs().max()
    kv[:, 1] /= kv[:, 1].abs().max()
    per_head = scales_from(kv, "int8")
    assert per_head[0, 0] / per_head[0, 1] > 500
    small = (round_trip(kv, per_head, "int8")[:, 1] - kv[:, 1]).abs().max()
    assert small <= HEADROOM / 127 / 2 + 1e-12
    shared = per_head.amax(dim=1, keepdim=True).expand_as(per_head).contiguous()
    crushed = round_trip(kv, shared, "int8")[:, 1]
    assert (crushed == 0).all()


# ---- the engine against the pseudo-quantized reference ---------------------------------------------------------


def workload(seed: int) -> list[tuple[list[int], int, int]]:
    """(prompt, max_tokens, step it arrives): request 0 alone in the first step (its first chunk sets the scales);
    two requests share a 9-token prefix with it (prefix hits), one repeats it whole."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    first = torch.randint(0, 257, (14,), generator=gen).tolist()
    reqs = [(first, 6, 0), (first[:9] + [7, 8, 9], 5, 3), (list(first), 4, 5)]
    for i in range(3):
        reqs.append((torch.randint(0, 257, (rng.randint(3, 18),), generator=gen).tolist(), rng.randint(2, 7),
                     2 + 2 * i))
    return reqs


def serve(ctx, cfg, reqs, config):
    """Every rank steps its LLMEngine; rank 0 adds each request at its step. Returns (rank 0's outputs: id -> (tokens,
    chosen logprobs, finish reason), preemptions), and each rank's scales with its layers and K,V heads."""
    dense = init_weights(dense_lm(cfg, torch.float64), seed=0, std=0.1)
    engine = LLMEngine(shard_lm(dense, "v2", ctx.group), ctx, config)
    quant = engine.runner.cache.quant
    heads = kv_head_range(cfg.n_kv_heads, ctx.rank, ctx.world_size)
    done = serve_greedy(engine, named(reqs))
    if not ctx.is_main:
        return None, (quant.scales.clone(), heads, list(quant.scaled))
    stats = engine.stats()
    engine.shutdown()
    return (done, stats["preemptions"], stats["prefix_hit_tokens"]), (quant.scales.clone(), heads, list(quant.scaled))


def first_prefill_scales(dense, prompt: list[int], name: str) -> torch.Tensor:
    """The rule, recomputed: a forward of the first step's rows (request 0's first chunk), each layer's scales
    taken from its own K,V, which it then attends to round-tripped (so the next layer's K,V are what the engine's
    are)."""
    found = []

    def calibrate(kv):
        scale = scales_from(kv, name)
        found.append(scale)
        return round_trip(kv, scale, name)

    saved = attention_module.reference_round_trip
    attention_module.reference_round_trip = calibrate
    try:
        dense.logits(torch.tensor(prompt))
    finally:
        attention_module.reference_round_trip = saved
    return torch.stack(found)


def reference(dense, prompt: list[int], n: int, scales, name: str) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs, recomputed with no cache, K,V round-tripped through the scales."""
    with pseudo_quantized(scales, name):
        return greedy_logprobs(dense, prompt, n)


@pytest.mark.parametrize("cfg,p,attention,name", [(GPT2, 1, "reference", "int8"), (LLAMA, 2, "cpu", "fp8_e4m3"),
                                                  (LLAMA, 2, "batched", "fp8_e5m2"), (LLAMA, 4, "batched", "int8"),
                                                  (GPT2, 4, "cpu", "fp8_e4m3")],
                         ids=["gpt2-p1-reference-int8", "llama-p2-cpu-e4m3", "llama-p2-batched-e5m2",
                              "llama-replicated-kv-p4-batched-int8", "gpt2-p4-cpu-e4m3"])
def test_the_engine_equals_the_pseudo_quantized_reference(cfg, p, attention, name):
    reqs = workload(seed=p)
    # calculated scales (off by default, as in vLLM): what the pseudo-quantized reference applies
    config = EngineConfig(**SMALL, attention=attention, kv_cache_dtype=name, calculate_kv_scales=True)
    results = run_ranks(p, serve, cfg, reqs, config)
    (done, preemptions, hits), _ = results[0]
    dense = init_weights(dense_lm(cfg, torch.float64), seed=0, std=0.1)
    # the scales: the first prefill's rule on every rank, each rank its own heads
    want = first_prefill_scales(dense, reqs[0][0][:SMALL["long_prefill_token_threshold"]], name)  # [L, 2, h_kv]
    scales = torch.full_like(want, float("nan"))
    for _, (part, heads, scaled) in results:
        assert all(scaled)
        scales[:, :, heads.start:heads.stop] = part
    assert torch.allclose(scales, want, rtol=1e-6, atol=0)
    # every request's tokens and logprobs: the dense model with round-tripped K,V, to 1e-12
    for i, (prompt, new, _) in enumerate(reqs):
        ids, lps = reference(dense, prompt, new, scales, name)
        got_ids, got_lps, reason = done[f"r{i}"]
        assert got_ids == ids and reason == "length", (i, got_ids, ids)
        assert max(abs(a - b) for a, b in zip(got_lps, lps)) < 1e-12
    assert hits > 0 and preemptions > 0  # prefix hits and preemption took place (and changed nothing)


def test_the_reference_rounds_the_cache_for_real():
    """The check above can fail: the unquantized dense model's logprobs differ from the engine's by far more than
    1e-12 (the round trip is not a no-op on these weights)."""
    dense = init_weights(dense_lm(LLAMA, torch.float64), seed=0, std=0.1)
    prompt = workload(seed=2)[0][0]
    scales = first_prefill_scales(dense, prompt[:5], "fp8_e4m3")
    _, quantized = reference(dense, prompt, 6, scales, "fp8_e4m3")
    with torch.no_grad():
        logp = torch.log_softmax(dense.logits(torch.tensor(prompt))[-1], dim=-1)
    assert abs(float(logp.max()) - quantized[0]) > 1e-6


# ---- the pool: bytes per token, blocks at a fixed memory ----------------------------------------------------------


def pools(ctx):
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        lm = shard_lm(init_weights(dense_lm(LLAMA, dtype), seed=0), "v2", ctx.group)
        assert cache_layout_of(LLAMA, ctx.world_size) == lm.cache_layout  # what the driver sizes with
        for name in ("auto", "fp8_e4m3", "fp8_e5m2", "int8"):
            engine = LLMEngine(lm, ctx, EngineConfig(kv_cache_dtype=name, kv_cache_memory_bytes=1 << 16,
                                                     block_size=4, calculate_kv_scales=name == "int8"))
            pool = engine.runner.cache
            out[(str(dtype), name)] = (engine.num_blocks, pool.measured_bytes_per_token(), pool.bytes,
                                       pool.scale_bytes, str(pool.kv.dtype))
            engine.shutdown()
    return out


def test_the_pool_holds_the_formulas_bytes_and_twice_the_blocks_of_bfloat16():
    got = run_ranks(2, pools)[0]
    heads = LLAMA.n_kv_heads // 2
    for (dtype, name), (blocks, per_token, total, scale_bytes, stored) in got.items():
        e = {"torch.float32": 4, "torch.bfloat16": 2}[dtype] if name == "auto" else 1
        assert per_token == kv_bytes_per_token(LLAMA.n_layers, heads, LLAMA.d_head, e)
        assert blocks == (1 << 16) // (per_token * 4) and total <= 1 << 16
        assert scale_bytes == (0 if name == "auto" else LLAMA.n_layers * 2 * heads * 4)
        assert stored == {"auto": dtype, "int8": "torch.int8"}.get(name, "torch.uint8")
    for name in ("fp8_e4m3", "fp8_e5m2", "int8"):
        assert got[("torch.bfloat16", name)][0] == 2 * got[("torch.bfloat16", "auto")][0]
        assert got[("torch.float32", name)][0] == 4 * got[("torch.float32", "auto")][0]


def test_vllm_names_and_defaults():
    """vLLM's "fp8" is fp8_e4m3; scales are not calculated unless asked (vLLM's default), and the CLI's flag says so."""
    import argparse

    from serve.config import add_engine_flags, engine_from_flags

    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"
    assert EngineConfig().calculate_kv_scales is False
    ap = argparse.ArgumentParser()
    add_engine_flags(ap)
    config = engine_from_flags(ap.parse_args(["--kv-cache-dtype", "fp8"]))
    assert (config.kv_cache_dtype, config.calculate_kv_scales) == ("fp8_e4m3", False)
    assert engine_from_flags(ap.parse_args(["--kv-cache-dtype", "int8", "--calculate-kv-scales"])).calculate_kv_scales


def test_bad_settings_are_refused_in_one_line():
    for kwargs, message in ((dict(kv_cache_dtype="fp4"), "kv_cache_dtype='fp4': choose auto, fp8_e4m3"),
                            (dict(kv_cache_dtype="int8"), "needs calculate_kv_scales=True"),  # off by default, as vLLM
                            (dict(kv_cache_memory_bytes=0), "kv_cache_memory_bytes=0 must be"),
                            (dict(kv_cache_memory_bytes=10, num_gpu_blocks_override=4), "give one")):
        with pytest.raises(ValueError, match=message):
            EngineConfig(**kwargs)
    with pytest.raises(ValueError, match="holds no block"):
        EngineConfig(kv_cache_memory_bytes=10).pool_blocks(96, None, 4096)
    with pytest.raises(ValueError, match="more than the 2 that kv_cache_memory_bytes holds; raise "
                                         "kv_cache_memory_bytes to at least 12288"):  # 3 blocks of 4096 bytes
        validate_prompt([1] * 9, 3, 257, 96, 2, 4, None, 4096)
    pool = KVPool(2, 4, 4, 2, 8, torch.float32, cache_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="scales of shape"):
        pool.quant.set_scales(torch.ones(2, 2, 3))


# ---- the error the cache adds, measured against the unquantized cache ------------------------------------------

# Measured on this workload: max |logprob error| 0.090 (fp8_e4m3), 0.210 (fp8_e5m2), 0.065 (int8); greedy tokens
# before a request's first difference 62.5%, 37.5%, 83.3% (random weights: their top logits are close, so a small
# error flips a pick). The bounds leave a margin of about 3x on the error and 2x on the agreement.
ERROR_BOUNDS = {"fp8_e4m3": (0.3, 0.3), "fp8_e5m2": (0.6, 0.18), "int8": (0.2, 0.4)}


def errors(ctx, prompts):
    """Each cache dtype's greedy tokens and chosen-token logprobs on a float32 Llama (p = 1), all requests at once."""
    dense = init_weights(dense_lm(LLAMA, torch.float32), seed=3, std=0.1)
    lm = shard_lm(dense, "v2", ctx.group)
    out = {}
    for name in ("auto", "fp8_e4m3", "fp8_e5m2", "int8"):
        engine = LLMEngine(lm, ctx, EngineConfig(kv_cache_dtype=name, calculate_kv_scales=True))  # off by default
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=12, logprobs=0))
        done = {}

        def sink(outputs, step):
            done.update({o.request_id: (o.outputs[0].token_ids, [s[t] for s, t in zip(o.outputs[0].logprobs,
                                                                                       o.outputs[0].token_ids)])
                         for o in outputs if o.finished})

        step_engine(engine, sink=sink)
        out[name] = [done[f"r{i}"] for i in range(len(prompts))]
    return out


def test_the_error_against_the_unquantized_cache_is_measured_and_bounded():
    """Each dtype's largest |logprob error| of the chosen tokens (up to and at a request's first difference, where
    both runs saw the same tokens) and the share of greedy tokens before that difference, against auto."""
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 257, (n,), generator=gen).tolist() for n in (6, 11, 17, 23, 30, 38, 45, 52)]
    runs = run_ranks(1, errors, prompts)[0]
    measured = {}
    for name in ("fp8_e4m3", "fp8_e5m2", "int8"):
        worst, before, total = 0.0, 0, 0
        for (ids, lps), (qids, qlps) in zip(runs["auto"], runs[name]):
            n = next((i for i, (a, b) in enumerate(zip(ids, qids)) if a != b), len(ids))
            before, total = before + n, total + len(ids)
            worst = max([worst] + [abs(a - b) for a, b in zip(lps[:n + 1], qlps[:n + 1])])
        most, least = ERROR_BOUNDS[name]
        assert 1e-4 < worst <= most and before / total >= least, (name, worst, before / total)
        measured[name] = worst
    assert measured["fp8_e5m2"] > measured["fp8_e4m3"]  # two mantissa bits against three
