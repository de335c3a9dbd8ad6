"""GPT-2 weights from transformers, imported and sharded, against transformers' own GPT2Block forward."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from layers.models.dense import DenseStack, init_weights
from layers.models.hf_gpt2 import config_from_hf, load_stack
from layers.models.tp_block import shard_stack
from tests.common import rel_err
from tests.harness import run_ranks

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="GPT-2 import tests need transformers (pip install -e .[hf])")

ROOT = Path(__file__).resolve().parent.parent
HF = dict(n_embd=64, n_head=8, n_layer=3, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
          attn_implementation="eager")


def random_gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(seed)
    model = GPT2Model(GPT2Config(**HF)).double().eval()
    with torch.no_grad():  # random biases and LayerNorms too (GPT-2's own init leaves them at 0 and 1)
        for name, p in model.named_parameters():
            if "bias" in name or "ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def check_against_transformers(ctx, variant):
    model = random_gpt2()
    cfg = config_from_hf(model.config.to_dict())
    dense = load_stack(init_weights(DenseStack(cfg, torch.float64), seed=99), model.state_dict())
    stack = shard_stack(dense, variant, ctx.group)
    x = torch.randn(1, 11, cfg.d_model, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    with torch.no_grad():
        ours = stack(x[0])
        # The oracle: transformers' GPT2Model, which builds its own causal mask for its GPT2Blocks (eager
        # attention). Position embeddings zeroed, so hidden_states[0] is x itself; hidden_states[i + 1] is
        # block i's output, except the last, which has the final LayerNorm applied.
        model.wpe.weight.zero_()
        hidden = model(inputs_embeds=x, output_hidden_states=True).hidden_states
        assert torch.equal(hidden[0], x)
        worst = 0.0
        for i in range(cfg.n_layers):
            expected = hidden[i + 1][0]
            got = model.ln_f(ours[i]) if i == cfg.n_layers - 1 else ours[i]
            err = rel_err(got, expected)
            assert err < 1e-12, (variant, i, err)
            worst = max(worst, err)
    return worst


@pytest.mark.parametrize("variant", ["v1", "v2"])
@pytest.mark.parametrize("p", [1, 2, 4])
def test_imported_gpt2_matches_transformers(p, variant):
    run_ranks(p, check_against_transformers, variant)


def test_conv1d_weights_are_transposed():
    model = random_gpt2()
    dense = load_stack(DenseStack(config_from_hf(model.config.to_dict()), torch.float64), model.state_dict())
    hf_w = model.state_dict()["h.1.mlp.c_fc.weight"]  # [in=64, out=256]
    assert hf_w.shape == (64, 256) and torch.equal(dense.blocks[1].mlp_up.weight, hf_w.t())


def test_unsupported_activation_is_refused():
    with pytest.raises(ValueError, match="activation 'relu' is not supported"):
        config_from_hf(dict(HF, activation_function="relu"))


def test_launcher_runs_a_saved_checkpoint(tmp_path):
    model = random_gpt2().float()
    model.save_pretrained(tmp_path / "ckpt")
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["n_layer"] == 3
    from tests.launching import launch_on_pool

    proc, _ = launch_on_pool(2, f"hf_checkpoint={tmp_path / 'ckpt'}", "requests=[5,9]", "variants=[v2]", "repeats=1",
                             run_dir=tmp_path / "run")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["config"]["model_name"] == "hf" and report["config"]["hf_checkpoint"] == str(tmp_path / "ckpt")
    model = report["config"]["model"]
    assert (model["d_model"], model["n_heads"], model["d_head"], model["d_ffn"], model["n_layers"]) == (64, 8, 8, 256, 3)
    assert report["equivalent"] is True and report["traffic_ok"] is True
    assert "weights: GPT-2 checkpoint" in proc.stdout


LLAMA = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 2,
         "num_hidden_layers": 2, "intermediate_size": 96, "hidden_act": "silu"}
BROKEN = {
    "truncated weights": ({"n_embd": 64, "n_head": 8, "n_layer": 3}, b"\x10\x00\x00\x00\x00\x00\x00\x00{trunc",
                          "cannot read the weights (model.safetensors is truncated or not safetensors: 14 bytes"),
    "config not JSON": ("{not json", None, "config.json is not valid JSON"),
    "another model type": ({"model_type": "mistral", "hidden_size": 64}, None,
                           "model_type='mistral' is not supported: GPT-2 (gpt2), Llama (llama), Mixtral (mixtral), "
                           "DeepSeek-V3 (deepseek_v3) and Qwen3 (qwen3) checkpoints are"),
    "a Llama config missing fields": ({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 8}, None,
                                      "not a Llama config (no num_hidden_layers, intermediate_size)"),
    "a Llama activation": (dict(LLAMA, hidden_act="gelu"), None, "hidden_act='gelu' is not supported"),
    "Llama rope scaling (4.x)": (dict(LLAMA, rope_scaling={"type": "linear", "factor": 2.0}), None,
                                 "rope scaling is not supported"),
    "Llama rope scaling (5.x)": (dict(LLAMA, rope_parameters={"rope_type": "llama3", "rope_theta": 5e5}), None,
                                 "rope scaling is not supported"),
    "Llama heads that p = 2 cannot split": (dict(LLAMA, num_attention_heads=6, num_key_value_heads=3, head_dim=8),
                                            None, "valid tensor-parallel sizes: 1, 3, 6"),
    "n_embd a string": ({"n_embd": "64", "n_head": 8, "n_layer": 3}, None, "n_embd='64' in config.json must be"),
    "weights of another model": ({"n_embd": 64, "n_head": 8, "n_layer": 3, "n_positions": 64}, "OTHER",
                                 "transformer.h.0.ln_1.weight has shape (32,), config.json's model needs (64,)"),
}


@pytest.mark.parametrize("launcher", ["run_block.py", "serve.py"])
@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_checkpoint_is_a_one_line_setting_error(tmp_path, case, launcher):
    config, weights, message = BROKEN[case]
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if weights == "OTHER":  # a valid file, saved from a smaller GPT-2
        from transformers import GPT2Config, GPT2LMHeadModel

        GPT2LMHeadModel(GPT2Config(n_embd=32, n_head=4, n_layer=3, n_positions=64)).save_pretrained(tmp_path / "other")
        (tmp_path / "ckpt" / "model.safetensors").write_bytes((tmp_path / "other" / "model.safetensors").read_bytes())
    elif weights is not None:
        (tmp_path / "ckpt" / "model.safetensors").write_bytes(weights)
    # rank 1 of 2 with nobody to meet: the error must come before any process group exists
    from tests.launching import settings_phase

    proc = settings_phase([f"hf_checkpoint={tmp_path / 'ckpt'}"], world=2, script=launcher)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("[rank 1] error: hf_checkpoint=") and message in lines[0], lines
