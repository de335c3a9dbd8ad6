"""Llama-family blocks: the dense block against transformers' LlamaModel, the TP block against the dense
one at every valid p, including K,V heads replicated once p exceeds h_kv. float64."""

import functools
from collections import Counter

import pytest
import torch

from layers.attention.varlen import Requests
from layers.models.dense import DenseStack
from layers.models.hf_llama import load_stack
from layers.models.llama import LlamaConfig, RMSNorm, kv_heads_of_rank, valid_llama_tp_sizes, validate_llama
from layers.models.tp_block import shard_stack
from tests.common import exact_norms_and_rope
from tests.harness import run_ranks
from tp.dist import ConfigError

transformers = pytest.importorskip("transformers", reason="the transformers oracle needs pip install -e .[hf]")

N = 11


def cfg_for(h_kv: int) -> LlamaConfig:
    return LlamaConfig(d_model=64, n_heads=8, n_kv_heads=h_kv, d_head=8, d_ffn=96, n_layers=2, norm_eps=1e-6,
                       vocab_size=100)


def hf_model(cfg: LlamaConfig, causal_lm: bool = False):
    """A random transformers LlamaModel in float64, norms non-trivial; RMSNorm and the rotary tables kept in
    float64 (transformers computes both in float32 by design, which would cap agreement near 1e-7); SDPA attention,
    because the eager path takes its softmax in float32 too."""
    from transformers import LlamaConfig as HFConfig, LlamaForCausalLM, LlamaModel
    from transformers.models.llama import modeling_llama as ml

    torch.manual_seed(0)
    model = (LlamaForCausalLM if causal_lm else LlamaModel)(HFConfig(hidden_size=cfg.d_model, intermediate_size=cfg.d_ffn, num_attention_heads=cfg.n_heads,
                                num_key_value_heads=cfg.n_kv_heads, num_hidden_layers=cfg.n_layers,
                                rms_norm_eps=cfg.norm_eps, vocab_size=cfg.vocab_size, head_dim=cfg.d_head,
                                rope_theta=cfg.rope_theta, attn_implementation="sdpa")).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))

    return exact_norms_and_rope(model, ml.LlamaRMSNorm, ml.LlamaRotaryEmbedding, cfg.d_head, cfg.rope_theta)


LENGTHS = [4, N - 4]  # two requests flattened into one forward; each starts at position 0


def dense_stack(cfg: LlamaConfig, state: dict) -> DenseStack:
    return load_stack(DenseStack(cfg, torch.float64), state)


