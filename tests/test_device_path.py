"""The serving path as a GPU would run it: what the host waits for per iteration, and half precision like the models'
own code (norm statistics in float32)."""

import pytest
import torch

from tests.harness import run_ranks


# ---- host synchronizations per decode iteration ------------------------------------------------------------------


def _count_syncs(ctx, comm_timing):
    from layers.models.lm import shard_lm
    from serve.offline import OfflineEngine
    from serve.config import EngineConfig
    from tests.syncs import SyncCounter
    from tests.test_serve import CFG, dense_lm, make_requests

    lm = shard_lm(dense_lm(), "v2", ctx.group)
    counter, rows = SyncCounter(), []

    def on_iteration(record, sched):  # everything since the previous iteration's record: schedule, forward, update
        on_group = {k: v for k, v in record["collectives"].items() if k != "broadcast"}  # rank 0's control: host side
        rows.append((record["prefill_chunks"], record["decodes"], sum(on_group.values()),
                     dict(counter.device), dict(counter.control)))
        counter.device.clear()
        counter.control.clear()

    with counter.counting():
        OfflineEngine(lm, ctx, EngineConfig(long_prefill_token_threshold=8, max_num_batched_tokens=32, comm_timing=comm_timing, max_num_seqs=32), on_iteration=on_iteration).run(make_requests())
    return CFG.n_layers, rows, ctx.rank


@pytest.mark.parametrize("p", [1, 2])
def test_one_host_sync_per_decode_iteration(p):
    """A decode iteration waits for the device once: the sampled tokens' copy (which also ends its clock). The plan
    agreement is host-side control traffic (CPU tensors, gloo) and waits for no GPU (at p = 1 there is none). With per-collective timing on,
    each collective adds two waits for the compute stream — the 4L + ... the serving loop used to pay (22 at L = 3
    before: two device-wide syncs per collective, three tensor reads, one more sync), which shows the counter
    sees what it counts."""
    for (L, rows, rank), (_, timed, _) in zip(run_ranks(p, _count_syncs, False), run_ranks(p, _count_syncs, True)):
        decodes = [r for r in rows if r[0] == 0]
        assert len(decodes) >= 5
        for _, _, collectives, device, control in decodes:
            assert device == {"tolist": 1}, device  # the one copy of tokens and logits
            # on the host: the plan check; past rank 0, also the read of rank 0's control header (one rank alone
            # sends no control message and agrees with itself: nothing)
            assert control == ({"tolist": 1 if rank == 0 else 2} if p > 1 else {}), control
        for _, _, collectives, device, _ in (r for r in timed if r[0] == 0):
            on_device = collectives - 1  # all but the plan check: 2L all-reduces, the embedding's, the head's gather
            if p > 1:
                assert on_device == 2 * L + 2
            assert device == {"tolist": 1, **({"tp.dist.wait_for_stream": 2 * on_device} if p > 1 else {})}, device


def _engine_waits(ctx, family: str, moe_parallel: str, attention: str, workload: str = "mixed"):
    """LLMEngine.step on every rank over a workload that decodes, chunks prompts, hits the prefix cache and preempts;
    per step: (what kind of iteration it was, the device waits, the control reads)."""
    from layers.models.dense import init_weights
    from layers.models.lm import dense_lm, shard_lm
    from serve.config import EngineConfig
    from serve.hooks import StepHook
    from serve.engine import LLMEngine
    from layers.attention.backends import ragged_decodes
    from launch.sync_check import arrivals_feed
    from serve.offline import drive
    from tests.syncs import SyncCounter
    from tests.test_moe import CFG as MOE
    from tests.test_paged import LLAMA
    from tests.test_serve import CFG

    cfg = {"gpt2": CFG, "llama": LLAMA, "mixtral": MOE}[family]
    lm = shard_lm(init_weights(dense_lm(cfg, torch.float64), seed=0), "v2", ctx.group, moe_parallel=moe_parallel)
    counter, steps = SyncCounter(), []

    class Waits(StepHook):
        def after_step(self, engine, step):
            plan = step.plan
            kind = "idle" if plan is None else "+".join(sorted(
                {"decode" if c.decode else "prefill" for c in plan.scheduled}
                | ({"prefix-hit"} if any(c.q_start > 0 and not c.decode and c.request in plan.admitted
                                         for c in plan.scheduled) else set())
                | ({"preempt"} if plan.preempted else set())
                | ({"ragged"} if ragged(plan) else set())))
            steps.append((kind, dict(counter.device), dict(counter.control)))
            counter.device.clear()
            counter.control.clear()

    def ragged(plan) -> bool:  # the decodes attend in one ragged pass (the batched backend's rule)
        return attention == "batched" and ragged_decodes(plan.scheduled)

    gen = torch.Generator().manual_seed(1)
    if workload == "ragged":  # one long context beside seven short ones: padding would dominate
        config = EngineConfig(long_prefill_token_threshold=16, max_num_batched_tokens=16, max_num_seqs=8, attention=attention,
                              check_ledger=False)
        prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in [40] + [1] * 7]
        arrivals = {0: 8}
    else:  # a shared prefix (prefix hits), a pool that runs short (preemption), prompts chunked beside decodes
        config = EngineConfig(long_prefill_token_threshold=8, max_num_batched_tokens=16, max_num_seqs=4, block_size=4, num_gpu_blocks_override=12,
                              attention=attention, check_ledger=False)
        shared = torch.randint(0, cfg.vocab_size, (12,), generator=gen).tolist()  # three full blocks they all share
        prompts = [shared + torch.randint(0, cfg.vocab_size, (3 + 2 * n,), generator=gen).tolist() for n in range(5)]
        arrivals = {0: 2, 3: 1, 6: 2}  # step -> requests added before it
    engine = LLMEngine(lm, ctx, config, hooks=[Waits()])
    with counter.counting():
        drive(engine, arrivals_feed(prompts, arrivals))
    return cfg.n_layers, steps


