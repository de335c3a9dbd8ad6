"""Qwen3 (layers/models/qwen3.py: Llama with an RMSNorm on every query and key head) against transformers'
Qwen3ForCausalLM, float64, on python -m serve.toy_model's Qwen3 (random weights, head_dim 32: h·dh = 2d, 4 K,V heads for
8 query heads).

Oracles: transformers' logits (its norms and rotary tables kept in float64) for the dense model; the dense model for
the TP blocks at p = 2, 4 in v2 and v2sp, forward and gradients, every collective against the traffic model (the
norms' one backward all-reduce included); transformers' greedy `generate` for LLM at tensor_parallel_size 1 and 4,
and for the server (its LLM at 2)."""

import os
from collections import Counter

import pytest
import torch

from layers.attention.varlen import Requests
from layers.models.hf import load_lm, read_config, read_state
from layers.models.lm import dense_lm
from serve.sampling_params import SamplingParams
from tests.common import exact_norms_and_rope
from tests.harness import run_ranks

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="the transformers oracle needs pip install -e .[hf]")

PROMPTS = ["Once upon a time", "café über 中文", "the"]
NEW = 12
LENGTHS = [5, 9]  # two requests in one forward of the blocks


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from serve.toy_model import main

    path = tmp_path_factory.mktemp("qwen3") / "toy"
    assert main([str(path), "--family", "qwen3", "--seed", "3"]) == 0
    return path


def exact_transformers(path):
    """transformers' Qwen3ForCausalLM in float64, its norms and rotary tables in float64 too."""
    from transformers.models.qwen3 import modeling_qwen3 as mq

    model = transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    return exact_norms_and_rope(model, mq.Qwen3RMSNorm, mq.Qwen3RotaryEmbedding, model.config.head_dim,
                                model.config.rope_parameters["rope_theta"])


def dense(path):
    return load_lm(dense_lm(read_config(path), torch.float64), read_state(path))


@pytest.fixture(scope="module")
def server(checkpoint):
    """python -m serve.api at p = 2 (tests/test_api.py's harness), started by the first test so that it comes up while
    the others run; ready() waits for it."""
    from tests.test_api import Server

    started = Server(checkpoint, p=2)
    yield started
    started.stop()


def test_the_dense_qwen3_equals_transformers(checkpoint, server):
    cfg = read_config(checkpoint)
    assert cfg.family == "qwen3" and cfg.n_heads * cfg.d_head == 2 * cfg.d_model  # head_dim explicit, not d/h
    ours, theirs = dense(checkpoint), exact_transformers(checkpoint)
    assert float(ours.stack.blocks[0].q_norm.weight.detach().std()) > 0.01  # the norms' weights are not all alike
    ids = torch.randint(0, cfg.vocab_size, (13,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = theirs(ids[None]).logits[0]
        assert float((ours.logits(ids) - want).abs().max() / want.abs().max()) < 1e-12


def _tp_blocks(ctx, path):
    """Each variant's TP stack sharded from the dense one: its output, its norms' gradients (all-reduced over the
    ranks' heads) and the input's against the dense stack's, and its collectives against the traffic model."""
    from layers.models.tp_block import shard_stack
    from tp.ledger import TrafficLedger
    from tp.traffic_model import PHASES, predict, predict_sp_stack

    stack = dense(path).stack
    cfg, n, p = stack.cfg, sum(LENGTHS), ctx.world_size
    cu = Requests.from_lengths(LENGTHS).cu_seqlens
    x = torch.randn(n, cfg.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x_dense = x.clone().requires_grad_()
    want = stack(x_dense, cu)[-1]
    want.square().sum().backward()
    out = {}
    for variant in ("v2", "v2sp"):
        tp = shard_stack(stack, variant, ctx.group)
        x_tp = x.clone().requires_grad_()
        ledger = TrafficLedger(p)
        with ledger.attach(tp):
            got = tp.output(tp(x_tp, cu), n)
            got.square().sum().backward()
        seen = {ph: Counter(r.traffic() for r in ledger.records if r.phase == ph) for ph in PHASES}
        model = {ph: Counter(predict(cfg, p, n, torch.float64, variant, ph)
                             + (predict_sp_stack(cfg, p, n, torch.float64, ph) if variant == "v2sp" else []))
                 for ph in PHASES}
        grads = [(t.q_norm.weight.grad, d.q_norm.weight.grad) for t, d in zip(tp.blocks, stack.blocks)] + \
                [(t.k_norm.weight.grad, d.k_norm.weight.grad) for t, d in zip(tp.blocks, stack.blocks)] + \
                [(x_tp.grad, x_dense.grad)]
        out[variant] = (float((got - want).abs().max() / want.abs().max()),
                        max(float((a - b).abs().max() / b.abs().max()) for a, b in grads),
                        seen == model, sum(t.site == "qk_norm dw" and t.phase == "backward" for t in seen["backward"]))
    return out


@pytest.mark.parametrize("p", [2, 4])
def test_tp_qwen3_blocks_equal_the_dense_ones_forward_and_backward(checkpoint, p):
    """Each rank normalizes its own whole heads: the forward adds no collective to Llama's two all-reduces per block;
    backward adds one all-reduce per block of the norms' gradients, which each rank holds for its heads only."""
    for result in run_ranks(p, _tp_blocks, str(checkpoint)):
        for variant, (err, grad_err, ledger_ok, norm_reductions) in result.items():
            assert err < 1e-12 and grad_err < 1e-11, (variant, err, grad_err)
            assert ledger_ok, variant
            assert norm_reductions == 2  # one per block (2 layers), in backward


@pytest.fixture(scope="module")
def expected(checkpoint):
    """transformers' greedy generate, float64, as from_pretrained gives it (no patches), and the tokenizer."""
    from tests.test_llm import hf_generate

    return hf_generate(checkpoint, PROMPTS, NEW)


@pytest.mark.parametrize("p", [1, 4])
def test_llm_generates_what_transformers_generates(checkpoint, expected, p):
    """p = 4: one K,V head per rank; every step's collectives are checked against the traffic model in the engine.
    p = 2 is the server's (its LLM, below)."""
    from serve import LLM

    want, tok = expected
    with LLM(str(checkpoint), tensor_parallel_size=p, dtype="float64") as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW))
        stats = llm.stats()
    assert [o.outputs[0].token_ids for o in outs] == want
    assert [o.outputs[0].text for o in outs] == [tok.decode(ids, skip_special_tokens=True) for ids in want]
    assert stats["last_iteration"]["ledger_matches_model"]


def test_the_server_answers_what_transformers_generates(server, expected):
    """python -m serve.api serves through LLM at tensor_parallel_size 2: the tokens are transformers'."""
    from tests.test_api import MODEL

    got = server.ready().client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=NEW, temperature=0,
                                                   extra_body={"return_token_ids": True})
    assert [c.token_ids for c in sorted(got.choices, key=lambda c: c.index)] == expected[0]
