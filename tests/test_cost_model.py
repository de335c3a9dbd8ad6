"""The cost formulas against values worked out by hand (seeds/06 §2-§6)."""

import subprocess
import sys
from pathlib import Path

import pytest

from tp.cost_model import H100, LLAMA2_7B, Shape, crossover_context_x_batch, decode_intensity, intensity, \
    kv_transfer_time, prefill_intensity, roofline_time

ROOT = Path(__file__).resolve().parent.parent


def test_kv_bytes_per_token_of_llama2_7b():
    assert LLAMA2_7B.kv_bytes_per_token == 2 * 32 * 32 * 128 * 2 == 524_288


def test_crossover_and_ridge():
    assert crossover_context_x_batch(LLAMA2_7B) == pytest.approx(14e9 / 524_288)  # ≈ 26.7k
    assert round(crossover_context_x_batch(LLAMA2_7B)) == 26_703
    assert H100.ridge == pytest.approx(149.25, abs=0.01)


def test_decode_and_prefill_by_hand():
    # decode, B = 32, L = 1024: 2Π·B / (2Π + K_tok·L·B) = 448e9 / (14e9 + 524288·1024·32)
    assert decode_intensity(LLAMA2_7B, 32, 1024) == pytest.approx(448e9 / (14e9 + 17_179_869_184))
    # prefill, C = 2048, S = 4096: 2Π·C / (2Π + K_tok·S)
    assert prefill_intensity(LLAMA2_7B, 2048, 4096) == pytest.approx(14e9 * 2048 / (14e9 + 2_147_483_648))
    # with no context at all, intensity is the number of tokens: decode ~ B, prefill ~ C
    assert intensity(LLAMA2_7B, 32, 0, 32) == pytest.approx(32)


def test_long_context_decode_does_not_improve_with_batch():
    # I ≈ 2Π / (K_tok·L) once the KV term dominates: B cancels
    a, b = decode_intensity(LLAMA2_7B, 32, 1_000_000), decode_intensity(LLAMA2_7B, 128, 1_000_000)
    assert b / a == pytest.approx(1.0, rel=0.01)


def test_roofline_and_transfer():
    assert roofline_time(500e12, 1.0, H100) == pytest.approx(1.0)  # compute-bound
    assert roofline_time(1.0, 3.35e12, H100) == pytest.approx(1.0)  # bandwidth-bound
    assert kv_transfer_time(LLAMA2_7B, 4096, 50e9) == pytest.approx(4096 * 524_288 / 50e9)
    tiny = Shape("tiny", 1e6, 2, 4, 8, bytes_per_elem=4)
    assert tiny.kv_bytes_per_token == 2 * 2 * 4 * 8 * 4 and tiny.weight_bytes == 4e6


def test_cost_tables_script_prints_every_table():
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "cost_tables.py")], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    for title in ("decode, B = 32", "prefill, C = 2048", "KV transfer of a 4k prompt", "GQA h_kv=8"):
        assert title in proc.stdout
    assert "K_tok = 524,288 B" in proc.stdout and "26,703" in proc.stdout


def test_block_flops_match_torch_flop_counter():
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from layers.models.config import ARTICLE03
    from layers.models.dense import DenseBlock
    from tp.cost_model import block_flops

    cfg, n = ARTICLE03, 40
    # The math SDPA backend computes the full [n, n] square with matmuls the counter sees.
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        DenseBlock(cfg)(torch.randn(n, cfg.d_model))
    linear, attention = block_flops(cfg.d_model, cfg.k, cfg.d_ffn, n, pairs=n * n)
    assert counter.get_total_flops() == linear + attention
    assert attention == 4 * n * n * cfg.k and linear == 2 * n * 3_145_728


def test_iteration_table_by_hand():
    from tp.cost_model import attention_flops_per_pair, iteration

    assert attention_flops_per_pair(LLAMA2_7B) == 4 * 128 * 32 * 32  # ≈ 0.52 MFLOP per pair
    it = iteration(LLAMA2_7B, [1024] * 8, 100_000)
    assert it.linear_flops == 2 * 7e9 * 100_008
    assert it.attention_flops == 524_288 * (8 * 1024 + 100_000 ** 2 / 2)
    assert it.time(H100) == pytest.approx(it.flops / 500e12)  # compute-bound: ~8 s
    assert iteration(LLAMA2_7B, [1024] * 8).time(H100) == pytest.approx((14e9 + 8 * 1024 * 524_288) / 3.35e12)


