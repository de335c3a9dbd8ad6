"""Llama-family models through the launchers: run_block and serve on llama_tiny, transformers Llama checkpoints
(hf_checkpoint), the llama2_7b preset and the memory check that keeps it from being killed, the cost model's
parameter counts and KV bytes per rank."""

import dataclasses
import json

import pytest
import torch

from layers.models.hf import config_from_hf
from layers.models.llama import LLAMA2_7B_SHAPE, LLAMA_TINY
from tests.launching import launch_on_pool, refused
from tp.dist import ConfigError

HF_LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_attention_heads=8, num_key_value_heads=2,
                num_hidden_layers=2, vocab_size=300, head_dim=8, max_position_embeddings=128, rms_norm_eps=1e-6)


def test_run_block_llama_tiny_on_four_ranks(tmp_path):
    """The issue's command (p = 4 > h_kv = 2: each K,V head on two ranks), checked against the dense stack."""
    proc, _ = launch_on_pool(4, "model=llama_tiny", "repeats=1", run_dir=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["config"]["family"] == "llama" and list(report["variants"]) == ["v2", "v2sp"]
    sp = report["variants"]["v2sp"]
    assert sp["equivalent"] and sp["ledger_matches_model"] and sp["counts_agree"]
    assert sp["totals"]["collectives"] == {"all_gather": 2 * 4, "reduce_scatter": 2 * 4}
    assert sp["totals"]["bytes_per_rank"] == report["variants"]["v2"]["totals"]["bytes_per_rank"]  # 4 | 40 tokens
    res = report["variants"]["v2"]
    assert report["equivalent"] and report["traffic_ok"] and res["ledger_matches_model"] and res["counts_agree"]
    assert [r["kv_heads"] for r in res["shards"]] == [[0, 0], [0, 0], [1, 1], [1, 1]]
    assert [r["heads"] for r in res["shards"]] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert res["shards"][0]["qkv"]["weight_in_out"] == [256, (2 + 2 * 1) * 32]  # 2 query heads, 1 K and 1 V head
    assert res["totals"]["collectives"] == {"all_reduce": 2 * 4}
    assert all(r["equivalent"] for r in res["requests"]) and len(res["requests"]) == 2
    assert "K,V heads" in proc.stdout and "h_kv=2" in proc.stdout and "PASS: v2, v2sp at tp=4" in proc.stdout


@pytest.mark.parametrize("overrides,message", [
    (["model=llama_tiny", "variants=[v1,v2]"], "Llama-family blocks are built as v2 or v2sp only"),
    (["model=llama_tiny", "model.n_kv_heads=4", "model.n_heads=12", "model.d_ffn=96"],
     "valid tensor-parallel sizes: 1, 2, 4, 12"),
    (["model=llama2_7b"], "lower model.n_layers (e.g. model.n_layers=1)"),
], ids=["v1", "heads", "too big"])
def test_bad_llama_block_settings_on_a_lone_rank(overrides, message):
    if overrides == ["model=llama2_7b"]:  # float64 and 4000 layers: refused on any machine
        overrides += ["dtype=float64", "model.n_layers=4000"]
    world = 3 if "model.n_heads=12" in overrides else 2
    refused(overrides, message, world, "run_block.py")


def test_memory_check_refuses_what_cannot_fit(monkeypatch):
    import launch.settings as settings

    monkeypatch.setattr(settings, "available_host_memory", lambda: 16 * 2**30)
    with pytest.raises(ConfigError, match=r"6\.48B parameters.*30\.2 GiB in float32.*120\.6 GiB"):
        settings.check_memory(LLAMA2_7B_SHAPE, torch.float32, 4, 4, False, "cpu")  # the blocks: 6,476,267,520
    settings.check_memory(dataclasses.replace(LLAMA2_7B_SHAPE, n_layers=1), torch.float32, 4, 4, False, "cpu")
    with pytest.raises(ConfigError, match=r"6\.74B parameters"):  # serve: + embedding and untied head
        settings.check_memory(LLAMA2_7B_SHAPE, torch.bfloat16, 1, 1, True, "cpu")
    one = dataclasses.replace(LLAMA2_7B_SHAPE, n_layers=1)  # fits alone; not beside a 14 GiB read per rank
    settings.check_memory(one, torch.bfloat16, 2, 2, False, "cpu")
    with pytest.raises(ConfigError, match=r"and 14\.0 GiB of one read"):
        settings.check_memory(one, torch.bfloat16, 2, 2, False, "cpu", host_extra=14 * 2**30)
    # per-rank loading, no dense reference: Llama-2-7B in bfloat16 at p = 4 is 3.1 GiB a rank, 12.6 GiB for all
    settings.check_memory(LLAMA2_7B_SHAPE, torch.bfloat16, 4, 4, True, "cpu", dense=False)
    with pytest.raises(ConfigError, match=r"every rank holds its 1/2 shard, 6\.3 GiB in bfloat16.*25\.1 GiB"):
        settings.check_memory(LLAMA2_7B_SHAPE, torch.bfloat16, 2, 4, True, "cpu", dense=False)


def test_parameter_counts_and_kv_formula():
    """Counted off (meta) modules, against the published Llama-2-7B size and the cost model's own formula."""
    from layers.models.dense import DenseStack
    from layers.models.lm import dense_lm
    from tp.cost_model import LLAMA2_7B, kv_bytes_per_token_per_rank, shape_of

    count = lambda m: sum(t.numel() for t in m.parameters())  # noqa: E731
    assert count(dense_lm(LLAMA2_7B_SHAPE, device="meta")) == 6_738_415_616  # Llama-2-7b's parameter count
    for cfg in (LLAMA2_7B_SHAPE, LLAMA_TINY):
        assert shape_of(cfg).n_params == count(DenseStack(cfg, device="meta"))
    assert shape_of(LLAMA2_7B_SHAPE).kv_bytes_per_token == LLAMA2_7B.kv_bytes_per_token == 512 * 1024
    # MHA shrinks with p; GQA (h_kv = 8) stops at p = 8; the replicated head costs the same on every rank
    assert [LLAMA2_7B.kv_bytes_per_token_per_rank(p) // 1024 for p in (1, 2, 4, 8, 16, 32)] == [512, 256, 128, 64, 32, 16]
    assert [kv_bytes_per_token_per_rank(32, 8, 128, p, 2) // 1024 for p in (1, 2, 4, 8, 16, 32)] == [128, 64, 32, 16, 16, 16]
    with pytest.raises(ValueError):
        kv_bytes_per_token_per_rank(32, 8, 128, 3, 2)
    # attention work counts query heads: GQA shares K,V, not the QKᵀ and PV products
    from tp.cost_model import attention_flops_per_pair

    assert attention_flops_per_pair(shape_of(LLAMA_TINY)) == 4 * LLAMA_TINY.k * LLAMA_TINY.n_layers


# ---- transformers Llama checkpoints -----------------------------------------------------------------------------


@pytest.mark.parametrize("fields,theta", [({"rope_theta": 5e5}, 5e5),
                                          ({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, 5e5),
                                          ({}, 1e4)], ids=["4.x", "5.x", "default"])
def test_llama_config_from_either_transformers_layout(fields, theta):
    cfg = config_from_hf(dict(HF_LLAMA, **fields))
    assert cfg.family == "llama" and cfg.rope_theta == theta
    assert (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.d_ffn, cfg.n_layers, cfg.max_seq_len,
            cfg.vocab_size, cfg.norm_eps) == (64, 8, 2, 8, 96, 2, 128, 300, 1e-6)
    assert config_from_hf({k: v for k, v in HF_LLAMA.items() if k != "num_key_value_heads"}).n_kv_heads == 8  # MHA


def hf_llama(tmp_path=None, max_shard_size="10GB", **extra):
    transformers = pytest.importorskip("transformers")
    cfg = {k: v for k, v in HF_LLAMA.items() if k != "model_type"}
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg, **extra)).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    if tmp_path is not None:
        model.save_pretrained(tmp_path / "ckpt", max_shard_size=max_shard_size)
    return model


def test_tied_llama_checkpoint_uses_the_embedding_as_head():
    """A checkpoint with tie_word_embeddings (no lm_head.weight stored): the head is the embedding."""
    from layers.models.hf import load_lm
    from layers.models.lm import DenseLlamaLM

    model = hf_llama(tie_word_embeddings=True)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    ours = load_lm(DenseLlamaLM(config_from_hf(model.config.to_dict()), torch.float64), state)
    ids = torch.tensor([3, 17, 250, 9, 41])
    with torch.no_grad():
        want = model(ids[None]).logits[0]
        got = ours.logits(ids)
    assert ours.lm_head.weight is ours.embed.weight and ours.cfg.tie_word_embeddings
    assert (got - want).abs().max() / want.abs().max() < 1e-6  # transformers' RMSNorm/rotary run in float32


def test_run_block_and_serve_a_saved_llama(tmp_path):
    """hf_checkpoint with a sharded LlamaForCausalLM directory (model.safetensors.index.json and its files): run_block
    checks its blocks, serve (each rank reading only its slices) generates the tokens transformers' own generate()
    does (greedy), and reports each rank's load."""
    model = hf_llama(tmp_path, max_shard_size="40KB")
    assert len(list((tmp_path / "ckpt").glob("model-*-of-*.safetensors"))) > 3
    proc, _ = launch_on_pool(2, f"hf_checkpoint={tmp_path / 'ckpt'}", "requests=[5,9]", "repeats=1", "dtype=float64",
                             run_dir=tmp_path / "block")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "block" / "report.json").read_text())
    assert report["config"]["family"] == "llama" and report["config"]["model_name"] == "hf"
    assert report["config"]["model"]["n_kv_heads"] == 2 and report["equivalent"] and report["traffic_ok"]
    assert "weights: Llama checkpoint" in proc.stdout

    prompts = [[5, 81, 2, 299, 14, 7], [120, 3]]
    proc, _ = launch_on_pool(2, f"hf_checkpoint={tmp_path / 'ckpt'}", f"prompts={json.dumps(prompts).replace(' ', '')}",
                             "max_new_tokens=6", "long_prefill_token_threshold=4", "dtype=float64", run_dir=tmp_path / "serve",
                             script="serve.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "serve" / "report.json").read_text())
    for prompt, req in zip(prompts, report["requests"]):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                                 num_beams=1, eos_token_id=None, pad_token_id=0)
        assert req["output_ids"] == out[0, len(prompt):].tolist()
    assert report["check"]["ok"] is True and report["lm_head_tied"] is False
    load = report["load"]
    assert load["path"] == "per-rank slices" and load["checkpoint"].startswith("model.safetensors.index.json and its")
    assert len(load["peak_rss_bytes"]) == 2 and all(pk >= b > 0 for pk, b in zip(load["peak_rss_bytes"],
                                                                                 load["base_rss_bytes"]))
    # float64 files, float64 run: each rank read its own parameters' bytes (less the vocabulary padding: none here)
    assert load["read_bytes"] == load["weights_bytes"] and 2 * load["read_bytes"][0] < 1.1 * load["checkpoint_bytes"]
    assert "load: per-rank slices of model.safetensors.index.json" in proc.stdout


