"""DeepSeek-V3's architecture (layers/models/mla.py, layers/models/hf_deepseek.py): the dense model against
transformers' DeepseekV3ForCausalLM, the absorbed decode against the decompressed attention over paged blocks, and the
served model (tp and ep, from a sharded save_pretrained checkpoint each rank reads its slices of) against transformers'
generate, with the latent pool's bytes and the ledger checked per step."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from layers.models.mla import DeepseekConfig, DenseDeepseekBlock, mla_attention, routing_margin, validate_deepseek
from tests.common import exact_rms_forward, patch_forwards
from tests.harness import run_ranks
from tp.dist import ConfigError

VOCAB = 96


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 0.8, "mscale_all_dim": 1.0, "rope_theta": 10000.0}


def yarn_inv_freq(r: int, theta: float, factor: float, original: int, fast: float, slow: float) -> torch.Tensor:
    """YaRN's frequencies in float64, written here from the paper's definition (as transformers' float32 code does):
    the dimensions turning more than `fast` times over the original context keep θ^(-2i/r), those turning fewer than
    `slow` times are divided by the factor, a linear ramp between."""
    i = torch.arange(0, r, 2, dtype=torch.float64)
    base = 1.0 / theta ** (i / r)
    dim = [r * math.log(original / (n * 2 * math.pi)) / (2 * math.log(theta)) for n in (fast, slow)]
    low, high = max(math.floor(dim[0]), 0), min(math.ceil(dim[1]), r - 1)
    ramp = ((torch.arange(r // 2, dtype=torch.float64) - low) / max(high - low, 0.001)).clamp(0, 1)
    return base / factor * ramp + base * (1 - ramp)


@functools.lru_cache(maxsize=None)
def hf_deepseek(q_lora: int | None = 32, interleave: bool = True, yarn: bool = False):
    """A random DeepseekV3ForCausalLM in float64 (3 layers: one dense, two DeepSeekMoE; 8 routed experts in 2 groups,
    top-2 from the best group, one shared expert; a random correction bias). Patched to stay in float64 where
    transformers computes in float32 by design: RMSNorm, the rotary tables, and the router (DeepseekV3TopkRouter casts
    h and its weight to float32). SDPA attention (the eager path's softmax is float32 too); the experts' eager loop
    (grouped_mm has no float64)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as md

    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5,
        kv_lora_rank=16, q_lora_rank=q_lora, qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32, n_group=2,
        topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=128,
        tie_word_embeddings=False, rope_interleave=interleave, attn_implementation="sdpa",
        experts_implementation="eager", **({"rope_parameters": dict(YARN)} if yarn else {}))
    model = transformers.DeepseekV3ForCausalLM(config).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.1 if "norm" in name else 0.2)).add_(1.0 if "norm" in name else 0.0)
        for m in model.modules():
            if isinstance(m, md.DeepseekV3TopkRouter):
                m.e_score_correction_bias.copy_(0.1 * torch.randn_like(m.e_score_correction_bias))
    r = config.qk_rope_head_dim

    def rotary_forward(self, x, position_ids):  # the frequencies in float64; transformers' attention_scaling kept
        inv = (yarn_inv_freq(r, 10000.0, YARN["factor"], YARN["original_max_position_embeddings"], YARN["beta_fast"],
                             YARN["beta_slow"]) if yarn else 1.0 / 10000.0 ** (torch.arange(0, r, 2, dtype=torch.float64) / r))
        emb = torch.cat([position_ids[..., None].double() * inv] * 2, dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)

    def router_forward(self, h):  # DeepseekV3TopkRouter.forward, in h's dtype
        logits = torch.nn.functional.linear(h.view(-1, self.hidden_dim), self.weight)
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        per = self.num_experts // self.num_group
        groups = choice.view(-1, self.num_group, per).topk(2, dim=-1)[0].sum(-1).topk(self.topk_group, -1, sorted=False)[1]
        keep = torch.zeros(choice.shape[0], self.num_group, dtype=torch.bool).scatter_(1, groups, True)
        choice = choice.masked_fill(~keep.repeat_interleave(per, dim=1), float("-inf"))
        ids = choice.topk(self.top_k, dim=-1, sorted=False)[1]
        w = scores.gather(1, ids)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) if self.norm_topk_prob else w
        return logits, w * self.routed_scaling_factor, ids

    return patch_forwards(model, {md.DeepseekV3RMSNorm: exact_rms_forward, md.DeepseekV3RotaryEmbedding: rotary_forward,
                                  md.DeepseekV3TopkRouter: router_forward})


