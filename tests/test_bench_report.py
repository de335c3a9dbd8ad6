"""docs/benchmarks.md's serving section: each target's sentence says met or not met from the figures (no timing here)."""

import json

import pytest

from benchmarks.report_serve import section, targets


def stall_row(config, chunk, spread, worst):
    return {"config": config, "chunk_size": chunk, "iterations": 64, "max_over_median": spread,
            "decoder_worst_tbt_s": worst, "decoder_p99_tbt_s": worst, "long_ttft_s": 1.0, "tokens_per_s": 100.0,
            "cache_rows_reread": 0, "reread_formula": 500}


def iteration(rows, predicted, measured):
    return {"run": "stall", "iteration": 0, "kind": "mixed", "rows": rows, "flops": 1.0, "bytes": 1.0,
            "measured_s": measured, "predicted_s": predicted, "collectives_s": 0.0}


def run(spread=2.0, stall=10.0, engine_tps=300.0, predicted=1.1, overhead=1.05):
    return {"world_size": 1,
            "calibration": {"matmul_flops_per_s_first": 1e11, "matmul_flops_per_s_last": 1e11,
                            "copy_bytes_per_s_first": 4e10, "copy_bytes_per_s_last": 4e10},
            "stall": {"repeats": 1, "timeline": {}, "rows": [stall_row("unchunked", 1024, 20.0, 1.0),
                                                             stall_row("C=64", 64, spread, 1.0 / stall),
                                                             stall_row("C=512", 512, 9.0, 0.5)]},
            "hf": {"requests": 2, "prompt_lengths": [3, 9], "max_new_tokens": [8, 64], "useful_tokens": 72,
                   "useful_rows": 82, "chunk_size": 256, "max_batched_tokens": 512,
                   "engine": {"time_s": 1.0, "tokens_per_s": engine_tps, "forwards": 10, "rows": 82},
                   "hf": [{"batch": b, "time_s": 2.0, "tokens_per_s": tps, "forwards": 20, "rows": 100, "same_ids": 2,
                           "differences": []} for b, tps in ((1, 50.0), (8, 100.0))]},
            "overhead": [{"batch": b, "loop_over_bare": overhead, "iteration_over_bare": overhead} for b in (1, 8, 32)],
            "cost_model": {"fixed_s": 0.01, "iterations": [iteration(300, predicted, 1.0), iteration(8, 0.5, 1.0)]}}


def sentences(**kw):
    return {line.split(",")[0].removeprefix("- "): line for line in targets({1: run(**kw)}) if line.startswith("- ")}


def test_every_target_met():
    got = sentences()
    assert set(got) == {"Spread", "Stall", "Throughput", "Cost model", "Overhead"}
    assert all("**met**" in line for line in got.values())
    assert "(C=64)" in got["Spread"] and "3.00× the tokens/s" in got["Throughput"] and "(batch 8)" in got["Throughput"]


@pytest.mark.parametrize("kw, target", [(dict(spread=3.5), "Spread"), (dict(stall=4.0), "Stall"),
                                        (dict(engine_tps=140.0), "Throughput"), (dict(predicted=1.3), "Cost model"),
                                        (dict(overhead=1.12), "Overhead")])
def test_a_missed_target_says_so(kw, target):
    got = sentences(**kw)
    assert "**not met**" in got[target]
    assert all("**met**" in line for name, line in got.items() if name != target)


def test_section_renders_both_runs(tmp_path):
    for p in (1, 2):
        (tmp_path / f"bench_serve_p{p}.json").write_text(json.dumps(dict(run(), world_size=p)))
    text = "\n".join(section(tmp_path))
    for heading in ("### Spread and stall", "### Against transformers", "### The cost model", "### Engine overhead",
                    "### Targets"):
        assert heading in text
    assert "| 2 | C=64 |" in text and "at p=2" in text
    assert section(tmp_path / "missing") == []


def kv_report(measured: int) -> dict:
    row = {"attention": "GQA", "n_kv_heads": 2, "p": 4, "measured_per_rank": [measured], "cache_heads": [1],
           "formula": 1024, "tokens_match_oracle": True}
    row["ok"] = row["measured_per_rank"] == [row["formula"]]
    return {"world_size": 8, "dtype": "float32", "requests": [[3, 2]], "rows": [row], "ok": row["ok"],
            "model": {"n_heads": 8, "d_head": 32, "n_layers": 4},
            "real_sizes_fp16": [{"model": "M", "per_rank": {"1": 2048, "2": 1024}}]}


def test_kv_section_marks_a_measurement_that_misses_the_formula():
    from benchmarks.report import kv_section

    good, bad = "\n".join(kv_section(kv_report(1024))), "\n".join(kv_section(kv_report(2048)))
    assert "| GQA | 2 | 1,024 B (1,024), 1 head |" in good and "Every measurement equals the formula" in good
    assert "2,048 B (1,024) **≠**" in bad and "Some measurement or token check failed" in bad
    assert "| M | 2 KiB | 1 KiB |" in good


def test_transformers_table_counts_matmul_flops_and_pairs_the_ratio(tmp_path):
    """With the model and the engine's runs per backend recorded: the FLOPs column is rows · 2·(blocks' parameters)
    plus scored rows · 2·V·d, and the ratio shown is the one paired round by round."""
    from layers.models.config import ARTICLE03
    from tp.cost_model import shape_of

    r = run()
    r["model"] = ARTICLE03.asdict()
    r["hf"]["max_running"] = 16
    r["hf"]["engines"] = [dict(r["hf"]["engine"], attention="cpu", max_running="default", ratio_to_best_hf=2.5),
                          dict(r["hf"]["engine"], attention="batched", max_running="default", ratio_to_best_hf=2.0,
                               same_ids=True)]
    (tmp_path / "bench_serve_p1.json").write_text(json.dumps(r))
    text = "\n".join(section(tmp_path))
    per_row, per_scored = 2 * shape_of(ARTICLE03).n_params, 2 * ARTICLE03.vocab_size * ARTICLE03.d_model
    engine = 82 * per_row + 72 * per_scored  # 82 rows; the 8 + 64 tokens sampled
    batch8 = 100 * per_row + 2 * 64 * per_scored  # one static batch of both requests, run to 64 tokens
    assert f"| 1 | transformers, batch 8 (best) | 1.00 | 20 | 1.22 | {batch8 / engine:.2f} |" in text
    assert "| 1 | engine, attention=cpu, max_num_seqs 16 | 2.50 |" in text
    assert "| 1 | engine, attention=batched, max_num_seqs 16 | 2.00 |" in text
    assert any(line.startswith("- Throughput, p=1") and "2.50×" in line for line in targets({1: r}))


def test_pipeline_section_puts_each_bubble_beside_the_formula():
    from benchmarks.bench_pp import section as pp_section

    run = {"pp": 2, "tp": 1, "rows": 512, "repeats": 3,
           "results": [{"microbatches": m, "rows_per_microbatch": 512 // m, "bubble": b, "formula": 1 / (m + 1),
                        "bubble_per_stage": [b, b]} for m, b in ((1, 0.5), (8, 0.2))]}
    text = "\n".join(pp_section([run]))
    assert "| 2 | 1 | 512 | 0.500 | 0.500 | 0.500 0.500 |" in text and "| 2 | 8 | 64 | 0.200 | 0.111 |" in text
    assert pp_section([]) == []
