"""How a rank stores its matmul weights (layers/parallel/weight_format.py): the layout, and weight-only int8 under TP.

The int8 oracle is written here on its own: the dense model whose every matmul weight is quantized and dequantized
in groups along `in` (a row-parallel weight: p groups of in/p, each rank's slice; every other weight, the LM head
included: whole rows), scale = max |w| / 127 in the group, code = round(w / scale). The TP model with int8 shards equals
it to 1e-12 in float64 at p = 1 and 2 (GPT-2 with its tied head, Llama with GQA), logits and served tokens, and differs
from the unquantized model, and from the same oracle with whole-row groups for the row-parallel weights at p = 2 (the
checks can fail). The [in, out] layout changes strides, not values. The bytes stored equal the cost model's.
"""

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist

from layers.models.config import ModelConfig
from layers.models.dense import init_weights
from layers.models.lm import dense_lm, shard_lm
from layers.models.llama import LlamaConfig
from layers.parallel import weight_format
from serve.config import EngineConfig
from serve.engine import LLMEngine
from serve.sampling_params import SamplingParams
from tests.common import greedy_logprobs, step_engine
from tests.harness import run_ranks
from tp.cost_model import decode_weight_bytes

GPT2 = ModelConfig(d_model=64, n_heads=4, d_head=16, d_ffn=128, n_layers=2, max_seq_len=64, vocab_size=257)
LLAMA = LlamaConfig(d_model=64, n_heads=8, n_kv_heads=2, d_head=8, d_ffn=96, n_layers=2, max_seq_len=64,
                    vocab_size=257)
LLAMA_TIED = dataclasses.replace(LLAMA, tie_word_embeddings=True)
ROW_PARALLEL = ("attn_out.weight", "mlp_down.weight", "o.weight", "down.weight")  # the dense names cut along `in`
PROMPTS = [[5, 17, 250, 3, 99, 42, 7], [200, 1, 1, 64, 128, 31, 8, 9, 250, 11, 2]]


def fake_int8(dense, p: int, variant: str = "v2"):
    """The oracle: a copy of dense with every matmul weight quantized and dequantized (groups of in/p along `in` for
    v2's row-parallel weights, whole rows otherwise: v1 cuts every weight by its rows); norms, biases and GPT-2's
    position table untouched."""
    ref = copy.deepcopy(dense)
    with torch.no_grad():
        for name, w in ref.named_parameters():
            if w.dim() != 2 or name == "wpe.weight" or (name == "embed.weight" and not ref.cfg.tie_word_embeddings
                                                          and hasattr(ref, "lm_head")):
                continue  # a Llama's own token embedding is only looked up: stored as loaded
            groups = p if name.endswith(ROW_PARALLEL) and variant == "v2" else 1
            g = w.reshape(w.shape[0], groups, -1)
            scale = g.abs().amax(-1, keepdim=True) / 127
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))
            w.copy_((torch.round(g / scale).clamp(-127, 127) * scale).reshape(w.shape))
    return ref


def full_logits(lm, ids: torch.Tensor, group) -> torch.Tensor:
    """The TP model over one whole sequence with no cache: [n, V], the ranks' vocabulary slices gathered."""
    n = ids.shape[0]
    x = lm.embed_rows(ids, torch.arange(n))
    for block in lm.stack.blocks:
        x = block(x, None)
    local, _, head_group = lm.head_logits(x, torch.arange(n))
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=-1)[:, :lm.cfg.vocab_size]


@torch.no_grad()
def check_rank(ctx, cfg, variant, vocab_parallel):
    """On every rank: the int8 and in_out models' logits, the library's dequantized oracle, the bytes stored, and the
    served greedy tokens with their logprobs. Rank 0 returns what the test compares."""
    p = ctx.world_size
    dense = init_weights(dense_lm(cfg, torch.float64), seed=0, std=0.1)
    ids = torch.tensor(PROMPTS[1])
    int8 = weight_format.prepare(shard_lm(dense, variant, ctx.group, vocab_parallel), "int8", "auto")
    in_out = weight_format.prepare(shard_lm(dense, variant, ctx.group, vocab_parallel), None, "in_out")
    plain = shard_lm(dense, variant, ctx.group, vocab_parallel)
    out = {"int8": full_logits(int8, ids, ctx.group), "in_out": full_logits(in_out, ids, ctx.group),
           "plain": full_logits(plain, ids, ctx.group)}
    q = in_out.stack.blocks[0].qkv.weight
    out["in_out_strides"] = (tuple(q.shape) == tuple(plain.stack.blocks[0].qkv.weight.shape), q.stride())
    library = weight_format.dequantized(copy.deepcopy(dense), int8)
    out["library_oracle"] = {n: w.clone() for n, w in library.named_parameters()}
    out["bytes"] = [(weight_format.stored_bytes(lm), decode_weight_bytes(cfg, p, 8, quant, vocab_parallel))
                    for lm, quant in ((plain, None), (int8, "int8"))] if variant == "v2" else []
    engine = LLMEngine(int8, ctx, EngineConfig(block_size=4, max_num_seqs=2, long_prefill_token_threshold=5,
                                               num_gpu_blocks_override=16))
    done = {}

    def before(engine, step):
        if step == 0:
            for i, prompt in enumerate(PROMPTS):
                engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=6, logprobs=0))

    def sink(outputs, step):
        for o in outputs:
            if o.finished:
                c = o.outputs[0]
                done[o.request_id] = (c.token_ids, [lp[t] for lp, t in zip(c.logprobs, c.token_ids)])

    step_engine(engine, before, 0, sink)
    engine.shutdown()
    return out | {"served": done} if ctx.is_main else None


