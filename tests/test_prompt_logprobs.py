"""Prompt logprobs (SamplingParams.prompt_logprobs) under the vocab-parallel head (layers/sampling/prompt_logprobs.py)
against log_softmax of the dense model's logits, computed here on the whole prompt (float64)."""

from types import SimpleNamespace

import pytest
import torch

from layers.models.dense import init_weights
from layers.models.lm import dense_lm, shard_lm
from layers.sampling.prompt_logprobs import score_rows
from serve.config import EngineConfig
from serve.engine import LLMEngine
from serve.sampling_params import SamplingParams
from tests.common import step_engine
from tests.harness import run_ranks
from tests.test_sampling import GPT2, LLAMA

V = 13


def sliced(ctx, z: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's slice of logits z [R, V] as the vocab-parallel head splits it (the last slice padded)."""
    per = -(-V // ctx.world_size)
    start = ctx.rank * per
    local = torch.full((z.shape[0], per), 7.0, dtype=torch.float64)  # padding: a large logit that must not count
    take = max(0, min(per, V - start))
    local[:, :take] = z[:, start:start + take]
    return local, start


def scored(ctx, z, targets, n):
    return score_rows(*sliced(ctx, z), ctx.group, targets, n, V)


def test_score_rows_are_log_softmax_at_every_p():
    """The scored id's logprob and the top n of 13 ids (padded to 14 and 15 at p = 2, 3), to 1e-12 at p = 1, 2, 3;
    ties go to the lower id; n wider than a rank's slice (n = 6 > 5 ids at p = 3)."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(6, V, generator=g, dtype=torch.float64) * 3
    z[0, 3] = z[0, 9] = 20.0  # a tie across slices: 3 first
    targets = torch.tensor([9, 0, 12, 5, 7, 3])
    ref = torch.log_softmax(z, -1)
    for n in (0, 2, 6):
        for p in (1, 2, 3):
            out = run_ranks(p, scored, z, targets, n)[0]
            assert out.shape == (6, 1 + 2 * n)
            assert (out[:, 0] - ref.gather(1, targets[:, None])[:, 0]).abs().max() < 1e-12, (n, p)
            if n:
                want = ref.topk(n)
                assert out[:, 1 + n:].sub(want.values).abs().max() < 1e-12, (n, p)
                assert out[1:, 1:1 + n].long().tolist() == want.indices[1:].tolist(), (n, p)
                assert out[0, 1:3].long().tolist() == [3, 9], (n, p)


def serve_scored(ctx, cfg, reqs, config):
    """reqs: (name, prompt, params, add at step). Rank 0's RequestOutputs by name, and how often requests were
    preempted."""
    engine = LLMEngine(shard_lm(init_weights(dense_lm(cfg, torch.float64), seed=0), "v2", ctx.group), ctx, config)
    done = {}

    def before(engine, step):
        for name, prompt, q, at in reqs:
            if at == step:
                engine.add_request(name, prompt, q)

    def sink(outputs, step):
        done.update({o.request_id: o for o in outputs if o.finished})

    step_engine(engine, before, max(r[3] for r in reqs), sink)
    return (done, engine.scheduler.preemptions) if ctx.is_main else None


@pytest.mark.parametrize("cfg", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_prompt_logprobs_equal_the_dense_models_log_softmax(cfg):
    """Requests scoring their prompts (top 0, 2 and 5) beside requests that do not, prompts split into chunks of 5,
    a shared prefix (the scoring request computes it anyway: no prefix hit), a pool that preempts (scored rows
    recomputed), at p = 1, 2 (GPT-2) and 1, 4 (Llama): every prompt position's entry equals log_softmax of the dense
    model's logits to 1e-10, with the top N and the token itself; the first entry is None; every step's collectives
    equal the traffic model (the engine's check)."""
    shared = list(range(40, 56))
    g = torch.Generator().manual_seed(3)
    prompt = [shared + torch.randint(0, 1001, (n,), generator=g).tolist() for n in (5, 9, 3, 7)]
    reqs = [("plain", prompt[0], SamplingParams(max_tokens=6, ignore_eos=True), 0),
            ("top0", prompt[1], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=0), 1),
            ("top2", prompt[2], SamplingParams(max_tokens=5, seed=1, ignore_eos=True, prompt_logprobs=2), 2),
            ("top5", prompt[3], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=5), 2)]
    config = EngineConfig(long_prefill_token_threshold=5, max_num_batched_tokens=16, max_num_seqs=4, block_size=4,
                          num_gpu_blocks_override=16)
    dense = init_weights(dense_lm(cfg, torch.float64), seed=0)
    for p in (1, 2) if cfg is GPT2 else (1, 4):
        done, preempted = run_ranks(p, serve_scored, cfg, reqs, config)[0]
        assert done["plain"].prompt_logprobs is None and preempted > 0
        for name, ids, q, _ in reqs[1:]:
            out = done[name]
            assert out.num_cached_tokens == 0, name  # the shared prefix was cached, but a scored prompt is computed
            with torch.no_grad():
                ref = torch.log_softmax(dense.logits(torch.tensor(ids)).double(), -1)
            entries = out.prompt_logprobs
            assert len(entries) == len(ids) and entries[0] is None
            for i in range(1, len(ids)):
                top = ref[i - 1].topk(q.prompt_logprobs)
                want = {int(t): float(v) for t, v in zip(top.indices, top.values)} | {ids[i]: float(ref[i - 1, ids[i]])}
                assert entries[i].keys() == want.keys(), (name, p, i)
                assert max(abs(entries[i][t] - want[t]) for t in want) < 1e-10, (name, p, i)


def test_prompt_logprobs_are_refused_where_they_are_not_built():
    from serve import LLM
    from serve.sampling_params import FieldError
    from serve.spec_decode import SpeculativeConfig, check_request

    with pytest.raises(ValueError, match="prompt_logprobs=-1 must be None or an integer >= 0"):
        SamplingParams(prompt_logprobs=-1)
    draft = SpeculativeConfig(model="-", num_speculative_tokens=2)
    with pytest.raises(FieldError, match="prompt_logprobs with speculative_config method='draft_model'"):
        check_request(draft, None, 1)
    check_request(SpeculativeConfig(method="ngram", num_speculative_tokens=2), None, 1)
    from serve.pd import Layout
    from serve.pd.run import serve_pd
    from serve.request import Request

    scoring = Request(0, [1, 2, 3], 2, 0, params=SamplingParams(prompt_logprobs=0))
    with pytest.raises(ValueError, match="prompt_logprobs with P/D disaggregation is not built"):  # no group needed
        serve_pd(None, None, Layout(1, 1), [scoring], EngineConfig(), eos_token_ids=())
    for pp, cp in ((2, 1), (1, 2)):  # LLM's driver rule, before anything is sent (no ranks needed to see it)
        driver = SimpleNamespace(tokenizer=None, pipeline_parallel_size=pp, context_parallel_size=cp)
        with pytest.raises(FieldError, match="prompt_logprobs with pipeline_parallel_size or context_parallel_size"):
            LLM._check(driver, [1, 2, 3], SamplingParams(prompt_logprobs=1))