@pytest.mark.parametrize("family,moe_parallel,attention", [
    ("gpt2", "tp", "batched"), ("gpt2", "tp", "reference"), ("gpt2", "tp", "cpu"), ("llama", "tp", "batched"),
    ("llama", "tp", "cpu"), ("mixtral", "tp", "batched"),
    ("mixtral", "ep", "batched")])
def test_every_iteration_kind_waits_for_the_device_once(family, moe_parallel, attention):
    """Counted at the dispatcher, so waits inside C++ (boolean-mask indexing, nonzero, bincount, equal) count too:
    every step that runs a forward waits once for the sampled tokens, plus once per MoE layer for the experts' group
    sizes; decodes, prompt chunks, prefix hits and preemption alike, GPT-2, Llama and Mixtral, both attention
    paths. A step with nothing to run waits for nothing."""
    for L, steps in run_ranks(2, _engine_waits, family, moe_parallel, attention):
        kinds = {kind for kind, _, _ in steps}
        assert {"decode", "prefill", "decode+prefill"} <= kinds and any("prefix-hit" in k for k in kinds) \
            and any("preempt" in k for k in kinds), kinds  # the workload reaches every kind
        for kind, device, control in steps:
            want = {} if kind == "idle" else {"tolist": 1 + (L if family == "mixtral" else 0)}
            assert device == want, (kind, device)
            assert set(control) <= {"tolist"}, (kind, control)  # control reads host tensors only


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_ragged_decode_pass_waits_for_nothing_more(family):
    for _, steps in run_ranks(2, _engine_waits, family, "tp", "batched", "ragged"):
        assert any("ragged" in kind for kind, _, _ in steps), steps  # the workload reaches the ragged pass
        for kind, device, _ in steps:
            assert device == ({} if kind == "idle" else {"tolist": 1}), (kind, device)


# ---- half precision: norm statistics in float32 ------------------------------------------------------------------

TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # a few roundings of each format (2^-10, 2^-7)


