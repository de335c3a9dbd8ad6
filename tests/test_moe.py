"""Mixture-of-experts blocks (layers/models/moe.py): the dense block against transformers' Mixtral, the three placements
against the dense block, and the all-to-all bytes against the model computed from the routing."""

from __future__ import annotations

import functools

import pytest
import torch

from layers.attention.varlen import Requests
from layers.models.dense import DenseStack, Stack
from layers.models.hf import load_stack
from layers.models.moe import MoEConfig, dense_routing as routing, moe_block, route
from layers.parallel.shard import DenseSource, load_plan
from tests.common import exact_rms_forward, patch_forwards
from tests.harness import run_ranks

CFG = MoEConfig(d_model=64, n_heads=8, n_kv_heads=2, d_head=8, d_ffn=48, n_layers=2, max_seq_len=64,
                vocab_size=100, norm_eps=1e-6, n_experts=8, top_k=2)
LENGTHS = [5, 9, 3, 7, 1, 6]  # six requests; under ep_a2a rank r holds requests r, r + p, ...


@functools.lru_cache(maxsize=None)
def hf_mixtral(cfg: MoEConfig):
    """A random transformers MixtralModel in float64. Patched to stay in float64 where transformers computes in
    float32 by design: RMSNorm, the rotary tables, and the router's softmax (MixtralTopKRouter casts the logits to
    float32). SDPA attention (the eager path's softmax is float32 too)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral import modeling_mixtral as mm

    torch.manual_seed(0)
    model = transformers.MixtralModel(transformers.MixtralConfig(
        hidden_size=cfg.d_model, intermediate_size=cfg.d_ffn, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.d_head, num_hidden_layers=cfg.n_layers,
        num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.top_k, rms_norm_eps=cfg.norm_eps,
        vocab_size=cfg.vocab_size, rope_theta=cfg.rope_theta, attn_implementation="sdpa",
        experts_implementation="eager")).double().eval()  # the per-expert loop: grouped_mm has no float64
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.1 if "norm" in name else 0.2)).add_(1.0 if "norm" in name else 0.0)

    def rotary_forward(self, x, position_ids):
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.d_head, 2, dtype=torch.float64) / cfg.d_head)
        emb = torch.cat([position_ids[..., None].double() * inv] * 2, dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    def router_forward(self, h):
        logits = torch.nn.functional.linear(h.reshape(-1, self.hidden_dim), self.weight)
        top, ids = torch.softmax(logits, dim=-1).topk(self.top_k, dim=-1)  # float64, not float32
        return logits, top / top.sum(dim=-1, keepdim=True), ids

    return patch_forwards(model, {mm.MixtralRMSNorm: exact_rms_forward, mm.MixtralRotaryEmbedding: rotary_forward,
                                  mm.MixtralTopKRouter: router_forward})


def dense_stack(cfg: MoEConfig, state: dict) -> DenseStack:
    return load_stack(DenseStack(cfg, torch.float64), state)


def test_dense_moe_block_equals_transformers_mixtral_per_layer():
    model = hf_mixtral(CFG)
    x = torch.randn(sum(LENGTHS), CFG.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    requests = Requests.from_lengths(LENGTHS)
    stack = dense_stack(CFG, model.state_dict())
    with torch.no_grad():
        ours = stack(x, requests.cu_seqlens)
        for (s, e) in requests.spans:  # transformers: each request alone, positions from 0
            hidden = model(inputs_embeds=x[None, s:e], output_hidden_states=True).hidden_states[1:]
            for i in range(CFG.n_layers - 1):  # its last hidden state is after the final norm
                theirs = hidden[i][0]
                assert float((ours[i][s:e] - theirs).abs().max() / theirs.abs().max()) < 1e-12
            last = model.norm(ours[-1][s:e])
            assert float((last - hidden[-1][0]).abs().max() / hidden[-1][0].abs().max()) < 1e-12
    assert routing(stack, x, requests)[1] > 1e-6  # no routing here is a near-tie


def test_route_renormalizes_the_top_k_and_breaks_ties_as_transformers():
    """Exact ties go as torch.topk sends them, because transformers' router is torch.topk on the same numbers. That
    is not "lowest id first": torch.topk returns the tied pair (0, 4) as [4, 0] here, and for ties across the k-th
    place it can keep a higher id. Real routings are not exact ties; near ones are guarded (routing())."""
    h = torch.zeros(3, 4, dtype=torch.float64)
    h[1, 0] = 1.0
    router = torch.eye(4, dtype=torch.float64)[[0, 1, 2, 3, 0, 1]]  # experts 0 and 4 (1 and 5, ...) tie exactly
    weights, ids = route(h, router, 2)
    assert torch.allclose(weights.sum(-1), torch.ones(3, dtype=torch.float64))
    probs = torch.softmax(h @ router.T, -1)
    assert torch.equal(ids, probs.topk(2, dim=-1).indices)  # the same op on the same numbers as transformers
    assert sorted(ids[1].tolist()) == [0, 4] and torch.equal(weights[1], torch.full((2,), 0.5, dtype=torch.float64))


# ---- the three placements against the dense block ----------------------------------------------------------


def biased(stack: Stack, scale: float) -> Stack:
    """Push the router towards experts 0 and 1 (scale 0: unchanged): with a large scale every token picks them,
    so at p = 4 only rank 0 holds an expert any token uses."""
    with torch.no_grad():
        for block in stack.blocks:
            block.router[0] += scale * torch.ones(block.cfg.d_model, dtype=block.router.dtype)
            block.router[1] += 0.9 * scale * torch.ones(block.cfg.d_model, dtype=block.router.dtype)
    return stack


def inputs(cfg: MoEConfig, shift: float) -> torch.Tensor:
    """x [T, d]: random rows plus `shift` along the all-ones direction (which the biased router rewards)."""
    gen = torch.Generator().manual_seed(2)
    return torch.randn(sum(LENGTHS), cfg.d_model, dtype=torch.float64, generator=gen) + shift


def my_requests(rank: int, p: int) -> list[int]:
    return list(range(rank, len(LENGTHS), p))


def _placements(ctx, state, scale: float, shift: float):
    from tests.syncs import SyncCounter
    from tp.ledger import TrafficLedger
    from tp.traffic_model import predict_moe_layer

    p, rank = ctx.world_size, ctx.rank
    dense = biased(dense_stack(CFG, state), scale)
    x = inputs(CFG, shift)
    requests = Requests.from_lengths(LENGTHS)
    with torch.no_grad():
        want = dense(x, requests.cu_seqlens)
    ids, gap = routing(dense, x, requests)
    held = [torch.cat([torch.arange(*requests.spans[i]) for i in my_requests(s, p)] or
                      [torch.zeros(0, dtype=torch.long)]) for s in range(p)]  # ep_a2a: each rank's own tokens
    out = {"gap": gap, "received": [[int(sum((layer[held[s]] // (CFG.n_experts // p) == r).sum() for s in range(p)))
                                     for r in range(p)] for layer in ids]}
    for placement in ("tp", "ep", "ep_a2a"):
        blocks = [moe_block(CFG, placement, ctx.group, torch.float64) for _ in range(CFG.n_layers)]
        stack = Stack(CFG, [load_plan(b, b.plan(), DenseSource(d)) for b, d in zip(blocks, dense.blocks)])
        ledger, waits = TrafficLedger(p), SyncCounter()
        if placement == "ep_a2a":  # this rank's own requests only
            spans = [requests.spans[i] for i in my_requests(rank, p)]
            rows = torch.cat([torch.arange(s, e) for s, e in spans]) if spans else torch.zeros(0, dtype=torch.long)
            lengths = [e - s for s, e in spans]
            cu = Requests.from_lengths(lengths).cu_seqlens if len(lengths) > 1 else None
            with torch.no_grad(), ledger.attach(stack), waits.counting():
                got = stack(x[rows], cu) if lengths else stack(x[rows])
        else:
            rows = torch.arange(x.shape[0])
            with torch.no_grad(), ledger.attach(stack), waits.counting():
                got = stack(x, requests.cu_seqlens)
        err = max(float((g - w[rows]).abs().max()) / float(w.abs().max()) if len(rows) else 0.0
                  for g, w in zip(got, want))
        predicted = []
        for i, layer in enumerate(ids):
            predicted += predict_moe_layer(CFG, placement, p, rank, i, torch.float64,
                                           [layer[h] for h in held], n=x.shape[0])
        out[placement] = {"err": err, "ledger_matches_model": [r.traffic() for r in ledger.records] == predicted,
                          "kinds": sorted({(r.kind, r.site) for r in ledger.records}), "waits": dict(waits.device)}
    return out


@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_every_placement_equals_the_dense_block(p):
    transformers_state = hf_mixtral(CFG).state_dict()
    for scale, shift in ((0.0, 0.0), (0.5, 3.0)):  # plain, then a router biased to experts 0 and 1
        results = run_ranks(p, _placements, transformers_state, scale, shift)
        assert results[0]["gap"] > 1e-6  # the near-tie guard: no routing here could flip by rounding
        for rank, res in enumerate(results):
            for placement in ("tp", "ep", "ep_a2a"):
                r = res[placement]
                assert r["err"] < 1e-12, (p, scale, rank, placement, r["err"])
                assert r["ledger_matches_model"], (p, scale, rank, placement)
                # one host wait per MoE layer, the group sizes (no bincount or boolean mask waiting inside C++)
                assert r["waits"] == {"tolist": CFG.n_layers}, (p, placement, rank, r["waits"])
        received = results[0]["received"]  # per layer, the pairs each rank's experts get under ep_a2a
        if p > 1:
            assert results[0]["ep_a2a"]["kinds"] == [("all_to_all", s) for s in
                                                     ("combine", "dispatch", "dispatch counts", "dispatch experts")]
            assert all(len(set(layer)) > 1 for layer in received)  # unequal split sizes
        if scale and p >= 4:  # every pair goes to experts 0 and 1: the ranks holding them, and no other rank
            holders = {0, 1 // (CFG.n_experts // p)}
            assert all(sum(layer[r] for r in holders) == 2 * sum(LENGTHS) and
                       not any(n for r, n in enumerate(layer) if r not in holders) for layer in received), received


# ---- run_block with model=mixtral_tiny --------------------------------------------------------------------


def test_run_block_checks_every_placement_of_mixtral_tiny(tmp_path):
    import json

    from tests.launching import launch_on_pool

    proc, _ = launch_on_pool(4, "model=mixtral_tiny", "repeats=1", run_dir=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["equivalent"] and report["traffic_ok"] and list(report["placements"]) == ["tp", "ep", "ep_a2a"]
    a2a = report["placements"]["ep_a2a"]
    assert a2a["tokens_per_rank"] == [10, 30, 0, 0]  # requests [10, 30]: ranks 2 and 3 hold none
    assert a2a["collectives_per_layer_count"] == 4 and report["placements"]["tp"]["collectives_per_layer_count"] == 2
    # the bytes follow the routing: ranks move different amounts, around the seed's uniform estimate
    moved = a2a["a2a_sent_plus_received_per_rank_per_layer"]
    assert len(set(moved)) > 1 and 0.5 < sum(moved) / len(moved) / a2a["seed_estimate_per_rank_per_layer"] < 1.5
    assert "the seed's uniform-routing estimate" in proc.stdout and "PASS: moe_parallel tp, ep, ep_a2a" in proc.stdout


BAD = [
    (["moe_parallel=ep", "model.n_experts=6"], 4, "moe_parallel=ep: model.n_experts=6 is not divisible by p=4"),
    (["moe_parallel=ep_a2a", "model.n_experts=6"], 4, "moe_parallel=ep_a2a: model.n_experts=6 is not divisible"),
    (["model.top_k=9"], 2, "model.top_k=9 must be between 1 and model.n_experts=8"),
    (["moe_parallel=dp"], 2, "unknown moe_parallel 'dp'; choose tp, ep or ep_a2a"),
    (["variants=[v1]"], 2, "variants= cuts a dense FFN; MoE blocks take moe_parallel"),
]


@pytest.mark.parametrize("overrides,world,message", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_moe_settings_fail_in_one_line(overrides, world, message):
    from tests.launching import refused

    refused(["model=mixtral_tiny", *overrides], message, world, "run_block.py")


def test_moe_parallel_on_a_dense_model_is_refused():
    from tests.launching import refused

    refused(["moe_parallel=ep"], "moe_parallel=ep is for MoE models (model=mixtral_tiny)", script="run_block.py")


# ---- serving: tokens against transformers' MixtralForCausalLM.generate -------------------------------------

SERVE_WORKLOAD = [(6, 6), (11, 5), (3, 6), (9, 4)]  # (prompt length, max_new_tokens)


@pytest.fixture(scope="module")
def mixtral_lm():
    """A random MixtralForCausalLM (float64, patched as hf_mixtral), its greedy generate, and its state dict."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral import modeling_mixtral as mm

    base = hf_mixtral(CFG)  # the patched decoder stack, reused inside a causal LM
    model = transformers.MixtralForCausalLM(base.config).double().eval()
    model.model = base
    with torch.no_grad():
        model.lm_head.weight.copy_(torch.randn_like(model.lm_head.weight))
    assert all(isinstance(m, mm.MixtralTopKRouter) for m in model.modules() if "Router" in type(m).__name__)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, CFG.vocab_size, (n,), generator=gen).tolist() for n, _ in SERVE_WORKLOAD]
    want = []
    for prompt, (_, new) in zip(prompts, SERVE_WORKLOAD):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                                 num_beams=1, eos_token_id=None, pad_token_id=0)
        want.append(out[0, len(prompt):].tolist())
    return model.state_dict(), prompts, want