@pytest.mark.parametrize("cfg,p,variant,vocab_parallel", [
    (GPT2, 1, "v2", True), (GPT2, 2, "v2", True), (LLAMA, 2, "v2", True), (LLAMA_TIED, 2, "v2", True),
    (GPT2, 2, "v1", False)], ids=["gpt2-p1", "gpt2-p2", "llama-p2", "llama-tied-p2", "gpt2-v1-replicated-p2"])
def test_int8_shards_equal_the_dequantized_dense_model(cfg, p, variant, vocab_parallel):
    got = run_ranks(p, check_rank, cfg, variant, vocab_parallel)[0]
    dense = init_weights(dense_lm(cfg, torch.float64), seed=0, std=0.1)
    ref = fake_int8(dense, p, variant)
    ids = torch.tensor(PROMPTS[1])
    with torch.no_grad():
        want, unquantized = ref.logits(ids), dense.logits(ids)
    scale = unquantized.abs().max()
    assert (got["int8"] - want).abs().max() <= 1e-12 * scale
    assert (got["int8"] - unquantized).abs().max() > 1e-4 * scale  # int8 changes the model: the check can fail
    if p > 1 and variant == "v2":  # the row-parallel slices' own scales matter: whole-row groups are another model
        with torch.no_grad():
            wrong = fake_int8(dense, 1).logits(ids)
        assert (got["int8"] - wrong).abs().max() > 1e-6 * scale
    for name, w in ref.named_parameters():  # the library's oracle (LLM(check=True), the launcher) is this one
        assert torch.equal(got["library_oracle"][name], w), name
    assert (got["in_out"] - unquantized).abs().max() <= 1e-12 * scale  # the layout changes strides only
    same_shape, strides = got["in_out_strides"]
    assert same_shape and strides[0] == 1
    for stored, modelled in got["bytes"]:
        assert stored == modelled
    for i, prompt in enumerate(PROMPTS):
        tokens, logprobs = got["served"][f"r{i}"]
        ids, lps = greedy_logprobs(ref, prompt, 6)
        assert tokens == ids
        assert max(abs(a - b) for a, b in zip(logprobs, lps)) <= 1e-10