def _ledger_bytes(ctx, n):
    import torch

    from layers.models.tp_block import shard_stack
    from tests.common import ARTICLE03, dense_and_input
    from tp.ledger import TrafficLedger

    dense, x = dense_and_input(ARTICLE03, torch.float32, n)
    stack = shard_stack(dense, "v2", ctx.group)
    ledger = TrafficLedger(ctx.world_size)
    with torch.no_grad(), ledger.attach(stack):
        stack(x)
    return [sum(r.bytes_per_rank for r in ledger.records if r.layer == i) for i in range(ARTICLE03.n_layers)]


@pytest.mark.parametrize("p", [2, 4])
def test_tp_allreduce_volume_equals_the_ledger(p):
    from tests.harness import run_ranks
    from tp.cost_model import tp_allreduce_elems_per_gpu

    n = 40
    measured = run_ranks(p, _ledger_bytes, n)[0]
    assert measured == [2 * tp_allreduce_elems_per_gpu(n, 512, p) * 4] * 8  # 2 all-reduces/layer, float32


def test_presets_and_shapes():
    from layers.models.config import ModelConfig
    from tp.cost_model import A100, H200, regime, shape_of

    assert H200.ridge == pytest.approx(989e12 / 4.8e12) and A100.ridge == pytest.approx(312e12 / 2.039e12)
    assert regime(2000, H100) == "compute-bound" and regime(15, H100) == "bandwidth-bound"
    gpt2 = shape_of(ModelConfig(d_model=768, n_heads=12, d_head=64, d_ffn=3072, n_layers=12))
    assert gpt2.n_params == 12 * 7_087_872  # GPT-2 small's blocks (124M with embeddings)
    assert gpt2.kv_bytes_per_token == 2 * 12 * 12 * 64 * 2