def _serve_mixtral(ctx, state, prompts, placement):
    from layers.models.hf import load_lm
    from layers.models.lm import dense_lm, shard_lm
    from serve.offline import OfflineEngine
    from serve.config import EngineConfig
    from serve.request import Request

    dense = load_lm(dense_lm(CFG, torch.float64), state)
    lm = shard_lm(dense, "v2", ctx.group, moe_parallel=placement)
    reqs = [Request(i, p, new, i) for i, (p, (_, new)) in enumerate(zip(prompts, SERVE_WORKLOAD))]
    res = OfflineEngine(lm, ctx, EngineConfig(long_prefill_token_threshold=4, max_num_batched_tokens=12, max_num_seqs=12)).run(reqs)
    return [r["output_ids"] for r in res.requests], res.ledger_matches_model


@pytest.mark.parametrize("p", [1, 4])
def test_served_mixtral_tokens_equal_transformers_generate(mixtral_lm, p):
    """tp and ep on the serving engine (chunked prefill, mixed iterations, paged KV): greedy tokens equal
    transformers' generate; every iteration's collectives equal the model's (the routing does not change them).
    p = 2, tp and ep, runs through LLM.generate with text prompts (tests/test_llm.py)."""
    state, prompts, want = mixtral_lm
    for placement in ("tp", "ep"):
        got, ledger_ok = run_ranks(p, _serve_mixtral, state, prompts, placement)[0]
        assert got == want, (p, placement)
        assert ledger_ok


