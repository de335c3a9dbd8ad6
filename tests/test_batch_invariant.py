"""The batch-invariant mode (EngineConfig.batch_invariant; docs/flash.md): one request's tokens and logprobs, bit for
bit, whatever other requests share its steps, how its prompt is chunked, its place in the batch and the pool's block
size; at tensor-parallel sizes 1 and 2.

No oracle computes bits: the check is equality (==) of the same request's chosen logprobs across runs that differ in
everything else, float32. Its parts: a product in fixed tiles of rows gives a row the same bits alone or among
others (a plain F.linear does not, measured beside it)."""

import pytest
import torch
import torch.nn.functional as F

from layers.models.config import ModelConfig
from layers.models.dense import init_weights
from layers.models.llama import LlamaConfig
from layers.models.lm import dense_lm, shard_lm
from layers.parallel.weight_format import TILE_ROWS, linear
from serve.build import prepare_weights
from serve.config import EngineConfig
from serve.engine import LLMEngine
from serve.hooks import StepHook
from tests.common import greedy_logprobs, serve_greedy
from tests.harness import run_ranks

GPT2 = ModelConfig(d_model=128, n_heads=4, d_head=32, d_ffn=512, n_layers=2, max_seq_len=128, vocab_size=1000)
LLAMA = LlamaConfig(d_model=128, n_heads=8, n_kv_heads=2, d_head=16, d_ffn=384, n_layers=2, max_seq_len=128,
                    vocab_size=1000)


def test_a_tiled_product_gives_a_row_the_same_bits_among_any_rows():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(512, 384, generator=g), torch.randn(512, generator=g)
    x = torch.randn(40, 384, generator=g)
    alone = linear(x[:1], w, bias=b, tile=TILE_ROWS)
    assert torch.equal(alone, F.linear(torch.cat([x[:1], x.new_zeros(7, 384)]), w, b)[:1])  # one padded tile
    for n in (2, 5, 8, 9, 40):
        order = torch.randperm(n, generator=g)
        at = int((order == 0).nonzero())
        assert torch.equal(linear(x[:n][order], w, bias=b, tile=TILE_ROWS)[at], alone[0])
    # (what the tiles fix: on this machine's BLAS, F.linear gives a row other bits among 2 rows than alone)


class Crowd(StepHook):
    """The most requests in any step that runs request "t"."""

    most = 0

    def before_forward(self, engine, plan) -> None:
        ids = [c.request for c in plan.scheduled]
        if engine._ids.get("t") in ids:
            self.most = max(self.most, len(ids))


def serve(ctx, cfg, workload, config):
    """workload: [(name, prompt, max_tokens, step it arrives)]; rank 0's ({name: (tokens, chosen logprobs)}, the
    most requests in a step of "t")."""
    dense = init_weights(dense_lm(cfg, torch.float32), seed=0, std=0.05)
    crowd = Crowd()
    engine = LLMEngine(prepare_weights(shard_lm(dense, "v2", ctx.group), config), ctx, config, hooks=[crowd])
    done = serve_greedy(engine, workload)
    if not ctx.is_main:
        return None
    engine.shutdown()
    return done, crowd.most


@pytest.mark.parametrize("cfg,p", [(GPT2, 1), (LLAMA, 2)], ids=["gpt2-p1", "llama-p2"])
def test_one_request_gets_the_same_bits_in_any_batch(cfg, p):
    g = torch.Generator().manual_seed(1)
    target = torch.randint(0, 1000, (70,), generator=g).tolist()  # two tiles of 64 keys, and queries
    others = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (5, 60, 23, 41, 9)]
    crowd = torch.randint(0, 1000, (63, 3), generator=g).tolist()
    runs = [  # (workload, settings): alone; among others from the start; arriving mid-stream at another place
        ([("t", target, 8, 0)], dict(long_prefill_token_threshold=64, block_size=16)),
        ([("t", target, 8, 0)] + [(f"o{i}", o, 6, 0) for i, o in enumerate(others)],
         dict(long_prefill_token_threshold=7, block_size=4)),
        ([(f"o{i}", o, 12, 0) for i, o in enumerate(others)] + [("t", target, 8, 3)],
         dict(long_prefill_token_threshold=16, block_size=8, max_num_seqs=3)),
        ([(f"s{i}", crowd[i], 12, 0) for i in range(63)] + [("t", target, 8, 1)],  # 64 requests in its steps
         dict(long_prefill_token_threshold=32, block_size=4, max_num_seqs=64, max_num_batched_tokens=256)),
    ]
    got, most = [], []
    for workload, settings in runs:
        config = EngineConfig(batch_invariant=True, **{"max_num_seqs": 8, "max_num_batched_tokens": 64, **settings})
        done, rows = run_ranks(p, serve, cfg, workload, config)[0]
        got.append(done["t"])
        most.append(rows)
    assert got[0] == got[1] == got[2] == got[3]  # tokens and every chosen logprob, to the bit
    assert most[0] == 1 and most[3] == 64  # the steps it ran in: alone, and with 63 others
    # and right: the dense model recomputed with no cache (float64) gives the same tokens, logprobs to float32's error
    dense = init_weights(dense_lm(cfg, torch.float64), seed=0, std=0.05)
    ids, lps = greedy_logprobs(dense, target, 8)
    assert got[0][0] == ids and max(abs(a - b) for a, b in zip(got[0][1], lps)) < 1e-4


