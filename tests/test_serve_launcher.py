"""launch/serve.py under torchrun: the tables and report.json, a GPT-2 checkpoint, and bad settings failing fast."""

import json
import os
import subprocess
import sys

import pytest

from tests.launching import ROOT, launch_on_pool, lone_rank_process, refused, torchrun

SMALL = ["model.n_layers=2", "model.vocab_size=5003", "prompt_count=5", "prompt_mean=12", "max_new_tokens=5",
         "long_prefill_token_threshold=4", "max_num_batched_tokens=12", "arrivals=1", "dtype=float64"]


def test_serve_end_to_end(tmp_path):
    proc, _ = torchrun(2, *SMALL, run_dir=tmp_path, script="serve.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert out.count("tpref: serving on the TP stack") == 1  # rank 0 prints, rank 1 does not
    assert "per iteration" in out and "per request" in out
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["world_size"] == 2 and report["ledger_matches_model"] is True
    assert report["check"]["ok"] is True and report["check"]["verdicts"]["match"] == 5
    assert report["check"]["max_logit_rel_err"] < 1e-12
    assert report["kv_cache"]["ratio_to_dense"] == 0.5
    assert report["totals"]["generated_tokens"] == 25 and report["totals"]["mixed_iterations"] > 0
    for req in report["requests"]:
        assert len(req["output_ids"]) == 5 and req["output_ids"] == req["check"]["oracle_ids"]
        assert req["ttft_s"] > 0 and req["mean_tbt_s"] > 0
        # the request table shows what was generated: its first four ids
        assert " ".join(map(str, req["output_ids"][:4])) + " …" in out
    assert "; dtype=float64\n" in out  # given (no "auto: ..." beside it: tests/test_checkpoint.py checks auto)
    # attention: auto, resolved for the device (gloo on a CPU: the cpu backend), in the header and the report
    assert (report["config"]["attention"], report["config"]["engine"]["attention"]) == ("cpu", "auto")
    assert "attention=cpu (auto)" in out
    for it in report["iterations"]:
        assert it["rows"] == sum(qe - qs for _, qs, qe, _ in it["triples"]) <= 12
        assert all(kv == qe for _, _, qe, kv in it["triples"])
        assert it["ledger_matches_model"] and it["bytes_per_rank"] == it["predicted_bytes_per_rank"]
    assert (tmp_path / ".hydra" / "config.yaml").exists()


def test_serve_a_saved_gpt2(tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)  # the same random weights every run (their greedy ids must not hit the eos id by chance)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_head=4, n_layer=2, n_positions=32))
    model.save_pretrained(tmp_path / "ckpt")
    proc, _ = launch_on_pool(2, f"hf_checkpoint={tmp_path / 'ckpt'}", "prompts=[[464,3290,318],[40,50256]]",
                             "max_new_tokens=4", "dtype=float64", run_dir=tmp_path / "run", script="serve.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["config"]["model"]["vocab_size"] == 50257 and report["check"]["ok"] is True
    assert [len(r["output_ids"]) for r in report["requests"]] == [4, 4]


BAD = [
    (["prompts=[[1,2,3],[]]"], "prompts[1]=[]: every prompt needs at least one token id"),
    (["prompts=[[1,50257]]"], "prompts[0] holds 50257, not a token id of the vocabulary [0, 50257)"),
    (["prompts=[[1,2,3,4,5]]", "model.max_seq_len=4"], "prompt 0 has 5 tokens, more than model.max_seq_len=4"),
    (["long_prefill_token_threshold=0"], "long_prefill_token_threshold=0 must be an integer of at least 1"),
    (["max_num_batched_tokens=4", "max_num_seqs=8"], "max_num_batched_tokens=4 is smaller than a full decode batch"),
    (["model=gpt9"], "unknown model preset 'gpt9'; choose one of article03, deepseek_tiny, gpt2_small"),
    (["hf_checkpoint=CORRUPT"], "cannot read the weights"),
    (["+temprature=0.7"], "unknown setting 'temprature' (+temprature=0.7): serve.py has no such setting"),
    (["++pd.timeout=5"], "unknown setting 'pd.timeout'"),
]


def _corrupt_checkpoint(path):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(dict(n_embd=32, n_head=4, n_layer=2)))
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{truncated")
    return [f"hf_checkpoint={path}"]


@pytest.mark.parametrize("overrides,message", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_settings_fail_before_any_collective(tmp_path, overrides, message):
    """The last rank's settings phase (tests/launching.py), with nobody to meet: one line, exit code 2."""
    if overrides == ["hf_checkpoint=CORRUPT"]:
        overrides = _corrupt_checkpoint(tmp_path / "ckpt")
    refused(overrides, message)


def test_serve_samples_and_checks_against_the_same_sampler_on_the_oracle(tmp_path):
    """temperature / top_k / top_p / min_p: every sampled token checked against the dense oracle with the same noise,
    every iteration's collectives (the sampler's included) against the model; the settings in report.json."""
    args = [*SMALL, "temperature=1.1", "top_p=0.9", "top_k=50", "min_p=0.01", "sampling_seed=3"]
    proc, _ = launch_on_pool(2, *args, run_dir=tmp_path / "a", script="serve.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "decoding: sampled, temperature=1.1" in proc.stdout
    report = json.loads((tmp_path / "a" / "report.json").read_text())
    assert report["config"]["sampling"] == {"temperature": 1.1, "top_k": 50, "top_p": 0.9, "min_p": 0.01,
                                            "sampling_seed": 3}
    assert report["check"]["verdicts"]["match"] == 5 and report["ledger_matches_model"] is True
    greedy, _ = launch_on_pool(2, *SMALL, run_dir=tmp_path / "b", script="serve.py")
    greedy = json.loads((tmp_path / "b" / "report.json").read_text())
    assert [r["output_ids"] for r in greedy["requests"]] != [r["output_ids"] for r in report["requests"]]
    # the same iterations, and the sampler's candidates (top-50 pairs per rank) move more than greedy's pairs
    assert [it["rows"] for it in greedy["iterations"]] == [it["rows"] for it in report["iterations"]]
    assert report["totals"]["bytes_per_rank"] > greedy["totals"]["bytes_per_rank"]


def test_an_unknown_preset_fails_fast_on_a_lone_rank(tmp_path):
    """The last rank as its own process, with nobody to meet, exits 2 on a preset Hydra would not find (checked
    before Hydra starts). Every rank failing under torchrun: tests/test_launcher.py (the same launch.settings)."""
    alone = lone_rank_process(tmp_path / "run", ["model=gpt9"])
    assert alone.returncode == 2, alone.stdout + alone.stderr
    assert alone.stderr.startswith("[rank 1] error: unknown model preset 'gpt9'"), alone.stderr
    assert "Error executing job" not in alone.stderr and 'serve.py", line' not in alone.stderr


MORE_BAD = [
    (["max_new_tokens=0"], "max_new_tokens=0 (request 0) must be at least 1"),
    (["kv_cache_dtype=fp4"], "kv_cache_dtype='fp4': choose auto, fp8_e4m3, fp8_e5m2, int8"),
    # vLLM's rule, the library's and the server's: prompt + max_new_tokens <= max_seq_len (3 + 1022 = 1025 tokens)
    (["prompts=[[1,2,3]]", "max_new_tokens=1022"], "maximum context length is 1024 tokens. However, you requested 1025"),
    (["arrivals=[0,-1]", "prompts=[[1],[2]]"], "request 1 arrives at iteration -1"),
    (["eos_id=50257"], "eos_id=50257 is not a token id"),
    (["prompts=[1,2]"], "prompts[0]=1 is not a list of token ids"),
    (["variant=intra_head"], "unknown variant 'intra_head' for serving"),
    (["variant=v2sp"], "unknown variant 'v2sp' for serving; choose v2 or v1 (intra_head and v2sp cut one forward"),
    (["prompt_dist=zipf"], "unknown prompt_dist 'zipf'"),
    (["temperature=-1"], "temperature=-1 must be a number >= 0"),
    (["temperature=0.8", "top_p=0"], "top_p=0 must be in (0, 1]"),
    (["temperature=0.8", "pd.prefill_ranks=1", "pd.decode_ranks=1"], "temperature=0.8 with pd"),
    (["prompt_mean=100000"], "prompt_mean=100000 cannot be met: random prompts have at most 1008 tokens here "
                             "(model.max_seq_len=1024, max_new_tokens=16, shared_prefix=0)"),
]


@pytest.mark.parametrize("overrides,message", MORE_BAD, ids=[" ".join(b[0]) for b in MORE_BAD])
def test_more_bad_settings_on_a_lone_rank(overrides, message):
    refused(overrides, message)


def test_clipped_prompt_lengths_are_said_not_hidden():
    """Lengths drawn longer than fit are clipped and the note says how many; a mean that cannot fit is refused."""
    from launch.settings import fitted_lengths, generate_lengths

    drawn = generate_lengths("lognormal", 6, 900, 10**9, 0, "prompt_dist")
    clipped = sum(n > 1023 for n in drawn)
    assert clipped >= 1  # the case under test
    lengths, note = fitted_lengths("lognormal", 6, 900, 1023, 0, "prompt_dist", "prompt_mean", "random prompts")
    assert lengths == [min(n, 1023) for n in drawn] and max(lengths) == 1023
    assert note.startswith(f"{clipped} of 6 random prompts drawn longer than 1023 tokens") and "not prompt_mean=900" in note
    assert fitted_lengths("uniform", 6, 10, 1023, 0, "prompt_dist", "prompt_mean", "random prompts")[1] is None


def test_article03_preset_is_the_default_model():
    import yaml

    from layers.models.config import ARTICLE03

    preset = yaml.safe_load((ROOT / "conf" / "model" / "article03.yaml").read_text())
    assert preset == {k: v for k, v in ARTICLE03.asdict().items() if k in preset}
    assert set(ARTICLE03.asdict()) - set(preset) == {"ln_eps"}


# ---- prefill/decode disaggregation --------------------------------------------------------------------------


def test_serve_pd_end_to_end(tmp_path):
    proc, _ = launch_on_pool(4, *SMALL, "pd.prefill_ranks=2", "pd.decode_ranks=2", run_dir=tmp_path,
                             script="serve.py")  # under torchrun: test_a_decode_rank_dying_ends_the_whole_job_fast
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("tpref: prefill/decode disaggregation") == 1
    assert "Llama-2-7B" in proc.stdout and "PASS: P/D served 5 requests" in proc.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    t = report["transfer"]
    assert report["pd"] == {"prefill_ranks": 2, "decode_ranks": 2, "prefill_pp": 1, "streaming": True}
    assert t["pair_count"] == t["pair_count_formula"] == 2
    assert t["total_bytes"] == t["total_formula"] == sum(r["prompt_length"] for r in report["requests"]) * 2 * 2 * 512 * 8
    assert set(t["received_per_decode_rank"].values()) == {t["total_bytes"] // 2}
    assert report["ledger_matches_model"] and report["same_as_colocated"] and report["check"]["ok"]
    for r in report["requests"]:
        assert len(r["output_ids"]) == 5 and r["prefill_s"] > 0 and r["transfer_s"] > 0 and r["first_decode_s"] > 0


PD_BAD = [
    (4, ["pd.prefill_ranks=2"], "set both (or neither)"),
    (4, ["pd.prefill_ranks=1", "pd.decode_ranks=2"], "= 3 must equal the world size 4"),
    (4, ["pd.prefill_ranks=3", "pd.decode_ranks=1"], "pd.prefill_ranks=3: n_heads=8 heads cannot be split over p=3"),
    (2, ["pd.prefill_ranks=0", "pd.decode_ranks=2"], "pd.prefill_ranks=0 must be a positive integer"),
    (2, ["pd.prefill_ranks=1", "pd.decode_ranks=1", "pd.streaming=maybe"], "pd.streaming='maybe' must be true or false"),
    # int8 needs calculate_kv_scales (off by default, as vLLM): on, so that the pd rule is the one refusing
    (2, ["pd.prefill_ranks=1", "pd.decode_ranks=1", "kv_cache_dtype=int8", "calculate_kv_scales=true"],
     "kv_cache_dtype=int8 with pd is not built"),
]


@pytest.mark.parametrize("world,overrides,message", PD_BAD, ids=[" ".join(b[1]) for b in PD_BAD])
def test_bad_pd_settings_on_a_lone_rank(world, overrides, message):
    refused(overrides, message, world)


def _rank_pids(run_dir, rank: int) -> list[int]:
    """The pids of this run's rank-`rank` processes (found by their command line and environment)."""
    pids = []
    for proc in os.listdir("/proc"):
        if not proc.isdigit():
            continue
        try:
            cmdline = open(f"/proc/{proc}/cmdline", "rb").read()
            env = open(f"/proc/{proc}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if str(run_dir).encode() in cmdline and f"RANK={rank}".encode() in env:
            pids.append(int(proc))
    return pids


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the rank's process through /proc")
def test_a_decode_rank_dying_ends_the_whole_job_fast(tmp_path):
    import signal
    import time

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           str(ROOT / "launch" / "serve.py"), f"hydra.run.dir={tmp_path}", "model.n_layers=2", "prompt_count=8",
           "prompt_mean=12", "max_new_tokens=500", "check=false", "pd.prefill_ranks=2", "pd.decode_ranks=2"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (pids := _rank_pids(tmp_path, 3)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert pids, "rank 3 never started"
        time.sleep(3)  # into the serving loop: the model is small (it loads in about a second), the requests long
        assert proc.poll() is None, "the job ended before the decode rank could be killed"
        os.kill(pids[0], signal.SIGKILL)
        killed = time.monotonic()
        stdout, stderr = proc.communicate(timeout=60)
        elapsed = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert elapsed < 30, f"{elapsed:.0f}s from the decode rank's death to the job's end"
    assert "SIGKILL" in stderr or "Signal 9" in stderr, stderr[-3000:]


# ---- Llama-family models ------------------------------------------------------------------------------------


def test_serve_llama_tiny(tmp_path):
    """Llama under the launcher, with kv_eviction (Hydra's dict): its oracle masks what the window leaves."""
    proc, _ = launch_on_pool(2, "model=llama_tiny", "model.n_layers=2", "prompt_count=3", "prompt_mean=16",
                             "max_new_tokens=4", "long_prefill_token_threshold=4", "max_num_batched_tokens=12", "dtype=float64",
                             "block_size=4", "kv_eviction={policy:streaming,sink_tokens:2,window_tokens:6}",
                             run_dir=tmp_path, script="serve.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["config"]["model"]["n_kv_heads"] == 2 and report["check"]["verdicts"]["match"] == 3
    assert report["kv_cache"]["evicted_blocks"] > 0 and "blocks evicted (kv_eviction)" in proc.stdout
    assert report["kv_cache"]["ratio_to_dense"] == 0.5 and report["ledger_matches_model"]
    assert report["kv_cache"]["bytes_per_token_per_rank"] == 2 * 2 * 1 * 32 * 8  # 2·L·(h_kv/p)·d_head·e
    assert report["kv_cache"]["matches_formula"] is True and report["kv_cache"]["kv_heads_per_rank"] == 1
    assert "untied" in proc.stdout


LLAMA_BAD = [
    (["model=llama_tiny", "variant=v1"], "served with variant=v2"),
    (["model=llama_tiny", "model.n_kv_heads=3"], "n_heads=8 must be a multiple of n_kv_heads=3"),
    (["model=llama_tiny", "model.family=mamba"], "model.family='mamba': choose gpt2, llama, mixtral, deepseek_v3"),
    (["model=llama_tiny", "model.norm_eps=abc"], "model.norm_eps='abc' must be a number"),
    (["model=llama_tiny", "model.tie_word_embeddings=1"], "model.tie_word_embeddings=1 must be true or false"),
    (["kv_eviction={policy:streaming,window_tokens:8}"], "kv_eviction window_tokens=8 is smaller than a block"),
    (["kv_eviction={policy:streaming,window_tokens:32}", "pd.prefill_ranks=1", "pd.decode_ranks=1"],
     "kv_eviction with pd is not built"),
    (["quantization=int8", "pd.prefill_ranks=1", "pd.decode_ranks=1"], "quantization=int8 with pd is not built"),
    (["quantization=None"], "quantization='None': choose None (null in the launcher"),
]


@pytest.mark.parametrize("overrides,message", LLAMA_BAD, ids=[" ".join(b[0]) for b in LLAMA_BAD])
def test_bad_llama_settings_on_a_lone_rank(overrides, message):
    refused(overrides, message)
