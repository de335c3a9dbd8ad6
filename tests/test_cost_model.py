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
    for title in ("decode, B = 32", "prefill, C = 2048", "KV transfer of a 4k prompt"):
        assert title in proc.stdout
    assert "K_tok = 524,288 B" in proc.stdout and "26,703" in proc.stdout