@torch.no_grad()
def test_the_fused_kernels_equal_the_eager_products():
    """Decode's compiled kernels (a few rows, float32 on a CPU, a weight past FUSED_MIN) against float64 products, up
    to the row count where they hand over to the eager ones: each ran compiled (no fallback), one graph a kind for
    every row count."""
    from torch._dynamo.utils import counters

    kernels = weight_format._kernels
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(weight_format.FUSED_MIN // 64 + 8, 64, generator=gen)
    codes, scales = weight_format.quantize_rows(w)
    for kind in ("float", "int8"):
        kernels["ran"].discard(kind)
        graphs = None
        for rows in (1, 3, weight_format.FUSED_ROWS[kind], weight_format.FUSED_ROWS[kind] + 1):
            x = torch.randn(rows, 64, generator=gen)
            want = x.double() @ (w.double() if kind == "float" else codes.double() * scales.double()[:, None]).T
            got = weight_format.linear(x, *((w, None) if kind == "float" else (codes, scales)), fused=True)
            assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max(), (kind, rows)
            graphs = counters["stats"]["unique_graphs"] if graphs is None else graphs
        assert kind in kernels["ran"] and not kernels["failed"]  # the fused kernel computed these, not the fallback
        assert counters["stats"]["unique_graphs"] == graphs  # no row count compiled a kernel of its own
    assert weight_format.fused_kernel("float", x[:1], w[:100], True) is None  # a weight that fits in cache: eager
    assert weight_format.fused_kernel("float", x[:1], w, False) is None  # the module's switch off: eager


def test_the_kernels_compile_at_load_for_the_weights_that_use_them():
    """warm_up (called by prepare) runs each kind's kernel for the first weight past FUSED_MIN, before any step; a
    model of small weights runs none."""
    def module(out: int, width: int, int8: bool) -> torch.nn.Module:
        m = torch.nn.Module()
        codes, scales = weight_format.quantize_rows(torch.randn(out, width))
        m.weight = torch.nn.Parameter(codes if int8 else torch.randn(out, width), requires_grad=False)
        m.register_buffer("scales", scales if int8 else None)
        m.fused = True
        return m

    ran = weight_format._kernels["ran"]
    ran.clear()
    weight_format.warm_up([module(64, 32, False), module(64, 32, True)], torch.float32)
    assert not ran
    big = weight_format.FUSED_MIN // 64
    weight_format.warm_up([module(8, 8, False), module(big, 64, False), module(big, 64, True)], torch.float32)
    assert ran == {"float", "int8"}


def test_compiling_is_off_where_the_settings_say(monkeypatch):
    """enforce_eager (compile=False), TPREF_COMPILE=0 and a device other than the CPU's each leave a module's kernels
    off; prepare sets the switch per module."""
    def model(device) -> torch.nn.Module:
        m = torch.nn.Module()
        m.weight = torch.nn.Parameter(torch.randn(4, 4, device=device))
        m.register_buffer("scales", None)
        lm = torch.nn.Module()
        lm.block = m
        lm.output_embedding = None
        return lm

    for compile, env, device, on in ((True, "1", "cpu", True), (False, "1", "cpu", False), (True, "0", "cpu", False),
                                     (True, "1", "meta", False)):
        monkeypatch.setenv("TPREF_COMPILE", env)
        lm = weight_format.prepare(model(device), None, "auto", compile=compile)
        assert lm.block.fused is on, (compile, env, device)


@torch.no_grad()
def test_a_kernel_that_does_not_compile_falls_back_and_one_that_ran_raises(capsys):
    def broken(*args):
        raise RuntimeError("")  # an empty message, as some compiler errors have

    kernels = weight_format._kernels
    codes, scales = weight_format.quantize_rows(torch.randn(weight_format.FUSED_MIN // 16, 16))
    x = torch.randn(1, 16)
    saved = dict(kernels, ran=set(kernels["ran"]))
    try:
        kernels.update(int8=broken, failed=False, ran=set())
        got = weight_format.int8_matmul(x, codes, scales, fused=True)
        assert kernels["failed"]  # eager from now on, in this process
        assert torch.allclose(got, x @ (codes.float() * scales[:, None]).T, atol=1e-4)
        assert "did not compile (RuntimeError: )" in capsys.readouterr().err
        kernels.update(failed=False, ran={"int8"})  # it ran before: a failure now is no compile failure
        with pytest.raises(RuntimeError):
            weight_format.int8_matmul(x, codes, scales, fused=True)
    finally:
        kernels.clear()
        kernels.update(saved)


def test_quantize_rows_round_trips_within_half_a_step():
    w = torch.randn(5, 40, dtype=torch.float64)
    w[3] = 0  # a row of zeros: scale 1, codes 0
    codes, scales = weight_format.quantize_rows(w)
    assert codes.dtype == torch.int8 and codes.abs().max() <= 127 and scales[3] == 1
    assert ((codes.double() * scales[:, None] - w).abs() <= scales[:, None] / 2 + 1e-15).all()
    assert (codes.abs().amax(1)[[0, 1, 2, 4]] == 127).all()  # each row's largest weight takes the largest code


@pytest.mark.parametrize("settings,message", [
    (dict(quantization="int4"), "quantization='int4': choose None"),
    (dict(weight_layout="column"), "weight_layout='column': choose auto, out_in, in_out"),
])
def test_bad_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**settings)


@pytest.mark.parametrize("preset,pp,message", [
    ("mixtral_tiny", 1, "quantization='int8' with mixtral models is not built"),
    ("deepseek_tiny", 1, "quantization='int8' with deepseek_v3 models is not built"),
    ("llama_tiny", 2, r"quantization='int8' with pipeline stages \(pipeline_parallel_size=2\) is not built"),
])
def test_models_it_does_not_cover_are_refused_before_any_rank_starts(preset, pp, message):
    from serve.llm import resolve_model
    from serve.worker import RankSpec

    cfg, _ = resolve_model(preset, 1, "tp")
    spec = RankSpec(cfg, None, torch.float32, 0, "gloo", "cpu", EngineConfig(quantization="int8"), pp=pp)
    with pytest.raises(ValueError, match=message):
        spec.validate(pp, "pipeline_parallel_size")
