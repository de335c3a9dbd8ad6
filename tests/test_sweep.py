"""The sweep and the DTensor benchmark, end to end on small grids."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from layers.models.config import ALL_VARIANTS

ROOT = Path(__file__).resolve().parent.parent


def test_sweep_measures_what_the_model_predicts(tmp_path):
    cmd = [sys.executable, str(ROOT / "launch" / "traffic_sweep.py"), "--p", "2", "--tokens", "4", "32",
           "--repeats", "0", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((tmp_path / "sweep.json").read_text())
    rows = data["measured"]
    assert {(r["n"], r["variant"]) for r in rows} == {(n, v) for n in (4, 32) for v in ALL_VARIANTS}
    for r in rows:
        assert r["measured_bytes_per_rank"] == r["model_bytes_per_rank"] > 0
    by = {(r["n"], r["variant"]): r["measured_bytes_per_rank"] for r in rows}
    assert by[(32, "v2")] / by[(32, "v1")] == 4 / 7
    assert by[(32, "v2sp")] == by[(32, "v2")] and by[(4, "v2sp")] == by[(4, "v2")]  # the same bytes, p | n
    # the scores all-reduce: intra_head - v2 grows 64x when n grows 8x
    assert (by[(32, "intra_head")] - by[(32, "v2")]) == 64 * (by[(4, "intra_head")] - by[(4, "v2")])
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "sweep.png").stat().st_size > 10_000


def test_sweep_rejects_a_bad_p(tmp_path):
    cmd = [sys.executable, str(ROOT / "launch" / "traffic_sweep.py"), "--p", "3", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "cannot be split over p=3 ranks" in proc.stderr


def test_dtensor_benchmark_agrees_with_dtensor():
    """bench_tp's measurement on the session's 2-rank pool (the script spawns fresh ranks for the same function)."""
    from benchmarks.bench_tp import measure
    from tests.harness import run_ranks

    (row,) = run_ranks(2, measure, [8], 1)[0]
    assert row["max_rel_diff_vs_dtensor"] < 1e-5  # DTensor's plan and ours compute the same thing
    assert row["sp_max_rel_diff_vs_dtensor"] < 1e-5  # and its sequence-parallel plan and our v2sp
    assert row["sp_collectives_ours"] == row["sp_collectives_dtensor"] == {"all_gather": 16, "reduce_scatter": 16}
    assert row["collectives_per_forward"] == 16  # 8 layers x 2 all-reduces, seen by the skipping ledger
    for key in ("ours_over_dtensor", "v1_over_v2", "distance_to_limit"):
        assert row[key] > 0
