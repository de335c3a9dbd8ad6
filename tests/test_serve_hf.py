"""Served tokens against transformers' own GPT2LMHeadModel.generate, from a saved random checkpoint (real vocab)."""

import os

import pytest
import torch

from layers.models.hf import load_lm, read_config, read_state
from layers.models.lm import DenseLM, greedy_reference, shard_lm
from serve.offline import OfflineEngine
from serve.config import EngineConfig
from serve.request import Request
from tests.harness import run_ranks

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="the transformers oracle needs pip install -e .[hf]")

HF = dict(n_embd=64, n_head=8, n_layer=3, n_positions=64, vocab_size=50257, resid_pdrop=0.0, embd_pdrop=0.0,
          attn_pdrop=0.0)
# (prompt length, max_new_tokens, arrival): long_prefill_token_threshold 4 and budget 10 make chunks after cached prefixes and
# iterations that mix them with decodes
WORKLOAD = [(11, 6, 0), (5, 7, 0), (14, 5, 1), (2, 6, 2)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**HF)).eval()
    with torch.no_grad():  # non-trivial biases and LayerNorms (GPT-2's init leaves them at 0 and 1)
        for name, p in model.named_parameters():
            if "bias" in name or "ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("gpt2") / "ckpt"
    model.save_pretrained(path)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, HF["vocab_size"], (n,), generator=gen).tolist() for n, _, _ in WORKLOAD]
    return path, prompts


def load_dense(path) -> DenseLM:
    return load_lm(DenseLM(read_config(path), torch.float64), read_state(path))


def serve_checkpoint(ctx, path, prompts):
    dense = load_dense(path)
    lm = shard_lm(dense, "v2", ctx.group)
    reqs = [Request(i, prompt, new, arrival) for i, (prompt, (_, new, arrival)) in enumerate(zip(prompts, WORKLOAD))]
    res = OfflineEngine(lm, ctx, EngineConfig(long_prefill_token_threshold=4, max_num_batched_tokens=10, max_num_seqs=10)).run(reqs)
    mixed = any(it["decodes"] and it["prefill_chunks"] for it in res.iterations)
    after_prefix = any(kv > qe - qs > 1 for it in res.iterations for _, qs, qe, kv in it["triples"])
    return [r["output_ids"] for r in res.requests], res.ledger_matches_model, mixed and after_prefix


def transformers_generate(path, prompts):
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(path, attn_implementation="eager", torch_dtype=torch.float64).eval()
    model.generation_config.eos_token_id = None  # no EOS stop: exactly max_new_tokens, like the engine
    model.generation_config.pad_token_id = 0
    out = []
    for prompt, (_, new, _) in zip(prompts, WORKLOAD):  # one prompt per call: no padding involved
        ids = torch.tensor([prompt])
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                                 num_beams=1)
        out.append(gen[0, len(prompt):].tolist())
    return out


@pytest.fixture(scope="module")
def expected(checkpoint):
    path, prompts = checkpoint
    ids = transformers_generate(path, prompts)
    dense = load_dense(path)
    assert dense.cfg.vocab_size == 50257  # odd: the vocab-parallel head pads at every p > 1
    for prompt, want, (_, new, _) in zip(prompts, ids, WORKLOAD):
        ref = greedy_reference(dense, prompt, new)
        assert ref.ids == want  # our dense oracle and transformers agree
        assert min(ref.margins) > 1e-9, "a near-tie between top-1 and top-2: pick another seed"
    return ids


@pytest.mark.parametrize("p", [1, 2, 4])
def test_served_tokens_equal_transformers_generate(checkpoint, expected, p):
    path, prompts = checkpoint
    for ids, ledger_ok, exercised in run_ranks(p, serve_checkpoint, str(path), prompts):
        assert ids == expected
        assert ledger_ok and exercised