def ours(model):
    from layers.models import hf_deepseek
    from layers.models.hf import config_from_hf
    from layers.models.lm import dense_lm

    cfg = config_from_hf(model.config.to_dict())
    return hf_deepseek.load_lm(dense_lm(cfg, torch.float64), model.state_dict())


@pytest.mark.parametrize("q_lora,interleave,yarn", [(32, True, False), (None, True, False), (32, False, False),
                                                   (32, True, True)],
                         ids=["q_lora", "no-q_lora", "rope-halves", "yarn"])
def test_dense_deepseek_equals_transformers(q_lora, interleave, yarn):
    """Logits of a prompt past YaRN's original context to 1e-12, with and without the low-rank queries, both rotary
    layouts, YaRN (its frequencies, the factor on cos/sin and the softmax scale's mscale²: transformers' own, the
    frequencies recomputed in float64 and held to transformers' float32 ones); no routing within 1e-6 of flipping."""
    model = hf_deepseek(q_lora, interleave, yarn)
    lm = ours(model)
    assert lm.cfg.q_lora_rank == (q_lora or 0) and lm.cfg.rope_interleave is interleave
    assert lm.cfg.rope_type == ("yarn" if yarn else "default")
    if yarn:
        rotary = model.model.rotary_emb
        assert rotary.attention_scaling != 1.0  # mscale 0.8 against mscale_all_dim 1.0
        float32 = yarn_inv_freq(16, 10000.0, 4.0, 16, 32.0, 1.0).float()
        torch.testing.assert_close(rotary.original_inv_freq.float(), float32, rtol=1e-6, atol=0)
    ids = torch.randint(0, VOCAB, (29,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = lm.logits(ids), model(ids[None]).logits[0]
        assert float((got - want).abs().max() / want.abs().max()) < 1e-12
        assert routing_margin(lm.stack.blocks, lm.embed(ids), None) > 1e-6


def test_the_router_is_group_limited_and_biased():
    """The correction bias moves the choice and not the weights; a group outside the topk_group best is never used
    even when it holds the best single expert."""
    from layers.models.mla import route_grouped

    cfg = DeepseekConfig(n_routed_experts=8, n_group=2, topk_group=1, top_k=2, routed_scaling_factor=2.0)
    router = torch.zeros(8, 4, dtype=torch.float64)
    h = torch.zeros(1, 4, dtype=torch.float64)
    h[0, 0] = 1.0
    router[:, 0] = torch.tensor([0.0, 0.1, 0.2, 0.3, 3.0, -2.0, -2.0, -2.0], dtype=torch.float64)
    bias = torch.zeros(8, dtype=torch.float64)
    weights, ids = route_grouped(h, router, bias, cfg)
    # group 0 (experts 0-3): best two sum ~1.14; group 1 (4-7): 0.95 + 0.12 ~1.07 -> group 0, though expert 4 is best
    assert sorted(ids[0].tolist()) == [2, 3]
    scores = torch.sigmoid(router[:, 0])
    assert torch.allclose(weights[0].sort().values, (scores[[2, 3]] / scores[[2, 3]].sum() * 2.0).sort().values)
    bias[4] = 0.5  # group 1 now wins; the bias picks, the unbiased score weighs
    weights, ids = route_grouped(h, router, bias, cfg)
    assert 4 in ids[0].tolist() and set(ids[0].tolist()) <= {4, 5, 6, 7}
    chosen = scores[ids[0]]
    assert torch.allclose(weights[0], chosen / chosen.sum() * 2.0)


# ---- absorbed == decompressed over the paged cache ----------------------------------------------------------


@pytest.mark.parametrize("prefill", ["decompressed", "absorbed"])
@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_absorbed_attention_over_paged_blocks_equals_decompressed(block_size, prefill, monkeypatch):
    """One MLA layer, three requests: iteration 1 writes their first chunks' latents (fresh prompt chunks); iteration
    2 runs a chunk after a cached prefix, a decode and a fresh prompt, in every attention backend. The absorbed
    outputs (MQA over the latent) equal the decompressed attention over each whole sequence to 1e-12 in float64;
    fresh prompt chunks attend decompressed (the served default) or absorbed like the rest."""
    import layers.models.mla
    from layers.attention.attention import PagedLayer
    from layers.attention.varlen import Requests
    from layers.models.dense import init_weights
    from serve.model_runner import prepare_step
    from serve.plan import ScheduledRequest, SchedulerOutput

    monkeypatch.setattr(layers.models.mla, "PREFILL", prefill)
    cfg = DeepseekConfig(q_lora_rank=0, n_layers=1, first_k_dense_replace=1)
    block = init_weights(DenseDeepseekBlock(cfg, 0, torch.float64), 3)
    gen = torch.Generator().manual_seed(4)
    lengths, first = [9, 6, 5], [4, 5, 0]  # iteration 1 computes `first` positions of each; iteration 2 the rest
    x = [torch.randn(n, cfg.d_model, generator=gen, dtype=torch.float64) for n in lengths]
    free = torch.randperm(40, generator=gen).tolist()
    tables = [tuple(free.pop() for _ in range(-(-n // block_size))) for n in lengths]
    with torch.no_grad():
        want = []
        for xi in x:  # decompressed, each request alone, no cache
            h = block.attn_norm(xi)
            want.append(mla_attention(block.queries(h), block.kv_a(h), block.kv_b.weight, cfg, block.kv_norm,
                                      Requests.from_lengths([len(xi)])))
        for mode in ("reference", "batched", "cpu"):
            pool = torch.zeros(1, 40 * block_size, 1, cfg.latent_dim, dtype=torch.float64)
            for it, (lo, hi) in enumerate([(None, first), (first, lengths)]):
                chunks = [ScheduledRequest(i, 0 if lo is None else lo[i], hi[i], decode=lo is not None and
                                           hi[i] - lo[i] == 1 and lo[i] > 0, sample=True, blocks=tables[i])
                          for i in range(3) if hi[i] > (0 if lo is None else lo[i])]
                chunks.sort(key=lambda c: not c.decode)  # decodes first, as the scheduler orders them
                plan = SchedulerOutput(it, tuple(chunks))
                step = prepare_step(plan, {i: [0] * n for i, n in enumerate(lengths)}, block_size, "cpu", mode)
                rows = torch.cat([x[c.request][c.q_start:c.q_end] for c in chunks])
                h = block.attn_norm(rows)
                got = mla_attention(block.queries(h), block.kv_a(h), block.kv_b.weight, cfg, block.kv_norm,
                                    PagedLayer(step.batch, pool))
                at = 0
                for c in chunks:
                    torch.testing.assert_close(got[at:at + c.q_rows], want[c.request][c.q_start:c.q_end],
                                               rtol=1e-12, atol=1e-12, msg=f"{mode} {c}")
                    at += c.q_rows


# ---- served against transformers' generate, from a sharded checkpoint ---------------------------------------------

WORKLOAD = [(6, 6), (11, 5), (3, 6), (9, 4)]  # (prompt length, max_new_tokens)


@pytest.fixture(scope="module")
def deepseek_ckpt(tmp_path_factory):
    """The q_lora model above saved sharded by save_pretrained (per-expert keys across several files), the prompts,
    and transformers' greedy generate of each."""
    model = hf_deepseek(32, True)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n, _ in WORKLOAD]
    want = [generate(model, prompt, new) for prompt, (_, new) in zip(prompts, WORKLOAD)]
    path = tmp_path_factory.mktemp("deepseek") / "ckpt"
    model.save_pretrained(path, max_shard_size="100KB")
    return str(path), prompts, want


def generate(model, prompt: list[int], new: int) -> tuple[list[int], list[float]]:
    """transformers' greedy generate: the tokens, and each one's logit from transformers' forward over the whole
    sequence in float64 (generate hands its logits out in float32)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                             num_beams=1, eos_token_id=None, pad_token_id=0)
        tokens = out[0, len(prompt):].tolist()
        logits = model(out[:, :-1]).logits[0, len(prompt) - 1:]
    return tokens, [float(logits[j, t]) for j, t in enumerate(tokens)]


def same(got, want) -> bool:
    """The same tokens, and each token's logit within 1e-12 (relative) of transformers'."""
    (tokens, logits), (want_tokens, want_logits) = got, want
    return tokens == want_tokens and all(abs(a - b) <= 1e-12 * max(1.0, abs(b)) for a, b in zip(logits, want_logits))


def _serve(ctx, path, prompts, placements, engine_kw, prefill="decompressed"):
    import layers.attention.backends as backends
    import layers.models.mla
    from layers.models.checkpoint import Checkpoint
    from layers.models.hf import CheckpointSource, read_config
    from layers.models.lm import shard_lm
    from serve.config import EngineConfig
    from serve.offline import OfflineEngine
    from serve.request import Request
    from tp.partition import mla_kv_bytes_per_token

    cfg = read_config(path)
    out, saved, layers.models.mla.PREFILL = {}, layers.models.mla.PREFILL, prefill
    ragged, backends.RAGGED_BELOW = backends.RAGGED_BELOW, 0 if engine_kw.get("attention") == "batched" else \
        backends.RAGGED_BELOW  # batched: every iteration's decodes in the ragged pass (the padded one: elsewhere)
    for placement in placements:
        lm = shard_lm(CheckpointSource(Checkpoint(path), cfg, torch.float64), "v2", ctx.group, moe_parallel=placement)
        reqs = [Request(i, p, new, i) for i, (p, (_, new)) in enumerate(zip(prompts, WORKLOAD))]
        res = OfflineEngine(lm, ctx, EngineConfig(**engine_kw)).run(reqs)
        formula = mla_kv_bytes_per_token(cfg.n_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim, 8)
        out[placement] = ([(r["output_ids"], r["logits"]) for r in res.requests], res.ledger_matches_model,
                          res.kv_bytes_per_token_per_rank == formula, res.preemptions)
    layers.models.mla.PREFILL, backends.RAGGED_BELOW = saved, ragged
    return out


@pytest.mark.parametrize("p,prefill,attention", [(1, "decompressed", "reference"), (2, "decompressed", "cpu"),
                                                 (2, "absorbed", "batched"), (4, "decompressed", "batched")])
def test_served_deepseek_tokens_equal_transformers_generate(deepseek_ckpt, p, prefill, attention):
    """tp and ep on the serving engine (chunked prefill, mixed iterations, the latent paged cache, each rank reading
    its slices of the files): greedy tokens and their logits (1e-12) equal transformers' generate, with prompts'
    first chunks attended decompressed or absorbed; every iteration's collectives equal the model's; the pool holds
    L·(c + r)·8 bytes per token on every rank, at every p; every attention backend (batched: its decodes in the
    ragged pass over the one-plane pool, whose values are narrower than its keys)."""
    path, prompts, want = deepseek_ckpt
    kw = dict(long_prefill_token_threshold=4, max_num_batched_tokens=12, max_num_seqs=12, block_size=4,
              attention=attention)
    for got, ledger_ok, bytes_ok, _ in run_ranks(p, _serve, path, prompts, ("tp", "ep"), kw, prefill)[0].values():
        assert all(same(g, w) for g, w in zip(got, want)) and ledger_ok and bytes_ok


def test_prefix_hits_and_preemption_leave_the_tokens_unchanged(deepseek_ckpt):
    """A pool too small for the four requests at once (preemption by recompute) and prefix caching, at p = 2."""
    path, prompts, _ = deepseek_ckpt
    shared = prompts[1][:8]
    prompts = [shared + p for p in prompts]
    model = hf_deepseek(32, True)
    want = [generate(model, prompt, new) for prompt, (_, new) in zip(prompts, WORKLOAD)]
    kw = dict(long_prefill_token_threshold=5, max_num_batched_tokens=16, max_num_seqs=16, block_size=4,
              num_gpu_blocks_override=7, enable_prefix_caching=True)
    got, ledger_ok, bytes_ok, preemptions = run_ranks(2, _serve, path, prompts, ("ep",), kw)[0]["ep"]
    assert preemptions > 0 and all(same(g, w) for g, w in zip(got, want)) and ledger_ok and bytes_ok


@pytest.mark.parametrize("change,placement,p,message", [
    (dict(n_heads=6), "tp", 4, "n_heads=6 cannot be split over p=4 ranks"),
    (dict(n_routed_experts=6, n_group=3), "ep", 4, "n_routed_experts=6 cannot be split over p=4"),
    (dict(n_group=3), "tp", 1, "n_routed_experts=8 must be n_group=3 groups of at least 2 experts"),
    (dict(top_k=5), "tp", 1, "top_k=5 exceeds the experts in topk_group=1 groups of 4"),
    (dict(), "ep_a2a", 2, "moe_parallel='ep_a2a' is not built for DeepSeek models"),
])
def test_bad_deepseek_layouts_are_refused_by_name(change, placement, p, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_deepseek(DeepseekConfig(**change), p, placement)


def test_other_rope_scalings_are_refused_not_served_wrong():
    from layers.models.hf import config_from_hf

    hf = hf_deepseek(32, True).config.to_dict()
    hf["rope_parameters"] = {"rope_type": "longrope", "factor": 4.0, "rope_theta": 10000.0}
    with pytest.raises(ConfigError, match="rope_type='longrope' is not supported"):
        config_from_hf(hf)
    hf["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    with pytest.raises(ConfigError, match="yarn needs original_max_position_embeddings"):
        config_from_hf(hf)


def test_serve_launcher_with_deepseek_tiny(tmp_path):
    """launch/serve.py model=deepseek_tiny at p = 4 with whole experts per rank: the oracle check passes, the ledger
    equals the model every iteration, and each rank's pool holds the whole latent, L·(c + r)·4 bytes per token."""
    import json

    from tests.launching import launch_on_pool

    proc, _ = launch_on_pool(4, "model=deepseek_tiny", "moe_parallel=ep", "prompt_count=4", "prompt_mean=8",
                             "max_new_tokens=4", run_dir=tmp_path, script="serve.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["check"]["ok"] is True and report["ledger_matches_model"]
    kv = report["kv_cache"]
    assert kv["bytes_per_token_per_rank"] == kv["formula_bytes_per_token_per_rank"] == 3 * (16 + 16) * 4
    assert report["config"]["moe_parallel"] == "ep" and "the latent whole on every rank" in proc.stdout


@pytest.mark.parametrize("overrides,script,message", [
    (["model=deepseek_tiny"], "run_block.py", "DeepSeek-V3 blocks are checked by serving them"),
    (["model=deepseek_tiny", "moe_parallel=ep_a2a"], "serve.py", "moe_parallel=ep_a2a is not served"),
    (["model=deepseek_tiny", "model.n_heads=3"], "serve.py", "n_heads=3 cannot be split over p=2 ranks"),
    (["model=deepseek_tiny", "pp=2"], "serve.py", "pp=2 with an MoE model is not built"),
])
def test_bad_deepseek_settings_fail_in_one_line(overrides, script, message):
    from tests.launching import refused

    refused(overrides, message, script=script)


def test_the_toy_deepseek_v3_is_served_as_transformers_generates_it(tmp_path):
    """python -m serve.toy_model --family deepseek_v3 (MLA with a query LoRA, one dense layer, then DeepSeekMoE; the
    toy BPE): LLM at tensor_parallel_size 2 gives transformers' greedy tokens and text."""
    from layers.models.hf import read_config
    from serve import LLM, SamplingParams
    from serve.toy_model import main
    from tests.test_llm import hf_generate

    path, prompts = tmp_path / "deepseek_v3", ["Once upon a time", "café über 中文"]
    assert main([str(path), "--family", "deepseek_v3"]) == 0
    cfg = read_config(path)
    assert cfg.family == "deepseek_v3" and cfg.q_lora_rank > 0 and cfg.moe_layer(1) and not cfg.moe_layer(0)
    want, tok = hf_generate(path, prompts, 10)
    with LLM(str(path), tensor_parallel_size=2, dtype="float64") as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10))
    assert [o.outputs[0].token_ids for o in outs] == want
    assert [o.outputs[0].text for o in outs] == [tok.decode(ids, skip_special_tokens=True) for ids in want]
