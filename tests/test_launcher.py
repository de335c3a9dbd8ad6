"""The launcher end to end under torchrun, and every bad setting failing fast on every rank."""

import json
import subprocess
import sys
import time

import pytest
import torch

from tests.launching import ROOT, launch_on_pool, refused, settings_phase, torchrun


def test_two_ranks_end_to_end(tmp_path):
    # (profile=true's trace against the ledger: tests/test_traffic.py, on the rank pool)
    proc, _ = torchrun(2, "n_tokens=12", "repeats=1", "model.n_layers=2", run_dir=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert out.count("tpref: tensor-parallel block check") == 1  # rank 0 prints, rank 1 does not
    report = json.loads((tmp_path / "report.json").read_text())
    v1, v2 = report["variants"]["v1"]["totals"], report["variants"]["v2"]["totals"]
    assert sum(v2["collectives"].values()) / sum(v1["collectives"].values()) == 1 / 2
    assert v2["bytes_per_rank"] / v1["bytes_per_rank"] == pytest.approx(4 / 7)  # k = d, ffn = 4d
    assert report["world_size"] == 2 and report["equivalent"] is True and report["traffic_ok"] is True
    assert report["float32_matmul_precision"] == "highest"  # no TF32 in the checks
    assert report["config"]["n_tokens"] == 12 and report["config"]["model"]["d_model"] == 512
    # bytes each rank sends per layer at p=2, n=12, float32 (ring: all-reduce 2(p-1)/p·M·4, gather (p-1)/p·M·4)
    per_layer_bytes = {"v1": 12 * (512 + 512 + 2048 + 512) * 4 / 2, "v2": 2 * 12 * 512 * 4,
                       "intra_head": 2 * 12 * 512 * 4 + 8 * 12 * 12 * 4}
    for variant, kind, count in (("v1", "all_gather", 4), ("v2", "all_reduce", 2), ("intra_head", "all_reduce", 3)):
        res = report["variants"][variant]
        assert res["equivalent"] is True and res["ledger_matches_model"] is True
        assert len(res["layers"]) == 2
        for layer in res["layers"]:
            assert layer["collective_counts"] == {kind: count}  # CommDebugMode
            assert sum(c["count"] for c in layer["collectives"]) == count  # the ledger
            assert {c["kind"] for c in layer["collectives"]} == {kind}
            assert all(c["time_s"] > 0 and c["logical_bytes"] > 0 for c in layer["collectives"])
            assert layer["bytes_per_rank"] == per_layer_bytes[variant]
            assert sum(c["bytes_per_rank"] for c in layer["predicted"]) == per_layer_bytes[variant]
            assert layer["max_abs_err"] < 1e-4
    assert [row["heads"] for row in report["variants"]["v2"]["shards"]] == [[0, 3], [4, 7]]
    assert [row["head_dims"] for row in report["variants"]["intra_head"]["shards"]] == [[0, 31], [32, 63]]
    assert (tmp_path / ".hydra" / "config.yaml").exists()  # rank 0's record, written once
    assert "report: " in out and str(tmp_path / "report.json") in out


def test_requests_end_to_end(tmp_path):
    proc, _ = launch_on_pool(2, "requests=[3,9]", "variants=[v1,v2]", "repeats=1", run_dir=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "cu_seqlens [0, 3, 12]" in out
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["config"]["requests"] == [3, 9]
    assert report["attention_work"] == {"varlen": 90, "flat_masked": 144, "padded": 162}
    for variant in ("v1", "v2"):
        res = report["variants"][variant]
        assert [(r["request"], r["tokens"], r["equivalent"]) for r in res["requests"]] == [(0, 3, True), (1, 9, True)]
        assert res["forward_time_padded_s"] > 0
    assert all(layer["collective_counts"] == {"all_reduce": 2} for layer in report["variants"]["v2"]["layers"])


def test_bfloat16_end_to_end(tmp_path):
    proc, _ = launch_on_pool(2, "dtype=bfloat16", "variants=[v2]", "repeats=1", run_dir=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["config"]["dtype"] == "bfloat16" and report["config"]["tolerance"] == 5e-2
    assert report["equivalent"] is True and report["traffic_ok"] is True
    first = report["variants"]["v2"]["layers"][0]
    assert 0 < first["max_rel_err"] <= 3e-2  # v2's rounding: 1.3e-2 measured (docs/precision.md)
    assert first["collectives"][0]["logical_bytes"] == 40 * 512 * 2  # [10 + 30 tokens, d] of 2-byte elements


def test_failing_check_exits_non_zero(tmp_path):
    # An impossible tolerance turns rounding into a failure: the verdict must reach the exit code.
    proc, _ = launch_on_pool(2, "n_tokens=4", "variants=[v2]", "tolerance=1e-30", run_dir=tmp_path)
    assert proc.returncode != 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["equivalent"] is False and report["variants"]["v2"]["equivalent"] is False
    assert "FAIL: v2 at tp=2" in proc.stdout


BAD = [
    (3, [], "n_heads=8 heads cannot be split over p=3 ranks", "valid tensor-parallel sizes: 1, 2, 4, 8"),
    (2, ["model.d_ffn=2049"], "d_ffn=2049 is not divisible by p=2 ranks", "valid tensor-parallel sizes: 1"),
    (2, ["model.d_head=32"], "d_model=512 must equal n_heads*d_head=8*32=256", "model.d_head=64"),
    (2, ["variants=[v1,v3]"], "unknown variant 'v3'", "choose from v1, v2"),
    (2, ["backend=mpi"], "unknown backend 'mpi'", "auto, nccl, gloo"),
    (2, ["dtype=int8"], "unknown dtype 'int8'", "float32, float64, bfloat16, float16"),
    (2, ["repeats=0"], "repeats=0 must be at least 1", ""),
    (2, ["n_tokens=0"], "n_tokens=0 must be at least 1", ""),
    (2, ["requests=[10,0]"], "requests[1]=0: every request needs a whole number of tokens", "empty request"),
    (2, ["requests=[10,2000]"], "request 1 length=2000 exceeds model.max_seq_len=1024", ""),
    (2, ["n_tokens=12", "requests=[3,9]"], "give either n_tokens (one sequence) or requests", ""),
    (2, ["request_dist=zipf"], "unknown request_dist 'zipf'", "uniform or lognormal"),
    (4, ["n_tokens=3", "variants=[v2,v2sp]"], "variant v2sp splits the 3 tokens by rows over p=4 ranks and needs "
                                              "at least one per rank", "drop v2sp from variants"),
    (2, ["model.d_head=3", "model.d_model=24", "model.d_ffn=96", "variants=[intra_head]"],
     "variant intra_head splits every head's d_head=3 over p=2 ranks", "drop intra_head"),
    # a setting Hydra would add and the run would ignore: refused, in every spelling
    (2, ["+temperature=0.7"], "unknown setting 'temperature' (+temperature=0.7): run_block.py has no such setting",
     "conf/config.yaml"),
    (2, ["++model.n_expertz=4"], "unknown setting 'model.n_expertz'", ""),
    (2, ["model=article03", "+model.n_kv_heads=2"], "unknown setting 'model.n_kv_heads'", ""),  # a GPT-2 preset
    (2, ["+repeats=2"], "+repeats=2: repeats is a setting already; write repeats=2", ""),
]
if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    BAD.append((2, ["backend=nccl"], "backend=nccl needs one GPU per rank", "use backend=gloo"))
if not torch.cuda.is_available():
    BAD.append((2, ["device=cuda"], "device=cuda but no CUDA device is visible", "use device=auto or cpu"))


@pytest.mark.parametrize("nproc,overrides,message,advice", BAD, ids=[" ".join(b[1]) or f"nproc={b[0]}" for b in BAD])
def test_bad_settings_fail_before_any_collective(nproc, overrides, message, advice):
    """Every rank validates on its own, before joining the group: the last rank's settings phase (in process,
    tests/launching.py) prints one line and returns exit code 2 without waiting for anyone."""
    alone = refused(overrides, message, nproc, "run_block.py")
    assert advice in alone.stderr


def test_a_bad_setting_fails_fast_on_every_rank(tmp_path):
    """The whole job: every rank that gets to print says the same line, nothing is written, exit non-zero, fast."""
    nproc, overrides, message, advice = BAD[1]  # d_ffn=2049 on 2 ranks
    proc, elapsed = torchrun(nproc, *overrides, run_dir=tmp_path, timeout=120)
    assert proc.returncode != 0
    # torchrun stops the other ranks as soon as one exits, so a slower rank may be stopped before it
    # prints: at least one rank's message must be there, and each printed one must be the same.
    printed = [line for line in proc.stderr.splitlines() if "] error: " in line]
    assert printed and all(message in line for line in printed), proc.stderr
    assert advice in proc.stderr
    assert not (tmp_path / "report.json").exists()
    assert elapsed < 60, f"took {elapsed:.0f}s to fail"
    # the entry point as a lone rank's own process (exit code 2 at once): tests/test_serve_launcher.py, whose
    # launcher shares launch.settings.launch with this one


def test_settings_phase_joins_the_group_for_good_settings():
    """The in-process form can fail: settings that pass validation reach the point where a rank joins the group."""
    from tests.launching import JoinedTheGroup

    with pytest.raises(JoinedTheGroup):
        settings_phase(["n_tokens=4"], world=2, script="run_block.py")
    # ++ of a setting that exists is an ordinary override (the engine's defaults come from EngineConfig), and
    # Hydra's own settings pass
    with pytest.raises(JoinedTheGroup):
        settings_phase(["++block_size=8", "++pd.timeout_s=5", "+hydra.job.name=x"], world=2, script="serve.py")
    with pytest.raises(JoinedTheGroup):  # a key of the chosen preset
        settings_phase(["model=llama_tiny", "++model.n_kv_heads=4", "n_tokens=8"], world=2, script="run_block.py")


def test_gpu_check_skips_cleanly_without_gpus():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: make gpu-check runs for real here")
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "gpu_check.py")], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no CUDA device visible, nothing to check here; skipping" in proc.stdout
    summary = (ROOT / "outputs" / "gpu_check" / "summary.md").read_text()
    assert summary.startswith("# gpu-check: 0 CUDA device(s)") and "skipped: no CUDA device visible" in summary


def test_gpu_check_plans_every_valid_p():
    from launch.gpu_check import steps

    one = [name for name, *_ in steps(1)]
    assert one[:2] == ["run_block nccl p=1 float32", "run_block nccl p=1 bfloat16"]
    assert [n for n in one if "gloo+cuda" in n] == [f"run_block gloo+cuda p={p} bfloat16 (ranks share one GPU)"
                                                   for p in (2, 4, 8)]
    eight = [name for name, *_ in steps(8)]
    assert [n for n in eight if n.startswith("run_block nccl")] == [
        f"run_block nccl p={p} {dt}" for p in (1, 2, 4, 8) for dt in ("float32", "bfloat16")]
    assert "serve nccl p=8" in eight and "pytest -m nccl" in eight and "bench_tp" in eight
    assert "run_block llama_tiny nccl p=8" in eight and "serve llama_tiny nccl p=8" in eight
    assert "run_block llama_tiny p=4 bfloat16, ranks sharing one GPU (gloo, CUDA tensors)" in one
    assert "serve llama_tiny nccl p=1 bfloat16" in one and "serve llama_tiny nccl p=8 bfloat16" in eight
    assert "serve pd nccl 4+4" in eight and not [n for n in one if "pd" in n]
    assert "run_block mixtral_tiny nccl p=8" in eight and "serve mixtral_tiny nccl p=8 moe_parallel=ep" in eight
    saved = eight.index("save a sharded bfloat16 Llama checkpoint")
    assert eight[saved + 1] == "serve hf_checkpoint (sharded, per-rank slices) nccl p=8 bfloat16"
    from launch.gpu_check import skipped

    assert [name for name, _ in skipped(1)] == ["serve pd nccl"] and skipped(8) == []


def test_gpu_check_stops_a_step_past_its_limit():
    from launch.gpu_check import run_step

    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); " \
           "print('started', flush=True); time.sleep(60)"
    start = time.monotonic()
    # a limit of 5 s: a loaded 2-core machine can take a second or two to start a bare interpreter and print
    result = run_step("sleeper", [sys.executable, "-c", code], {}, 5)
    assert result["rc"] == "timeout" and not result["ok"] and time.monotonic() - start < 40
    assert "started" in "\n".join(result["lines"])