def test_serve_mixtral_tiny_with_whole_experts_per_rank(tmp_path):
    import json

    from tests.launching import launch_on_pool

    proc, _ = launch_on_pool(4, "model=mixtral_tiny", "moe_parallel=ep", "prompt_count=4", "prompt_mean=8",
                             "max_new_tokens=4", run_dir=tmp_path, script="serve.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["config"]["moe_parallel"] == "ep" and report["check"]["ok"] is True
    assert report["ledger_matches_model"] and "8 experts of ffn=192, top_k=2, moe_parallel=ep" in proc.stdout


@pytest.mark.parametrize("overrides,message", [
    (["model=mixtral_tiny", "moe_parallel=ep_a2a"], "moe_parallel=ep_a2a is not served: data-parallel attention"),
    (["model=mixtral_tiny", "moe_parallel=ep", "model.n_experts=3"], "model.n_experts=3 is not divisible by p=2"),
    (["moe_parallel=tp"], "moe_parallel=tp is for MoE models"),
])
def test_bad_moe_serving_settings_fail_in_one_line(overrides, message):
    from tests.launching import refused

    refused(overrides, message)


# ---- Mixtral checkpoints (save_pretrained's per-expert layout) --------------------------------------------


@pytest.fixture(scope="module")
def mixtral_ckpt(tmp_path_factory, mixtral_lm):
    """The served model above, saved sharded: block_sparse_moe.experts.<j>.w1/w2/w3 in several files."""
    transformers = pytest.importorskip("transformers")
    state, prompts, want = mixtral_lm
    model = transformers.MixtralForCausalLM(hf_mixtral(CFG).config).double()
    model.load_state_dict(state)
    path = tmp_path_factory.mktemp("mixtral") / "ckpt"
    model.save_pretrained(path, max_shard_size="60KB")
    return str(path), prompts, want


def _per_rank_against_dense(ctx, path):
    from layers.models.hf import CheckpointSource, load_lm, read_config, read_state
    from layers.models.lm import dense_lm, shard_lm

    cfg, out = read_config(path), {}
    for placement in ("tp", "ep"):
        ckpt = read_state(path)
        lazy = shard_lm(CheckpointSource(ckpt, cfg, torch.float64), "v2", ctx.group, moe_parallel=placement)
        ref = shard_lm(load_lm(dense_lm(cfg, torch.float64), read_state(path)), "v2", ctx.group,
                       moe_parallel=placement)
        mine, theirs = lazy.state_dict(), ref.state_dict()
        out[placement] = (all(torch.equal(mine[k], theirs[k]) for k in mine) and mine.keys() == theirs.keys(),
                          ckpt.bytes_read, sum(p.numel() * 8 for p in lazy.parameters()))
    return out


def test_a_saved_mixtral_loads_per_rank_bitwise_and_serves_transformers_tokens(mixtral_ckpt, tmp_path):
    import json

    from layers.models.checkpoint import Checkpoint
    from tests.launching import launch_on_pool

    path, prompts, want = mixtral_ckpt
    ckpt = Checkpoint(path)
    assert "model.layers.1.block_sparse_moe.experts.7.w2.weight" in ckpt and len(ckpt.files) > 3
    for rank in run_ranks(4, _per_rank_against_dense, path):  # vocab 100 over 4 ranks: no padding rows
        for placement, (same, read, held) in rank.items():
            assert same and read == held, (placement, read, held)  # ep: only its 2 experts' w1, w2, w3 read
    proc, _ = launch_on_pool(2, f"hf_checkpoint={path}", "moe_parallel=ep", "dtype=float64", "long_prefill_token_threshold=4",
                             f"prompts={json.dumps(prompts).replace(' ', '')}",
                             f"max_new_tokens={json.dumps([n for _, n in SERVE_WORKLOAD]).replace(' ', '')}",
                             run_dir=tmp_path / "serve", script="serve.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "serve" / "report.json").read_text())
    assert [r["output_ids"] for r in report["requests"]] == want and report["check"]["ok"] is True
    assert report["load"]["read_bytes"] == report["load"]["weights_bytes"]
    proc, _ = launch_on_pool(2, f"hf_checkpoint={path}", "moe_parallel=ep_a2a", "dtype=float64", "repeats=1",
                             run_dir=tmp_path / "block")
    assert proc.returncode == 0, proc.stdout + proc.stderr