def test_serve_pd_llama_tiny(tmp_path):
    """P/D with grouped-query attention: 1 prefill rank holds both K,V heads, 2 decode ranks one each."""
    proc, _ = launch_on_pool(3, "model=llama_tiny", "model.n_layers=2", "pd.prefill_ranks=1", "pd.decode_ranks=2",
                             "prompt_count=3", "prompt_mean=8", "max_new_tokens=4", "dtype=float64", run_dir=tmp_path,
                             script="serve.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    t = report["transfer"]
    assert [(p["prefill_rank"], p["decode_rank"], p["heads"]) for p in t["pairs"]] == [(0, 1, [0, 1]), (0, 2, [1, 2])]
    assert report["load"]["path"] == "dense, then shard" and len(report["load"]["peak_rss_bytes"]) == 3
    assert t["total_bytes"] == t["total_formula"] == t["handed_over_tokens"] * 2 * 2 * 2 * 32 * 8  # K_tok, h_kv = 2
    assert report["ledger_matches_model"] and report["same_as_colocated"] and report["check"]["ok"] is True


def test_a_llama_model_without_head_cannot_be_served_but_its_blocks_can_be_checked():
    from layers.models.hf import check_state

    transformers = pytest.importorskip("transformers")
    cfg = {k: v for k, v in HF_LLAMA.items() if k != "model_type"}
    state = transformers.LlamaModel(transformers.LlamaConfig(**cfg)).state_dict()  # keys "layers.0...", no head
    ours = config_from_hf(HF_LLAMA)
    check_state(ours, state, lm=False)
    with pytest.raises(ConfigError, match="LlamaModel checkpoint has no LM head"):
        check_state(ours, state, lm=True)
    causal = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).state_dict()
    check_state(ours, causal, lm=True)
    headless = {k: v for k, v in causal.items() if k != "lm_head.weight"}  # untied in config.json, head missing
    with pytest.raises(ConfigError, match="the weights have no 'lm_head.weight'"):
        check_state(ours, headless, lm=True)
    check_state(config_from_hf(dict(HF_LLAMA, tie_word_embeddings=True)), headless, lm=True)  # tied: none needed
    with pytest.raises(ConfigError, match=r"layers.1.mlp.up_proj.weight has shape \(48, 64\), config.json's model "
                                          r"needs \(96, 64\)"):
        check_state(ours, {**state, "layers.1.mlp.up_proj.weight": torch.zeros(48, 64)}, lm=False)