@functools.lru_cache(maxsize=None)
def transformers_reference(h_kv: int):
    """(state dict, x [N, d], every layer's output for the two requests) from transformers' LlamaModel, each
    request run alone; the last layer's output before the final norm (transformers returns it after)."""
    cfg = cfg_for(h_kv)
    model = hf_model(cfg)
    x = torch.randn(N, cfg.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    outs = []
    with torch.no_grad():
        for s, e in Requests.from_lengths(LENGTHS).spans:
            hidden = list(model(inputs_embeds=x[None, s:e], output_hidden_states=True).hidden_states[1:])
            outs.append(hidden)
    return model.state_dict(), x, [torch.cat([o[i][0] for o in outs]) for i in range(cfg.n_layers)]


def errors(ours, theirs, final_norm) -> list[float]:
    ours = list(ours)
    ours[-1] = final_norm(ours[-1])  # transformers' last hidden state is after the final norm
    return [float((a - b).abs().max() / b.abs().max()) for a, b in zip(ours, theirs)]


def final_norm(cfg, state) -> RMSNorm:
    norm = RMSNorm(cfg.d_model, cfg.norm_eps, torch.float64)
    norm.load_state_dict({"weight": state["norm.weight"]})
    return norm


@pytest.mark.parametrize("h_kv", [1, 2, 8])
def test_dense_llama_equals_transformers_per_layer(h_kv):
    cfg = cfg_for(h_kv)
    state, x, theirs = transformers_reference(h_kv)
    with torch.no_grad():
        ours = dense_stack(cfg, state)(x, Requests.from_lengths(LENGTHS).cu_seqlens)
        assert max(errors(ours, theirs, final_norm(cfg, state))) < 1e-12


def _tp_against_transformers(ctx, h_kv, state, x, theirs):
    cfg = cfg_for(h_kv)
    tp = shard_stack(dense_stack(cfg, state), "v2", ctx.group)
    with torch.no_grad():
        ours = tp(x, Requests.from_lengths(LENGTHS).cu_seqlens)
        return errors(ours, theirs, final_norm(cfg, state)), tp.blocks[0].kv_heads


@pytest.mark.parametrize("h_kv", [1, 2, 8])
@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_tp_llama_equals_transformers_at_every_p(p, h_kv):
    """The TP stack (sharded from transformers' weights) against transformers' own layer outputs; p = 4, 8 with
    h_kv = 1, 2 replicate K,V heads; p = h_kv and p < h_kv split them."""
    for errs, kv_heads in run_ranks(p, _tp_against_transformers, h_kv, *transformers_reference(h_kv)):
        assert max(errs) < 1e-12
        assert kv_heads == max(h_kv // p, 1)  # replicated once p > h_kv: one K,V head per rank


def test_kv_heads_per_rank_and_replication():
    cfg = cfg_for(2)
    assert [list(kv_heads_of_rank(cfg, r, 1)) for r in range(1)] == [[0, 1]]
    assert [list(kv_heads_of_rank(cfg, r, 2)) for r in range(2)] == [[0], [1]]
    assert [list(kv_heads_of_rank(cfg, r, 4)) for r in range(4)] == [[0], [0], [1], [1]]  # each on p/h_kv = 2 ranks
    # every rank's query heads read the K,V head it holds: query head j uses K,V head j // (h / h_kv)
    for p in (1, 2, 4, 8):
        for r in range(p):
            q = range(r * 8 // p, (r + 1) * 8 // p)
            assert {j // 4 for j in q} <= set(kv_heads_of_rank(cfg, r, p))


def test_invalid_head_splits_fail_with_the_valid_list():
    assert valid_llama_tp_sizes(cfg_for(2), 8) == [1, 2, 4, 8]
    with pytest.raises(ConfigError, match="valid tensor-parallel sizes: 1, 2, 4, 8"):
        validate_llama(cfg_for(2), 3)
    with pytest.raises(ConfigError, match="must be a multiple of n_kv_heads=3"):
        validate_llama(cfg_for(3), 1)
    odd = LlamaConfig(d_model=48, n_heads=6, n_kv_heads=4, d_head=8, d_ffn=96)
    with pytest.raises(ConfigError):
        validate_llama(odd, 1)


def _llama_ledger(ctx):
    from tp.ledger import TrafficLedger
    from tp.traffic_model import PHASES, predict

    cfg = cfg_for(2)
    stack = shard_stack(DenseStack(cfg, torch.float64), "v2", ctx.group)
    ledger = TrafficLedger(ctx.world_size)
    x = torch.randn(N, cfg.d_model, dtype=torch.float64, requires_grad=True)
    with ledger.attach(stack):
        stack(x)[-1].sum().backward()
    return all(Counter(r.traffic() for r in ledger.records if r.phase == ph)  # backward: layers in reverse
               == Counter(predict(cfg, ctx.world_size, N, torch.float64, "v2", ph)) for ph in PHASES), \
        len(ledger.records)


@pytest.mark.parametrize("p", [2, 4])
def test_tp_llama_traffic_is_the_megatron_pattern(p):
    """GQA changes nothing on the wire: 2 all-reduces of [n, d] per block forward and backward (the input
    gradients of qkv and gate_up), the model's v2 prediction exactly."""
    for same, count in run_ranks(p, _llama_ledger):
        assert same and count == 2 * 2 * 2


# ---- serving ------------------------------------------------------------------------------------------------------

WORKLOAD = [(11, 6, 0), (5, 7, 0), (14, 5, 1), (2, 6, 2)]  # (prompt, max_new_tokens, arrival)


@pytest.fixture(scope="module")
def llama_lm():
    from layers.models.hf_llama import load_lm
    from layers.models.lm import DenseLlamaLM, greedy_reference

    cfg = cfg_for(2)
    model = hf_model(cfg, causal_lm=True)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n, _, _ in WORKLOAD]
    dense = load_lm(DenseLlamaLM(cfg, torch.float64), model.state_dict())
    want = []
    for prompt, (_, new, _) in zip(prompts, WORKLOAD):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                                 num_beams=1)
        ref = greedy_reference(dense, prompt, new)
        assert out[0, len(prompt):].tolist() == ref.ids  # the dense oracle and transformers agree
        assert min(ref.margins) > 1e-9, "near-tie in the oracle: pick another seed"
        want.append(ref.ids)
    return model.state_dict(), prompts, want


def _serve_llama(ctx, state, prompts):
    from layers.models.hf_llama import load_lm
    from layers.models.lm import DenseLlamaLM, shard_lm
    from serve.offline import OfflineEngine
    from serve.config import EngineConfig
    from serve.request import Request

    cfg = cfg_for(2)
    lm = shard_lm(load_lm(DenseLlamaLM(cfg, torch.float64), state), "v2", ctx.group)
    reqs = [Request(i, p, new, a) for i, (p, (_, new, a)) in enumerate(zip(prompts, WORKLOAD))]
    res = OfflineEngine(lm, ctx, EngineConfig(long_prefill_token_threshold=4, max_num_batched_tokens=10, max_num_seqs=10)).run(reqs)
    mixed = any(it["decodes"] and it["prefill_chunks"] for it in res.iterations)
    after_prefix = any(kv > qe - qs > 1 for it in res.iterations for _, qs, qe, kv in it["triples"])
    return ([r["output_ids"] for r in res.requests], res.ledger_matches_model, mixed and after_prefix,
            res.kv_bytes_per_token_per_rank)


@pytest.mark.parametrize("p", [1, 2, 4])
def test_served_llama_tokens_equal_transformers_generate(llama_lm, p):
    """Chunked prefill after cached prefixes and mixed iterations; at p = 4 the two K,V heads are replicated."""
    state, prompts, want = llama_lm
    for ids, ledger_ok, exercised, kv_per_token in run_ranks(p, _serve_llama, state, prompts):
        assert ids == want and ledger_ok and exercised
        assert kv_per_token == 2 * 2 * max(2 // p, 1) * 8 * 8  # 2·L·max(h_kv/p, 1)·d_head·e: stops shrinking at p = h_kv


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rope_in_half_precision_keeps_positions_apart(dtype):
    """Positions 256 and 257 (and 2048, 2049) rotate differently in bfloat16/float16: the angles are float32."""
    from layers.models.llama import rope, rope_tables

    x = torch.randn(2, 4, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    positions = torch.tensor([256, 257, 2048, 2049])
    exact = rope(x, *rope_tables(positions, 32, 10000.0, torch.float64))
    half = rope(x.to(dtype), *rope_tables(positions, 32, 10000.0, dtype)).double()
    assert not torch.equal(half[:, 0], half[:, 1]) and not torch.equal(half[:, 2], half[:, 3])
    assert (half - exact).abs().max() / exact.abs().max() < (2e-2 if dtype == torch.bfloat16 else 3e-3)