def refusals(ctx, cfg):
    """What the engine itself refuses (the library's entry): a model whose products are not tiled; more than one
    intra-op thread (the count read as a second thread would report it)."""
    from unittest import mock

    from serve.model_runner import check_invariant

    dense = init_weights(dense_lm(cfg, torch.float32), seed=0, std=0.05)
    config = EngineConfig(batch_invariant=True)
    said = []
    for lm, threads in ((shard_lm(dense, "v2", ctx.group), 1),
                        (prepare_weights(shard_lm(dense, "v2", ctx.group), config), 2)):
        try:
            with mock.patch.object(torch, "get_num_threads", lambda: threads):
                check_invariant(lm, config, ctx, 1)
        except ValueError as exc:
            said.append(str(exc))
    return said


def test_what_is_not_built_is_refused_in_one_line():
    untiled, threads = run_ranks(1, refusals, GPT2)[0]
    assert "products are not tiled" in untiled and "one intra-op thread" in threads
    for settings, message in ((dict(attention="cpu"), "leave attention at auto or flash"),
                              (dict(quantization="int8"), "with quantization is not built"),
                              (dict(kv_cache_dtype="fp8"), "with kv_cache_dtype is not built")):
        with pytest.raises(ValueError, match=message):
            EngineConfig(batch_invariant=True, **settings)
    with pytest.raises(ValueError, match="tensor_parallel_size=4 is not built"):
        EngineConfig(batch_invariant=True).check_batch_invariant(4)
    with pytest.raises(ValueError, match="pp > 1"):
        EngineConfig(batch_invariant=True).check_pipeline(2)


def rl_round(ctx, cfg, dtype):
    """An RL round on every rank: a trainer's TP model (train/step.py train_lm), the engine made from its weights
    gathered (train/export.gather_dense, a weight sync) in the mode, requests served in mixed batches, then the
    trainer's forward over prompt + completion (train/step.tp_logprobs, gradients on as in a policy step), in the
    mode and without it, and in the mode one sequence at a time. Requests sampled at temperature 1 (a chosen token
    is not always the row's largest logit). Rank 0's [(engine's chosen logprobs, trainer's in the mode, trainer's
    without, trainer's alone)]."""
    import torch.distributed as dist

    from train.export import gather_dense
    from train.step import tp_logprobs, train_lm

    trainer = train_lm(init_weights(dense_lm(cfg, dtype), seed=0, std=0.05), ctx.group)
    config = EngineConfig(batch_invariant=True, max_num_batched_tokens=64, long_prefill_token_threshold=16,
                          block_size=8)
    engine = LLMEngine(prepare_weights(shard_lm(gather_dense(trainer, ctx.group), "v2", ctx.group), config), ctx,
                       config)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (70, 5, 23, 2)]  # 70: two key tiles
    done = [serve_greedy(engine, [(f"r{i}", p, 8 - 6 * (len(p) == 2), i) for i, p in enumerate(prompts)], 1.0)]
    dist.broadcast_object_list(done, src=0, group=ctx.group)  # the completions, on every rank
    engine.shutdown()
    served = [done[0][f"r{i}"] for i in range(len(prompts))]
    seqs = [p + tokens for p, (tokens, *_) in zip(prompts, served)]
    mode, plain = (tp_logprobs(trainer, seqs, batch_invariant=on) for on in (True, False))
    alone = [tp_logprobs(trainer, [s], batch_invariant=True)[0] for s in seqs]  # 3 rows for the last: its own bits
    return [(lps, a[len(p) - 1:].tolist(), b[len(p) - 1:].tolist(), c[len(p) - 1:].tolist())
            for p, (_, lps, _), a, b, c in zip(prompts, served, mode, plain, alone)]


@pytest.mark.parametrize("cfg,p,dtype", [(GPT2, 1, torch.float32), (LLAMA, 2, torch.float32),
                                         (LLAMA, 2, torch.bfloat16)], ids=["gpt2-p1", "llama-p2", "llama-p2-bf16"])
def test_the_trainers_forward_gives_the_engines_logprobs_to_the_bit(cfg, p, dtype):
    """RL's requirement: the logprobs the engine returned for the tokens it sampled are the trainer's own forward's,
    bit for bit, in the mode (float32, and bfloat16 weights on both sides), whatever other sequences share the
    trainer's batch (one alone of 3 rows: a row count this machine's BLAS multiplies with other bits). Beside it,
    the trainer's forward without the mode (SDPA, whole products) differs from the engine's in the last bits: the
    mode is what makes them equal, not the weights alone."""
    rows = run_ranks(p, rl_round, cfg, dtype)[0]
    for engine, mode, plain, alone in rows:
        assert engine == mode == alone and len(engine) in (2, 8)
        assert max(abs(a - b) for a, b in zip(engine, plain)) < (3e-2 if dtype == torch.bfloat16 else 1e-5)
    assert any(engine != plain for engine, _, plain, _ in rows)