def _serving_counts(ctx, family):
    """One engine-shaped iteration on this rank, counted by FlopCounterMode: a decode and a chunk after a prefix."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from layers.models.dense import init_weights
    from layers.models.llama import LlamaConfig
    from layers.models.lm import dense_lm, shard_lm
    from serve.model_runner import prepare_step
    from serve.kv_cache import KVPool, kv_bytes_per_token
    from serve.plan import ScheduledRequest, SchedulerOutput
    from tests.test_serve import CFG
    from tp.cost_model import serving_iteration

    cfg = CFG if family == "gpt2" else LlamaConfig(d_model=64, n_heads=8, n_kv_heads=2, d_head=8, d_ffn=96,
                                                   n_layers=3, max_seq_len=96, vocab_size=CFG.vocab_size)
    lm = shard_lm(init_weights(dense_lm(cfg), seed=0), "v2", ctx.group)
    p, heads = ctx.world_size, lm.cache_heads
    chunks = [(20, 21), (8, 13)]  # request 0 decodes its 21st token; request 1 prefills rows 8..12 after 8 cached
    pool = KVPool(cfg.n_layers, 3, 16, heads, cfg.d_head, torch.float32)
    plan = SchedulerOutput(0, (ScheduledRequest(0, 20, 21, decode=True, sample=True, blocks=(0, 1)),
                             ScheduledRequest(1, 8, 13, decode=False, sample=True, blocks=(2,))))
    # The reference and cpu backends: each request's own q_rows x kv_length rectangle, as the cost model counts it
    # (the batched form pads each group to its longest request). The math backend computes SDPA with matmuls the
    # counter sees: the whole q_rows x kv_length rectangle.
    counted = []
    for attention in ("reference", "cpu"):
        step = prepare_step(plan, {0: list(range(21)), 1: list(range(13))}, 16, "cpu", attention)
        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            lm.step(step.ids, step.positions, pool.layers(step.batch), step.sample_rows)
        counted.append(counter.get_total_flops())
    model = serving_iteration(cfg, p, chunks, 2, 4)
    names = ("qkv", "attn_out", "mlp_up", "mlp_down") if family == "gpt2" else ("qkv", "o", "gate_up", "down")
    matmul_weights = sum(getattr(b, name).weight.numel() for b in lm.stack.blocks for name in names)
    head = lm.embed if family == "gpt2" else lm.head  # GPT-2's head is its embedding; Llama's is separate
    held = (matmul_weights + head.weight.numel()) * 4 + sum(e for _, e in chunks) * kv_bytes_per_token(
        cfg.n_layers, heads, cfg.d_head, torch.float32)
    return counted, model.flops, held, model.bytes_loaded


@pytest.mark.parametrize("family,p", [("gpt2", 1), ("gpt2", 2), ("llama", 1), ("llama", 2), ("llama", 4)])
def test_serving_iteration_matches_the_flop_counter_and_the_rank_s_weights(family, p):
    """Llama at p = 4 > h_kv = 2: each rank holds (and multiplies by) a replicated K,V head."""
    from tests.harness import run_ranks

    for counted, modelled, held, loaded in run_ranks(p, _serving_counts, family):
        assert counted == [modelled] * 2  # linears, the head on the sampled rows, attention over every visible key:
        # the reference backend and the cpu backend alike (nothing padded)
        assert held == loaded  # the matmul weights and head slice this rank holds, and its K,V over each context


def test_serving_iteration_by_hand():
    from layers.models.config import ARTICLE03
    from tp.cost_model import serving_iteration

    # a fresh 100-token prompt, sampled at its end, at p=2: the causal triangle, the head padded to V' = 50258
    it = serving_iteration(ARTICLE03, 2, [(0, 100)], 1, 4)
    assert it.linear_flops == 2 * 100 * 8 * 3_145_728 / 2 + 2 * 50258 / 2 * 512
    assert it.attention_flops == 4 * 256 * 8 * 5050
    assert serving_iteration(ARTICLE03, 2, [(0, 100)], 0, 4).linear_flops == 2 * 100 * 8 * 3_145_728 / 2
    assert serving_iteration(ARTICLE03, 2, [(0, 100)], 1, 4, vocab_parallel=False).linear_flops == \
        2 * 100 * 8 * 3_145_728 / 2 + 2 * 50257 * 512


def test_the_handover_formulas_equal_a_simulated_two_stage_pipeline():
    """P/D's layer-by-layer hand-over as a two-stage pipeline simulated event by event (layer i's transfer starts
    when its compute and the previous transfer are done), against handover's closed form; whole-request is the
    sum; reload_or_recompute from K_tok and the roofline written out here."""
    from tp.cost_model import H100, KV_LINKS, LLAMA2_7B, LLAMA3_70B, handover, reload_or_recompute

    for s in (LLAMA2_7B, LLAMA3_70B):
        for tokens in (512, 4096, 32768):
            for bw, _ in KV_LINKS.values():
                h = handover(s, tokens, bw, H100)
                c, t = h["prefill_s"] / s.n_layers, h["transfer_s"] / s.n_layers
                computed = sent = 0.0
                for _ in range(s.n_layers):
                    computed += c
                    sent = max(sent, computed) + t
                assert abs(sent - h["layerwise_s"]) < 1e-9 * sent
                assert abs(h["whole_s"] - (h["prefill_s"] + h["transfer_s"])) < 1e-12
                assert h["hidden"] == (sent - h["prefill_s"] <= t + 1e-12)  # at most one layer's transfer shows
                r = reload_or_recompute(s, tokens, bw, H100)
                kv = tokens * s.n_layers * 2 * s.n_kv_heads * s.d_head * s.bytes_per_elem
                flops = 2 * s.n_params * tokens + 4 * s.d_head * s.query_heads * s.n_layers * tokens * tokens / 2
                recompute = max(flops / H100.flops, (s.bytes_per_elem * s.n_params + kv) / H100.hbm)
                assert abs(r["load_s"] - kv / bw) < 1e-12 and abs(r["recompute_s"] - recompute) < 1e-12
                assert r["load_wins"] == (kv / bw < recompute)
    # the table's message: a 4k prefix of Llama-2-7B is not worth reading back from an NVMe drive, Llama-3-70B's is
    nvme = KV_LINKS["NVMe SSD, PCIe 4.0 x4"][0]
    assert not reload_or_recompute(LLAMA2_7B, 4096, nvme, H100)["load_wins"]
    assert reload_or_recompute(LLAMA3_70B, 4096, nvme, H100)["load_wins"]