def _big_residual(d: int, dtype) -> torch.Tensor:
    """Rows like a late layer of Llama-2-7B's residual stream: activations of magnitude 1e3-1e4."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, d, generator=gen, dtype=torch.float64) * 3e3
    x[:, :4] = 1e4  # a few outlier channels, as real models have
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_norms_keep_float32_statistics_in_half_precision(dtype):
    """float16 squares overflow above |x| ~ 256: squared in x's dtype the row's statistic is inf and the row becomes
    zeros. RMSNorm (ours) and LayerNorm (PyTorch's) take their statistics in float32 and equal a float32 norm."""
    from layers.models.llama import RMSNorm

    d = 64
    x = _big_residual(d, dtype)
    if dtype == torch.float16:
        assert torch.isinf(x.pow(2).mean(-1)).all()  # what squaring in float16 gives: the case under test
    rms, ln = RMSNorm(d, 1e-5, torch.float32), torch.nn.LayerNorm(d, dtype=torch.float32)
    with torch.no_grad():
        for norm in (rms, ln):
            norm.weight.copy_(1 + 0.1 * torch.randn(d, generator=torch.Generator().manual_seed(1)))
    for norm in (rms, ln):
        want = norm(x.float())
        got = norm.to(dtype)(x)
        assert got.dtype == dtype and torch.isfinite(got).all()
        assert ((got.float() - want).abs().max() / want.abs().max()).item() < TOL[dtype]
        norm.float()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_llama_block_with_a_large_residual(dtype):
    """A Llama block in float16/bfloat16 on residual rows of magnitude 1e3-1e4 is finite and equals the float32 block
    within the format's tolerance, down to what its attention and MLP see (the normed rows)."""
    from layers.models.dense import init_weights
    from layers.models.llama import DenseLlamaBlock, LlamaConfig

    cfg = LlamaConfig(d_model=64, n_heads=8, n_kv_heads=2, d_head=8, d_ffn=96, n_layers=1, vocab_size=100)
    block = init_weights(DenseLlamaBlock(cfg, torch.float32), seed=0)
    half = init_weights(DenseLlamaBlock(cfg, dtype), seed=0)
    seen = {}
    for name, b in (("float32", block), ("half", half)):
        b.q.register_forward_pre_hook(lambda m, a, name=name: seen.__setitem__(name, a[0].float()))
    x = _big_residual(cfg.d_model, dtype)
    with torch.no_grad():
        want, got = block(x.float()), half(x)
    assert torch.isfinite(got).all()
    assert ((got.float() - want).abs().max() / want.abs().max()).item() < TOL[dtype]
    normed = (seen["half"] - seen["float32"]).abs().max() / seen["float32"].abs().max()
    assert normed.item() < TOL[dtype]  # zeros (statistics squared in float16) would be off by 100%


# ---- bfloat16 serving against transformers' bfloat16 generate ------------------------------------------------------

BF16_NEAR_TIE = 3e-2  # launch/serve.py's NEAR_TIE[bfloat16]: a top-1/top-2 gap below 3% of max(1, |logit|)
BF16_WORKLOAD = [(7, 8), (12, 8), (3, 8), (20, 8), (9, 8), (15, 8)]  # (prompt length, max_new_tokens)


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory):
    """A random LlamaForCausalLM saved in bfloat16, and transformers' own greedy generate in bfloat16 (its RMSNorm and
    rotary tables in float32, as it ships), with every step's scores for the margin rule."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=2,
        head_dim=8, vocab_size=300, max_position_embeddings=128, rms_norm_eps=1e-6, attn_implementation="sdpa"))
    model = model.to(torch.bfloat16).eval()
    path = tmp_path_factory.mktemp("llama_bf16") / "ckpt"
    model.save_pretrained(path, max_shard_size="30KB")  # sharded: model.safetensors.index.json and its files
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n, _ in BF16_WORKLOAD]
    want = []
    for prompt, (_, new) in zip(prompts, BF16_WORKLOAD):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                                 num_beams=1, output_scores=True, return_dict_in_generate=True)
        scores = [s[0].float() for s in out.scores]
        want.append((out.sequences[0, len(prompt):].tolist(), [s.topk(2).values.tolist() for s in scores]))
    return str(path), prompts, want


def _serve_bf16(ctx, path, prompts):
    from layers.models.hf import CheckpointSource, read_config, read_state
    from layers.models.lm import shard_lm
    from serve.offline import OfflineEngine
    from serve.config import EngineConfig
    from serve.request import Request

    lm = shard_lm(CheckpointSource(read_state(path), read_config(path), torch.bfloat16, ctx.device), "v2", ctx.group)
    reqs = [Request(i, p, new, 0) for i, (p, (_, new)) in enumerate(zip(prompts, BF16_WORKLOAD))]
    return [r["output_ids"] for r in OfflineEngine(lm, ctx, EngineConfig(long_prefill_token_threshold=8, max_num_batched_tokens=24, max_num_seqs=24)).run(reqs).requests]


def test_bfloat16_served_tokens_equal_transformers_generate_except_at_near_ties(bf16_llama):
    """The margin rule: a served sequence equals transformers' up to its end, or up to a first difference at a step
    where transformers' own top-1/top-2 gap is a near-tie (< 3% of max(1, |top-1|)); after it the two continue from
    different tokens and are not compared. Most tokens must agree (the rule cannot excuse everything)."""
    path, prompts, want = bf16_llama
    served = run_ranks(2, _serve_bf16, path, prompts)[0]
    agreed = total = 0
    for got, (ids, top2) in zip(served, want):
        first = next((i for i, (a, b) in enumerate(zip(got, ids)) if a != b), None)
        total += len(ids)
        agreed += len(ids) if first is None else first
        if first is not None:
            (top1, second) = top2[first]
            assert top1 - second < BF16_NEAR_TIE * max(1.0, abs(top1)), (first, got, ids, top2[first])
    assert agreed >= 0.75 * total, (agreed, total)


# ---- threads per rank (tp/dist.py threads_per_rank, the one place that chooses them) ------------------------------


def test_threads_per_rank_leave_a_core_to_the_driver_and_honour_settings(monkeypatch):
    """On a CPU: the cores this process may use, one left to the driver, shared among the ranks (at least one each);
    OMP_NUM_THREADS from the environment, then a given number, win; on CUDA one each. (LLM's rank 0 reports the
    threads it runs with: tests/test_llm.py checks them against this choice.)"""
    from tp.dist import ConfigError, threads_per_rank

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert [threads_per_rank(w, "cpu")[0] for w in (1, 2, 4, 8, 16, 32)] == [15, 7, 3, 1, 1, 1]
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert threads_per_rank(1, "cpu") == (1, "2 cores, one left to the driver, 1 rank")
    assert threads_per_rank(1, "cuda")[0] == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads_per_rank(2, "cpu") == (3, "OMP_NUM_THREADS")
    assert threads_per_rank(2, "cpu", 2) == (2, "threads_per_rank")
    with pytest.raises(ConfigError, match="threads_per_rank=0 must be a positive integer"):
        threads_per_rank(2, "cpu", 0)
