"""Llama-family blocks (SPEC §9): the dense block against transformers' LlamaModel, the TP block against the dense
one at every valid p, including K,V heads replicated once p exceeds h_kv. float64."""

import pytest
import torch

from layers.llama import (DenseLlamaBlock, LlamaConfig, RMSNorm, TPLlamaBlock, kv_heads_of_rank, load_hf_llama_block,
                          valid_llama_tp_sizes, validate_llama)
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

    def rms_forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def rotary_forward(self, x, position_ids):
        dh = cfg.d_head
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, dh, 2, dtype=torch.float64) / dh)
        freqs = position_ids[..., None].to(torch.float64) * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    for module in model.modules():
        if isinstance(module, ml.LlamaRMSNorm):
            module.forward = rms_forward.__get__(module)
        if isinstance(module, ml.LlamaRotaryEmbedding):
            module.forward = rotary_forward.__get__(module)
    return model


def dense_blocks(cfg: LlamaConfig, model) -> list[DenseLlamaBlock]:
    state = model.state_dict()
    return [load_hf_llama_block(DenseLlamaBlock(cfg, torch.float64), state, f"layers.{i}.") for i in range(cfg.n_layers)]


def layer_outputs(blocks, x, positions, spans):
    outs = []
    for b in blocks:
        x = b(x, positions, spans)
        outs.append(x)
    return outs


@pytest.mark.parametrize("h_kv", [1, 2, 8])
def test_dense_llama_equals_transformers_per_layer(h_kv):
    cfg = cfg_for(h_kv)
    model = hf_model(cfg)
    x = torch.randn(1, N, cfg.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = model(inputs_embeds=x, output_hidden_states=True).hidden_states
        ours = layer_outputs(dense_blocks(cfg, model), x[0], torch.arange(N), [(0, N)])
        norm = RMSNorm(cfg.d_model, cfg.norm_eps, torch.float64)
        norm.weight.copy_(model.norm.weight)
        ours[-1] = norm(ours[-1])  # transformers' last hidden state is after the final norm
    for i, (a, b) in enumerate(zip(ours, theirs[1:])):
        assert (a - b[0]).abs().max() / b.abs().max() < 1e-12, f"layer {i}"


def _tp_against_dense(ctx, h_kv):
    cfg = cfg_for(h_kv)
    torch.manual_seed(0)
    dense = [DenseLlamaBlock(cfg, torch.float64) for _ in range(cfg.n_layers)]
    with torch.no_grad():
        for b in dense:
            for p in b.parameters():
                p.copy_(torch.randn_like(p) * (0.1 if p.dim() == 2 else 1.0) + (1.0 if p.dim() == 1 else 0.0))
    tp = [TPLlamaBlock(cfg, ctx.group, torch.float64).load_dense(b) for b in dense]
    x = torch.randn(N, cfg.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    # two requests in one flat tensor, each with its own positions (the second starts at 0)
    positions, spans = torch.cat([torch.arange(4), torch.arange(N - 4)]), [(0, 4), (4, N)]
    with torch.no_grad():
        want = layer_outputs(dense, x, positions, spans)
        got = layer_outputs(tp, x, positions, spans)
    return [float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, want)], tp[0].kv_heads


@pytest.mark.parametrize("h_kv", [1, 2, 8])
@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_tp_llama_equals_dense_at_every_p(p, h_kv):
    for errors, kv_heads in run_ranks(p, _tp_against_dense, h_kv):
        assert max(errors) < 1e-12
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
    import torch.nn as nn

    from tp.ledger import TrafficLedger
    from tp.traffic_model import predict

    cfg = cfg_for(2)
    stack = nn.Module()
    stack.blocks = nn.ModuleList(TPLlamaBlock(cfg, ctx.group, torch.float64).load_dense(DenseLlamaBlock(cfg, torch.float64))
                                 for _ in range(cfg.n_layers))
    ledger = TrafficLedger(ctx.world_size)
    x = torch.randn(N, cfg.d_model, dtype=torch.float64)
    with torch.no_grad(), ledger.attach(stack):
        for b in stack.blocks:
            x = b(x, torch.arange(N), [(0, N)])
    return [r.traffic() for r in ledger.records] == predict(cfg, ctx.world_size, N, torch.float64, "v2"), \
        len(ledger.records)


@pytest.mark.parametrize("p", [2, 4])
def test_tp_llama_traffic_is_the_megatron_pattern(p):
    """GQA changes nothing on the wire: 2 all-reduces of [n, d] per block, the model's v2 prediction exactly."""
    for same, count in run_ranks(p, _llama_ledger):
        assert same and count == 2 * 2


# ---- serving ------------------------------------------------------------------------------------------------------

WORKLOAD = [(11, 6, 0), (5, 7, 0), (14, 5, 1), (2, 6, 2)]  # (prompt, max_new_tokens, arrival)


@pytest.fixture(scope="module")
def llama_lm():
    from layers.llama import DenseLlamaLM, load_hf_llama_lm
    from layers.lm import greedy_reference

    cfg = cfg_for(2)
    model = hf_model(cfg, causal_lm=True)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n, _, _ in WORKLOAD]
    dense = load_hf_llama_lm(DenseLlamaLM(cfg, torch.float64), model.state_dict())
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
    from layers.llama import DenseLlamaLM, load_hf_llama_lm, shard_llama_lm
    from serve.engine import Engine
    from serve.scheduler import Request

    cfg = cfg_for(2)
    lm = shard_llama_lm(load_hf_llama_lm(DenseLlamaLM(cfg, torch.float64), state), ctx.group)
    reqs = [Request(i, p, new, a) for i, (p, (_, new, a)) in enumerate(zip(prompts, WORKLOAD))]
    res = Engine(lm, ctx, chunk_size=4, max_batched_tokens=10).run(reqs)
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