def logprobs_and_gradients(ctx, cfg, sp):
    """tp_logprobs in float64, in the mode and without (sp: a sequence-parallel model, without only): rank 0's
    (values, the gradient of a weighted sum of them gathered into the dense model's layout, the ledger's records, the
    traffic model's)."""
    from dataclasses import fields

    from tp.ledger import Traffic, TrafficLedger
    from tp.traffic_model import predict_train_logprobs
    from train.export import gather_dense
    from train.step import tp_logprobs, train_lm

    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (70, 9, 2)]
    weights = torch.randn(69 + 8 + 1, generator=g, dtype=torch.float64)
    out = []
    for on in (False,) if sp else (True, False):
        lm = train_lm(init_weights(dense_lm(cfg, torch.float64), seed=0, std=0.05), ctx.group, sp)
        ledger = TrafficLedger(ctx.world_size)
        with ledger.attach(lm.stack):
            lps = tp_logprobs(lm, seqs, batch_invariant=on)
        (torch.cat(lps) * weights).sum().backward()
        for param in lm.parameters():
            param.data = param.grad
        got = [Traffic(*(getattr(r, f.name) for f in fields(Traffic))) for r in ledger.records]
        out.append(([t.tolist() for t in lps], gather_dense(lm, ctx.group).state_dict(), got,
                    predict_train_logprobs(cfg, ctx.world_size, 69 + 8 + 1, torch.float64, True, sp)))
    return out if ctx.is_main else None


@pytest.mark.parametrize("cfg,p,sp", [(GPT2, 1, False), (LLAMA, 2, False), (LLAMA, 2, True)],
                         ids=["gpt2-p1", "llama-p2", "llama-p2-sp"])
def test_the_trainers_logprobs_and_gradients_are_the_dense_models(cfg, p, sp):
    """tp_logprobs against one device (float64): log_softmax of the dense model's logits at each next token, and
    torch's gradient of the same weighted sum, every parameter; its collectives are the traffic model's (v2, and
    v2sp with sequence parallelism)."""
    dense = init_weights(dense_lm(cfg, torch.float64), seed=0, std=0.05)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 1000, (n,), generator=g) for n in (70, 9, 2)]
    weights = torch.randn(69 + 8 + 1, generator=g, dtype=torch.float64)
    want = [torch.log_softmax(dense.logits(s[:-1]), -1).gather(1, s[1:, None])[:, 0] for s in seqs]
    (torch.cat(want) * weights).sum().backward()
    for values, grads, got, predicted in run_ranks(p, logprobs_and_gradients, cfg, sp)[0]:
        assert max(abs(a - b) for v, w in zip(values, want) for a, b in zip(v, w.tolist())) < 1e-12
        for name, param in dense.named_parameters():
            assert torch.allclose(grads[name], param.grad, rtol=1e-9, atol=1e-12), name
        assert got == predicted and len(got) == (0 if p == 1 else 27 if sp else 5 + 4 * cfg.n_layers)


def trainer_refusals(ctx):
    """What tp_logprobs refuses before any collective, each message, on every rank."""
    from unittest import mock

    from train.step import tp_logprobs, train_lm

    dense = init_weights(dense_lm(GPT2, torch.float32), seed=0, std=0.05)
    lm = train_lm(dense, ctx.group)
    said = []
    for model, seqs, on, threads in ((lm, [], False, 1), (lm, [5, 6, 7], False, 1), (lm, ["ab"], False, 1),
                                     (lm, [[5]], False, 1), (lm, [[1.0, 2.0]], False, 1),
                                     (lm, [list(range(130))], False, 1), (lm, [[3, 1000]], False, 1),
                                     (lm, [[1, 2, 3]], True, 2), (train_lm(dense, ctx.group, True), [[1, 2]], True, 1)):
        try:
            with mock.patch.object(torch, "get_num_threads", lambda: threads):
                tp_logprobs(model, seqs, batch_invariant=on)
        except ValueError as exc:
            said.append(str(exc))
    return said


def test_the_trainers_forward_refuses_in_one_line():
    for said in run_ranks(2, trainer_refusals):
        assert len(said) == 9 and "no sequences" in said[0] and "one sequence: [ids]" in said[1]
        assert "lists or 1-D tensors of integers" in said[2] and "2 tokens or more" in said[3]
        assert "integers" in said[4] and "max_seq_len = 128" in said[5] and "[0, 1000)" in said[6]
        assert "one intra-op thread" in said[7] and "with sequence parallelism is not built" in said[8]
