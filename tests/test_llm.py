"""The engine as a library: LLMEngine online on rank pools, LLM from plain Python against transformers' generate.

Oracles: the cache-free dense recompute (greedy_reference) for the online engine, transformers' `generate` and
`tokenizer.decode` for LLM; the traffic model for every step's collectives (check_ledger raises otherwise)."""

import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from layers.models.config import ModelConfig
from layers.models.dense import init_weights
from layers.models.llama import LlamaConfig
from layers.models.lm import dense_lm, greedy_reference, shard_lm
from layers.models.moe import MoEConfig
from serve.config import EngineConfig
from serve.engine import LLMEngine
from serve.sampling_params import SamplingParams
from tests.common import step_engine, train_tokenizer
from tests.harness import run_ranks

os.environ.setdefault("HF_HUB_OFFLINE", "1")

GPT2 = ModelConfig(d_model=64, n_heads=8, d_head=8, d_ffn=256, n_layers=2, max_seq_len=96, vocab_size=1001)
LLAMA = LlamaConfig(d_model=64, n_heads=8, n_kv_heads=2, d_head=8, d_ffn=96, n_layers=2, max_seq_len=96,
                    vocab_size=1001)
MOE = MoEConfig(d_model=64, n_heads=8, n_kv_heads=2, d_head=8, d_ffn=48, n_layers=2, max_seq_len=96, vocab_size=1001,
                n_experts=4, top_k=2)
SMALL = EngineConfig(long_prefill_token_threshold=5, max_num_batched_tokens=12, max_num_seqs=4, block_size=4, num_gpu_blocks_override=40)


def workload(seed: int, n: int = 6):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 1001, (rng.randint(1, 20),), generator=gen).tolist(), rng.randint(1, 7))
            for _ in range(n)]


def run_online(ctx, cfg, reqs, add_at, abort=None, moe_parallel="tp", config=SMALL):
    """Every rank steps its LLMEngine; rank 0 adds request i before step add_at[i] (and aborts `abort` = (name, step)).
    Returns rank 0's finished outputs, the free blocks seen around the abort, and every step's ledger verdict."""
    dense = init_weights(dense_lm(cfg, torch.float64), seed=0)
    engine = LLMEngine(shard_lm(dense, "v2", ctx.group, True, moe_parallel), ctx, config)
    done, seen, verdicts = {}, {}, []

    def before(engine, step):
        for i, ((prompt, new), at) in enumerate(zip(reqs, add_at)):
            if at == step:
                if abort is not None and f"r{i}" == abort[0]:
                    seen["before"] = engine.free_blocks
                engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=new))
        if abort is not None and step == abort[1]:
            assert engine.abort_request(abort[0])

    def sink(outputs, step):
        for o in outputs:
            if o.finished:
                done[o.request_id] = (o.outputs[0].token_ids, o.outputs[0].finish_reason)
        if abort is not None and step == abort[1]:
            held = sum(len(t) for t in engine.scheduler.blocks.tables.values())
            seen["after"], seen["held_by_others"] = engine.free_blocks, held
        verdicts.append(engine.last_iteration is None or engine.last_iteration["ledger_matches_model"])

    step_engine(engine, before, max(add_at), sink)
    if not ctx.is_main:
        return None, None, verdicts
    seen["end"] = engine.free_blocks
    return done, seen, verdicts


def reference(cfg, reqs):
    dense = init_weights(dense_lm(cfg, torch.float64), seed=0)
    return [greedy_reference(dense, prompt, new).ids for prompt, new in reqs]


@pytest.mark.parametrize("cfg,p,moe", [(GPT2, 1, "tp"), (GPT2, 2, "tp"), (LLAMA, 4, "tp"), (MOE, 2, "ep")],
                         ids=["gpt2-p1", "gpt2-p2", "llama-gqa-replicated-kv-p4", "mixtral-ep-p2"])
def test_requests_added_between_steps_equal_the_dense_oracle(cfg, p, moe):
    reqs = workload(seed=p)
    rng = random.Random(11)
    add_at = sorted(rng.randint(0, 12) for _ in reqs)  # random steps, some while others decode
    results = run_ranks(p, run_online, cfg, reqs, add_at, moe_parallel=moe)
    done, seen, verdicts = results[0]
    want = reference(cfg, reqs)
    assert [done[f"r{i}"][0] for i in range(len(reqs))] == want
    assert all(done[f"r{i}"][1] == "length" for i in range(len(reqs)))
    assert seen["end"] == SMALL.num_gpu_blocks_override  # every block back in the pool
    assert all(all(r[2]) for r in results)  # every step's collectives equal the model's, on every rank
    # the same requests all given up front: the same tokens (schedule invariance)
    upfront = run_ranks(p, run_online, cfg, reqs, [0] * len(reqs), moe_parallel=moe)[0][0]
    assert upfront == done


def test_abort_frees_blocks_at_once_and_leaves_the_others_alone():
    reqs = [(list(range(1, 30)), 12), (list(range(100, 120)), 30), (list(range(200, 210)), 8)]
    done, seen, verdicts = run_ranks(2, run_online, GPT2, reqs, [0, 1, 2], abort=("r1", 6))[0]
    assert done["r1"][1] == "abort" and len(done["r1"][0]) < 30
    # after the abort step, the pool holds only what the two others' tables hold
    assert seen["after"] == SMALL.num_gpu_blocks_override - seen["held_by_others"]
    assert seen["end"] == SMALL.num_gpu_blocks_override
    want = reference(GPT2, reqs)
    assert done["r0"][0] == want[0] and done["r2"][0] == want[2]


def control_roundtrip(ctx):
    dense = init_weights(dense_lm(GPT2, torch.float64), seed=0)
    engine = LLMEngine(shard_lm(dense, "v2", ctx.group), ctx, SMALL, eos_token_ids=(7,))
    if ctx.is_main:
        engine.add_request("a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3, stop_token_ids=[9, 4]))
        engine.add_request("b", [1], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    engine.step()
    got = {r.id: (r.prompt, r.max_new_tokens, sorted(r.stop_ids), r.arrival) for r in engine.scheduler.by_id.values()}
    if ctx.is_main:
        engine.shutdown()
    else:
        engine.step()
    return got, engine.stopped


def test_every_rank_receives_the_same_requests():
    results = run_ranks(2, control_roundtrip)
    assert results[0] == results[1]
    assert results[0][0] == {0: ([5, 6, 7], 3, [4, 7, 9], 0), 1: ([1], 2, [], 0)}  # eos 7 added; ignore_eos drops it
    assert results[1][1]  # the STOP message ended rank 1's loop


def test_bad_requests_are_refused_before_any_collective():
    # rank 0's checks run before its step's broadcast: a refused request leaves the others waiting for nothing
    # a prompt + max_tokens over the context is not refused: vLLM's engine cuts the output there (below)
    bad = [([], 4, "empty prompt"), ([1] * 97, 10, "longer than the model's context"), ([5000], 2, "not a token id"),
           ([1] * 70, 20, "num_gpu_blocks_override")]
    results = run_ranks(1, refuse, bad)
    assert results[0] == [m for _, _, m in bad]


def refuse(ctx, bad):
    dense = init_weights(dense_lm(GPT2, torch.float64), seed=0)
    lm = shard_lm(dense, "v2", ctx.group)
    engine = LLMEngine(lm, ctx, EngineConfig(num_gpu_blocks_override=5, block_size=16))
    out = []
    for prompt, new, msg in bad:
        with pytest.raises(ValueError) as e:
            engine.add_request("x", prompt, SamplingParams(temperature=0.0, max_tokens=new))
        out.append(msg if msg in str(e.value) else str(e.value))
    assert not engine.has_unfinished_requests()
    # max_model_len, vLLM's meaning: prompt + max_tokens at most; no more than the model's context (96)
    with pytest.raises(ValueError, match="max_model_len=97 exceeds the 96 positions"):
        LLMEngine(lm, ctx, EngineConfig(max_model_len=97))
    capped = LLMEngine(lm, ctx, EngineConfig(max_model_len=12, max_num_seqs=2))
    assert capped.num_blocks == 2 * 1  # the online pool: max_num_seqs requests of 12 positions, 16 per block
    # vLLM's engine rule (this test refused it before): prompt 8 + max_tokens 5 > 12 runs, and finishes with
    # "length" once prompt + output reach max_model_len, after 4 tokens
    capped.add_request("y", [1] * 8, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    capped.add_request("z", [1] * 8, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    ended = {}
    while capped.has_unfinished_requests():
        ended.update({o.request_id: o.outputs[0] for o in capped.step() if o.finished})
    assert {k: (len(c.token_ids), c.finish_reason) for k, c in ended.items()} == {"y": (4, "length"),
                                                                                  "z": (3, "length")}
    return out


def test_sampling_params_and_engine_config_refuse_bad_values():
    for kw in (dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-2), dict(min_p=1.5),
               dict(stop_token_ids=["a"]), dict(stop=[""]), dict(seed=2 ** 60)):
        with pytest.raises(ValueError):
            SamplingParams(**kw)
    assert SamplingParams(temperature=0.0, stop="x").stop == ("x",)
    # vLLM's fields that are not built: refused by name, accepted at their defaults
    for name, value in (("n", 2), ("best_of", 3), ("presence_penalty", 0.5), ("frequency_penalty", -0.1),
                        ("repetition_penalty", 1.2), ("logit_bias", {1: 5.0}), ("min_tokens", 2),
                        ("allowed_token_ids", [1, 2]), ("truncate_prompt_tokens", 4)):
        with pytest.raises(ValueError, match=f"^{re.escape(f'{name}={value!r}')} is not built here: .*; leave it at"):
            SamplingParams(**{name: value})
    assert SamplingParams(temperature=0.0, n=1, best_of=1, presence_penalty=0.0, logit_bias=None, skip_special_tokens=True,
                          max_tokens=3) == SamplingParams(temperature=0.0, max_tokens=3)
    with pytest.raises(ValueError, match="no setting 'maxtokens'; known: max_tokens"):
        SamplingParams(temperature=0.0, maxtokens=3)
    for kw in (dict(block_size=0), dict(max_num_seqs=600), dict(attention="fast"), dict(num_gpu_blocks_override=0)):
        with pytest.raises(ValueError):
            EngineConfig(**kw)
    assert EngineConfig.from_kwargs(max_num_seqs=8, enable_prefix_caching=False) == \
        EngineConfig(max_num_seqs=8, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="unknown engine setting"):
        EngineConfig.from_kwargs(gpu_memory_utilization=0.9)


def test_priority_scheduling_admits_and_preempts_by_priority_with_the_oracles_tokens():
    """LLM(scheduling_policy="priority") on a pool of 8 blocks of 4 positions, two requests at once: a low-priority
    request admitted first is preempted for a high-priority one admitted after it (fcfs would preempt the later one),
    so the later one finishes first; of three short prompts given to generate at once (two fit the pool together: no
    preemption), the one of the largest priority value waits and finishes last (fcfs would admit it first). Every
    request's tokens equal the dense recompute's."""
    from serve import LLM

    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    prompts = [[5 + i, 17, 3 * i + 1, 40, 2, 9, 11 + i, 7] for i in range(3)]
    with LLM("llama_tiny", dtype="float64", check=True, scheduling_policy="priority", block_size=4,
             num_gpu_blocks_override=8, max_num_seqs=2) as llm:
        llm.add_request("low", prompts[0], greedy, priority=5)
        ended = [o for o in llm.step() if o.finished]
        llm.add_request("high", prompts[1], greedy, priority=0)  # admitted after "low", which has blocks to spare
        while llm.has_unfinished_requests():
            ended += [o for o in llm.step() if o.finished]
        assert [o.request_id for o in ended] == ["high", "low"] and llm.last_stats["preemptions"] > 0
        preempted = llm.last_stats["preemptions"]
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4), priority=[2, 0, 1])
        assert llm.stats()["preemptions"] == preempted  # 11 positions each: two hold 6 of the 8 blocks
        assert sorted(o.metrics.finished_time for o in outs)[1] < outs[0].metrics.finished_time  # prompt 0 last
        assert [o.oracle["verdict"] for o in ended + outs] == ["match"] * 5
        with pytest.raises(ValueError, match=r"give one priority per prompt \(3\)"):
            llm.generate(prompts, greedy, priority=[0])
        with pytest.raises(ValueError, match="priority='high' must be an integer"):
            llm.add_request("x", prompts[0], greedy, priority="high")


# ---- LLM from plain Python: ranks started here, text in and out ---------------------------------------------------

transformers = pytest.importorskip("transformers", reason="the transformers oracle needs pip install -e .[hf]")

@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("llm")
    out = {}
    for name in ("gpt2", "llama", "mixtral", "deepseek"):
        path = root / name
        tok = train_tokenizer(path)
        if name == "gpt2":
            cfg = transformers.GPT2Config(n_embd=64, n_head=4, n_layer=2, n_positions=64, vocab_size=len(tok),
                                          eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
            model = transformers.GPT2LMHeadModel(cfg)
        elif name == "mixtral":
            cfg = transformers.MixtralConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                             intermediate_size=48, num_hidden_layers=2, max_position_embeddings=64,
                                             num_local_experts=4, num_experts_per_tok=2, vocab_size=len(tok),
                                             eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                                             tie_word_embeddings=False)
            model = transformers.MixtralForCausalLM(cfg)
        elif name == "deepseek":
            cfg = transformers.DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                                                q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
                                                qk_nope_head_dim=16, v_head_dim=16, intermediate_size=96,
                                                moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
                                                num_experts_per_tok=2, n_group=2, topk_group=1,
                                                first_k_dense_replace=1, num_hidden_layers=2,
                                                max_position_embeddings=64, vocab_size=len(tok),
                                                eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                                                tie_word_embeddings=False)
            model = transformers.DeepseekV3ForCausalLM(cfg)
        else:
            cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                           intermediate_size=96, num_hidden_layers=2, max_position_embeddings=64,
                                           vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                                           bos_token_id=tok.bos_token_id, tie_word_embeddings=False)
            model = transformers.LlamaForCausalLM(cfg)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                p.add_(0.05 * torch.randn_like(p))  # away from init's symmetric values
        model.save_pretrained(path)
        out[name] = path
    return out


PROMPTS = ["the quick brown", "café ü", "中文", "tensor parallel serving is"]


def hf_generate(path, prompts, max_new):
    tok = transformers.AutoTokenizer.from_pretrained(path)
    # grouped_mm has no float64
    extra = {"experts_implementation": "eager"} if "mixtral" in str(path) or "deepseek" in str(path) else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float64, **extra).eval()
    out = []
    for text in prompts:
        ids = tok(text, return_tensors="pt")["input_ids"]
        gen = model.generate(ids, max_new_tokens=max_new, do_sample=False, pad_token_id=tok.eos_token_id)
        out.append(gen[0, ids.shape[1]:].tolist())
    return out, tok


# p = 4 runs through Llama (replicated K,V heads); Mixtral's tp placement is served against transformers in
# tests/test_moe.py: here the library's own path, once per family and placement kind
@pytest.mark.parametrize("name,p,moe", [("gpt2", 1, "tp"), ("gpt2", 2, "tp"), ("llama", 2, "tp"), ("llama", 4, "tp"),
                                        ("mixtral", 2, "ep"), ("deepseek", 2, "ep")],
                         ids=["gpt2-p1", "gpt2-p2", "llama-gqa-p2", "llama-gqa-replicated-kv-p4", "mixtral-ep-p2",
                              "deepseek-mla-ep-p2"])
def test_generate_equals_transformers(checkpoints, name, p, moe):
    from serve import LLM

    want, tok = hf_generate(checkpoints[name], PROMPTS, 12)
    online = (name, p) == ("gpt2", 2)
    with LLM(str(checkpoints[name]), tensor_parallel_size=p, dtype="float64", check=online,
             moe_parallel=moe) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12))
        stats = llm.stats()
        assert llm.executor.info["threads"] == llm.threads_per_rank  # the default choice, as rank 0 runs it
        if online:  # the online calls and bad input, on the same ranks, every request against the oracle
            online_checks(llm, tok)
            verdicts = llm.stats()["oracle"]
            assert set(verdicts) == {"match"} and verdicts["match"] >= 10, verdicts
            assert all(o.oracle["verdict"] == "match" for o in outs)
    assert [o.outputs[0].token_ids for o in outs] == want
    for o, text in zip(outs, PROMPTS):
        c = o.outputs[0]
        assert o.prompt == text and o.prompt_token_ids == tok(text)["input_ids"]
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
        assert c.finish_reason == ("stop" if c.token_ids[-1] == tok.eos_token_id else "length")
        assert o.metrics.arrival_time <= o.metrics.first_token_time <= o.metrics.finished_time
    assert stats["free_blocks"] == stats["num_blocks"] and stats["last_iteration"]["ledger_matches_model"]
    collectives = stats["last_iteration"]["collectives"]
    assert collectives.get("broadcast") == 1 if p > 1 else collectives == {}  # the step's control header


def online_checks(llm, tok):
    from serve import SamplingParams as SP

    greedy = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SP(temperature=0.0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    # a stop token id cuts at its first occurrence; a stop string cuts the text before it
    stop_id = greedy.token_ids[3]
    first = greedy.token_ids.index(stop_id)
    cut = llm.generate([[5, 6, 7]], SP(temperature=0.0, max_tokens=10, ignore_eos=True, stop_token_ids=[stop_id]))[0].outputs[0]
    assert cut.token_ids == greedy.token_ids[:first + 1] and cut.finish_reason == "stop" and cut.stop_reason == stop_id
    full = tok.decode(greedy.token_ids, skip_special_tokens=True)
    clean = [full[i:i + 2] for i in range(1, len(full) - 1) if "\ufffd" not in full[:i + 2]]
    if clean and clean[-1].strip():  # random weights may give no clean text; test_detokenizer covers stops for sure
        needle = clean[-1]
        s = llm.generate([[5, 6, 7]], SP(temperature=0.0, max_tokens=10, ignore_eos=True, stop=[needle]))[0].outputs[0]
        assert s.text == full[:full.index(needle)] and s.finish_reason == "stop" and s.stop_reason == needle
    # sampled with a seed: the same tokens alone and in a batch; logprobs for each token
    q = SP(max_tokens=8, temperature=1.0, top_p=0.9, seed=3, ignore_eos=True, logprobs=2)
    alone = llm.generate([[5, 6, 7]], q)[0].outputs[0]
    crowd = llm.generate([[9, 9], [5, 6, 7], "the quick"], [SP(max_tokens=5, temperature=0.7), q, SP(temperature=0.0)])[1].outputs[0]
    assert crowd.token_ids == alone.token_ids and len(alone.logprobs) == 8
    assert all(t in step and len(step) <= 3 for t, step in zip(alone.token_ids, alone.logprobs))
    assert abs(alone.cumulative_logprob - sum(step[t] for t, step in zip(alone.token_ids, alone.logprobs))) < 1e-9
    # online: add, step, abort between steps
    llm.add_request("a", "the quick", SP(temperature=0.0, max_tokens=20, ignore_eos=True))
    llm.add_request("b", "tensor", SP(temperature=0.0, max_tokens=5, ignore_eos=True))
    llm.step()
    llm.step()
    assert llm.abort_request("a")
    ended = {}
    while llm.has_unfinished_requests():
        for o in llm.step():
            if o.finished:
                ended[o.request_id] = o.outputs[0]
    assert ended["a"].finish_reason == "abort" and ended["b"].finish_reason == "length"
    assert llm.stats()["free_blocks"] == llm.stats()["num_blocks"]
    # bad input: one line, in the caller, and the engine goes on
    for prompt, params, msg in ((["x"], None, "not a token id"), ("", None, "empty prompt"),
                                ("the " * 100, SP(temperature=0.0, max_tokens=1), "context")):
        with pytest.raises(ValueError, match=msg):
            llm.generate(prompt if isinstance(prompt, str) else [prompt], params)
    assert llm.generate([[1, 2]], SP(temperature=0.0, max_tokens=2))[0].outputs[0].finish_reason in ("length", "stop")


def test_detokenizer_streams_whole_characters_and_cuts_at_stop_strings(tmp_path):
    from serve.detokenizer import IncrementalDetokenizer

    tok = train_tokenizer(tmp_path)
    text = "zebra über 🚀🙂 中字 naïve ok"
    ids = tok(text)["input_ids"]
    assert len(ids) > 8
    d = IncrementalDetokenizer(tok, [])
    deltas = [d.add([t]) for t in ids]
    d.finish()
    assert "".join(deltas) == d.text == tok.decode(ids) == text
    assert not any("\ufffd" in x for x in deltas)  # no half characters streamed
    assert sum(1 for x in deltas if x) < len(ids)  # some tokens completed no character on their own
    for stop in ("ï", "ber 🚀", "🙂", "中字", "ok"):  # within a token and across tokens
        d = IncrementalDetokenizer(tok, [], stop=(stop, "never there"))
        for t in ids:
            d.add([t])
        d.finish()
        assert d.text == text[:text.index(stop)] and d.stopped_by == stop


def test_llm_refuses_bad_settings_without_starting_ranks(checkpoints, tmp_path):
    from serve import LLM

    cases = [(dict(model="no_such_preset"), "no such directory or preset"),
             (dict(model=str(tmp_path)), "config.json"),
             (dict(model="llama_tiny", tensor_parallel_size=3), "tensor_parallel_size=3"),
             (dict(model="llama_tiny", tensor_parallel_size=0), "positive integer"),
             (dict(model="llama_tiny", max_num_seqs=0), "max_num_seqs=0 must be"),
             (dict(model="llama_tiny", max_model_len=2048), "max_model_len=2048 exceeds the 1024 positions"),
             (dict(model="llama_tiny", kv_cache_memory_bytes=100), "kv_cache_memory_bytes=100 holds no block of"),
             (dict(model="llama_tiny", dtype="float8"), "dtype")]
    for kwargs, msg in cases:
        with pytest.raises(ValueError, match=msg):
            LLM(**kwargs)


def test_a_dead_rank_raises_in_the_caller_and_stops_the_others(checkpoints):
    from serve import LLM

    llm = LLM(str(checkpoints["gpt2"]), tensor_parallel_size=2)
    llm.add_request("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    llm.step()
    llm.executor.procs[1].kill()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 exited"):  # the killed rank is named, whatever the call
        while True:
            llm.step() if time.monotonic() - start < 0.5 else llm.has_unfinished_requests()
    assert time.monotonic() - start < 10
    assert all(proc.poll() is not None for proc in llm.executor.procs)
    llm.shutdown()
    llm.shutdown()  # twice: harmless


def test_a_caller_that_polls_without_stepping_keeps_the_ranks_alive():
    """Calls that are not steps (here for twice the group's timeout) still let rank 0 send its keep-alives."""
    from serve import LLM

    # enforce_eager: compiling decode's kernels at load (1-8 s a rank) is longer than this group's timeout allows
    with LLM("llama_tiny", tensor_parallel_size=2, timeout_s=1.5, threads_per_rank=1, enforce_eager=True) as llm:
        # each rank runs with the threads chosen for it (tp/dist.py threads_per_rank; a given number wins)
        assert (llm.threads_per_rank, llm.threads_why, llm.executor.info["threads"]) == (1, "threads_per_rank", 1)
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            assert not llm.has_unfinished_requests()
            time.sleep(0.05)
        assert len(llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=3))[0].outputs[0].token_ids) == 3


def test_ranks_do_not_outlive_a_killed_caller(checkpoints):
    script = textwrap.dedent(f"""
        from serve import LLM
        llm = LLM({str(checkpoints['gpt2'])!r}, tensor_parallel_size=2)
        print(" ".join(str(p.pid) for p in llm.executor.procs), llm.executor.dir, flush=True)
        import time; time.sleep(120)
    """)
    caller = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(__file__)))
    *pids, directory = caller.stdout.readline().split()
    pids = [int(p) for p in pids]
    assert len(pids) == 2 and os.path.isdir(directory)
    caller.send_signal(signal.SIGKILL)
    caller.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)
    assert not os.path.exists(directory)  # rank 0 removed the driver's directory


def test_ctrl_c_in_a_script_reaches_the_script_alone():
    """A terminal's Ctrl-C is SIGINT to the script's process group; the ranks are in their own group. A script that
    handles it (its own handler: finish what it is doing) keeps its ranks and generates on. Left to Python's
    default, it interrupts the script's wait: every rank is stopped at once, and KeyboardInterrupt reaches the
    script, with its own traceback only (none from a rank) and no process or directory left behind."""
    script = textwrap.dedent("""
        import signal
        from serve import LLM, SamplingParams
        asked = []
        signal.signal(signal.SIGINT, lambda *_: asked.append(1))  # a script that winds down on Ctrl-C
        llm = LLM("llama_tiny", tensor_parallel_size=2)
        print(" ".join(str(p.pid) for p in llm.executor.procs), llm.executor.dir, flush=True)
        q = SamplingParams(max_tokens=8, ignore_eos=True)
        while not asked:
            llm.generate([[1, 2, 3]] * 2, q)
        print("wound down", len(llm.generate([[1, 2, 3]], q)[0].outputs[0].token_ids), flush=True)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        print("again", flush=True)
        try:
            while True:
                llm.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=1000, ignore_eos=True))
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            raise
    """)
    caller = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=os.path.dirname(os.path.dirname(__file__)), start_new_session=True)
    *pids, directory = caller.stdout.readline().split()
    pids = [int(p) for p in pids]
    time.sleep(0.3)
    os.killpg(caller.pid, signal.SIGINT)
    assert caller.stdout.readline().strip() == "wound down 8"  # the ranks did not get it
    assert caller.stdout.readline().strip() == "again"
    time.sleep(0.5)  # generating
    t0 = time.monotonic()
    os.killpg(caller.pid, signal.SIGINT)
    out, err = caller.communicate(timeout=30)
    took = time.monotonic() - t0
    assert out.strip() == "interrupted" and caller.returncode != 0, (out, err)
    assert err.rstrip().endswith("KeyboardInterrupt") and err.count("Traceback") == 1, err
    assert "serve/worker.py" not in err and "serve/engine.py" not in err, err
    assert took < 10, took
    assert not any(alive(p) for p in pids) and not os.path.exists(directory)


CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_the_cli_samples_as_generate_and_chat_renders_the_checkpoints_template(checkpoints, capsys, tmp_path):
    """python -m serve's sampling flags are SamplingParams' fields: its text and logprobs at p = 2 equal LLM.generate's
    at p = 1 with the same settings (sampling is exact at every TP size); --seed is the sampling seed. On the same
    LLM, chat() with a tokenizer that has a chat template: its rendering (transformers' apply_chat_template with the
    generation prompt), encoded without added special tokens, then generated. (The plain template, for a tokenizer
    without one, is checked against the server's chat completions in test_api.py.)"""
    import shutil

    from serve import LLM
    from serve.__main__ import main

    path = tmp_path / "chat"  # the gpt2 checkpoint, its tokenizer given a chat template
    shutil.copytree(checkpoints["gpt2"], path)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    path = str(path)
    flags = ["--temperature", "0.6", "--top-p", "0.6", "--top-k", "30", "--min-p", "0.3", "--seed", "11",
             "--max-tokens", "10", "--ignore-eos", "--logprobs", "2"]  # each filter binds on this model
    params = SamplingParams(temperature=0.6, top_p=0.6, top_k=30, min_p=0.3, seed=11, max_tokens=10,
                            ignore_eos=True, logprobs=2)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text",
                                                                                           "text": "the quick"}]}]
    text = "<system>be brief<user>the quick<assistant>"  # the template above, by hand
    with LLM(path) as llm:
        want = llm.generate(["the quick brown"], params)[0].outputs[0]
        other = llm.generate(["the quick brown"], SamplingParams(**{**params.__dict__, "seed": 12}))[0].outputs[0]
        assert llm.get_tokenizer() is llm.tokenizer and llm.max_model_len == 64
        chats = llm.chat([messages, messages[1:]], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
        plain = llm.generate([{"prompt_token_ids": tok(text, add_special_tokens=False)["input_ids"]}],
                             SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0]
        for bad, message in (([{"content": "hi"}], "a message is a dict with a 'role'"),
                             ([{"role": "user", "content": [{"type": "image_url"}]}], "only text content parts")):
            with pytest.raises(ValueError, match=message):
                llm.chat(bad)
        # Ctrl-C while generate() adds its prompts (in the second add's wait, which kills the ranks and raises, as
        # MultiprocExecutor.wait does): KeyboardInterrupt reaches the caller, not an error from cleaning up
        real_wait, waits = llm.executor.wait, []

        def interrupted(what, deadline=None):
            waits.append(what)
            if len(waits) == 2:
                llm.executor.kill()
                raise KeyboardInterrupt
            return real_wait(what, deadline)

        llm.executor.wait = interrupted
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["a", "b", "c"], SamplingParams(temperature=0.0, max_tokens=2))
        assert all(proc.poll() is not None for proc in llm.executor.procs)
    assert chats[0].prompt == text and chats[0].outputs[0].token_ids == plain.outputs[0].token_ids
    assert chats[1].prompt == "<user>the quick<assistant>"
    with pytest.raises(ValueError, match="chat\\(\\) needs a tokenizer"):  # refused before anything is sent
        LLM.chat(type("NoTokenizer", (), {"tokenizer": None})(), messages)
    assert want.token_ids != other.token_ids  # the seed decides the draw
    capsys.readouterr()
    assert main(["--model", path, "--tokenizer", path, "--tensor-parallel-size", "2", "--prompt", "the quick brown",
                 *flags]) == 0
    out, err = capsys.readouterr()
    text, header, *rows = out.rstrip("\n").split("\n")
    assert text == want.text and "finish_reason=length" in err, (out, err)
    assert header.startswith("logprobs") and len(rows) == len(want.token_ids) == 10
    for row, t, step in zip(rows, want.token_ids, want.logprobs):
        chosen, top = row.split(" | ")
        assert int(chosen.split()[1]) == t and abs(float(chosen.split()[-1]) - step[t]) < 1e-5
        best = sorted(step.values(), reverse=True)[:2]
        shown = [float(part.split()[-1]) for part in top.split(", ")]  # printed to 5 decimals
        assert len(shown) == 2 and all(abs(a - b) <= 1e-5 for a, b in zip(shown, best)), (shown, best)
    # a stop string: cut where generate cuts
    needle = next((want.text[i:i + 2] for i in range(2, len(want.text) - 2)
                   if want.text[i:i + 2].strip() and "\ufffd" not in want.text[:i + 2]), None)
    if needle is not None:
        assert main(["--model", path, "--prompt", "the quick brown", *flags[:-2], "--stop", needle]) == 0
        out, err = capsys.readouterr()
        assert out.rstrip("\n") == want.text[:want.text.index(needle)] and "finish_reason=stop" in err, (out, err)
    for argv, message in ((["--model", str(tmp_path / "nope"), "--prompt", "hi"], "no such directory or preset"),
                          (["--model", path, "--tokenizer", str(tmp_path / "nope"), "--prompt", "hi"],
                           "--tokenizer .*: no such directory"),
                          (["--model", path, "--prompt", "hi", "--max-model-len", "4000"], "--max-model-len=4000"),
                          (["--model", path, "--prompt", "hi", "--top-p", "0"], "top_p=0")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert re.search(message, err) and err.count("\n") == 1, err


def test_the_toy_model_is_a_checkpoint_transformers_and_llm_read_alike(tmp_path):
    """python -m serve.toy_model writes each family in save_pretrained's layout with a BPE that round-trips any
    text; LLM's greedy tokens on it equal transformers' generate (at p = 1: TP's exactness is the other tests')."""
    from serve import LLM
    from serve.toy_model import main

    for family in ("gpt2", "llama", "mixtral"):
        assert main([str(tmp_path / family), "--family", family]) == 0
        config = transformers.AutoConfig.from_pretrained(tmp_path / family)
        assert config.model_type == family and config.vocab_size == 1024
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "llama")
    text = "Once upon a time, café über 中文 🙂 — and a word the corpus never had: zyxwvut"
    assert tok.decode(tok(text)["input_ids"]) == text
    with pytest.raises(SystemExit):  # argparse: not one of the families
        main([str(tmp_path / "x"), "--family", "bert"])
    want, _ = hf_generate(tmp_path / "llama", ["Once upon a time"], 8)
    with LLM(str(tmp_path / "llama"), dtype="float64") as llm:
        out = llm.generate("Once upon a time", SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0]
    assert out.token_ids == want[0] and out.text == tok.decode(want[0], skip_special_tokens=True)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by init) is gone for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def test_every_engine_default_is_written_once():
    """The engine's defaults live in serve/config.py (EngineConfig) and tp/dist.py (DEFAULT_TIMEOUT_S); the scheduler,
    the block manager, both engines, P/D, LLM and the launcher's settings refer to them instead of restating them."""
    import dataclasses
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parent.parent
    sources = {p: p.read_text() for d in ("serve", "launch", "tp", "layers") for p in (root / d).rglob("*.py")}
    config = root / "serve" / "config.py"
    for f in dataclasses.fields(EngineConfig):
        if f.default is None or f.name == "check_ledger":
            continue
        value = f"[\"']{re.escape(f.default)}[\"']" if isinstance(f.default, str) else re.escape(repr(f.default))
        literal = re.compile(rf"\b{f.name}(: [\w| ]+)?\s*=\s*(setting\()?{value}\s*[,)\n]")  # setting(default, help)
        where = [p.name for p, text in sources.items() if literal.search(text)]
        assert where == [config.name] if f.name not in ("comm_timing",) else config.name in where, (f.name, where)
    timeouts = [p.name for p, text in sources.items() if re.search(r"timeout_s\w*(: float)?\s*=\s*120", text)]
    assert timeouts == [], timeouts
    assert "DEFAULT_TIMEOUT_S = 120.0" in sources[root / "tp" / "dist.py"]


def test_the_spine_reads_in_one_screen():
    """LLMEngine.step is the decode path in order (control, schedule, agree, run, update, hooks), short enough to
    read at once; the offline driver (OfflineEngine.run), the ranks behind LLM and the tests' drivers
    (tests/common.py step_engine) step it through drive(), the one step loop, not a second copy of the loop."""
    import inspect

    from serve.engine import LLMEngine
    from serve.offline import OfflineEngine, drive

    import pathlib

    from serve import worker

    step = inspect.getsource(LLMEngine.step).splitlines()
    assert len(step) <= 40, len(step)
    run, loop = inspect.getsource(OfflineEngine.run), inspect.getsource(drive)
    assert "drive(engine" in run and "engine.step()" in loop
    assert all("runner.run" not in s and ".schedule(" not in s for s in (run, loop))
    # the ranks behind LLM and a server reach the same loop: rank 0 fed by the driver's calls (a feed and a sink)
    assert "drive(engine, feed" in inspect.getsource(worker._serve)
    root = pathlib.Path(__file__).resolve().parent.parent
    loop = re.compile(r"(while|for) [^\n]*:\n[^\n]*\bengine\.step\(\)")  # a loop whose body steps an engine
    stepping = [str(p.relative_to(root)) for d in ("serve", "launch", "benchmarks", "tests")
                for p in (root / d).rglob("*.py") if loop.search(p.read_text())]
    assert stepping == ["serve/offline.py"], stepping  # no second loop over LLMEngine.step outside drive()


def test_a_stop_string_ends_the_request_in_the_driver_and_aborts_it_in_the_engine(tmp_path):
    """The driver's side of stop strings, with rank 0 played by a stub: the text is cut before the match, the request
    is reported finished ("stop"), the engine is told to abort it (without waiting inside generate's loop), and the
    engine's later abort output is dropped."""
    from serve.detokenizer import IncrementalDetokenizer
    from serve.llm import LLM
    from serve.outputs import CompletionOutput, RequestMetrics, RequestOutput

    tok = train_tokenizer(tmp_path)
    ids = tok("the quick brown fox jumps")["input_ids"]

    class Executor:
        sent = []

        def send(self, *message):
            self.sent.append(message)

    llm = LLM.__new__(LLM)
    llm.executor, llm._stopped = Executor(), set()
    llm._detok = {"a": IncrementalDetokenizer(tok, [], stop=("own f",))}

    def output(n, finished=False, reason=None):
        return RequestOutput("a", None, [1], [CompletionOutput(0, "", ids[:n], reason)], finished, RequestMetrics(0.0))

    seen = []
    for n in range(1, len(ids) + 1):
        seen += llm._receive([output(n)])
        if seen[-1].finished:
            break
    last = seen[-1].outputs[0]
    assert seen[-1].finished and last.finish_reason == "stop" and last.stop_reason == "own f"
    assert last.text == "the quick br" and Executor.sent == [("abort_nowait", "a")]
    assert llm._receive([output(len(ids), True, "abort")]) == []  # the engine's abort: dropped


def test_the_scheduler_and_block_manager_import_no_torch():
    """Plain Python over plain data: importing them (with their config and tp/partition.py) loads no torch."""
    import subprocess

    code = "import sys, serve.scheduler, serve.block_manager, serve.request; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_the_launcher_shows_the_generated_text_when_the_checkpoint_has_a_tokenizer(checkpoints, tmp_path):
    """launch/serve.py with a checkpoint that has tokenizer files: report.json keeps each request's text, decoded by
    the checkpoint's tokenizer, and the report prints it; without tokenizer files, nothing is added."""
    from launch.serve import add_text
    from launch.serve_report import render_texts

    tok = transformers.AutoTokenizer.from_pretrained(checkpoints["gpt2"])
    ids = tok("café naïve 中文")["input_ids"]
    requests = [{"request": 0, "output_ids": ids}, {"request": 1, "output_ids": ids[:2]}]
    add_text(requests, str(checkpoints["gpt2"]))
    assert requests[0]["text"] == "café naïve 中文" and requests[1]["text"] == tok.decode(ids[:2])
    lines = render_texts(requests)
    assert lines[1].startswith("generated text") and lines[2] == "  0: 'café naïve 中文'"
    bare = [{"request": 0, "output_ids": ids}]
    add_text(bare, str(tmp_path))  # a directory without tokenizer files
    assert "text" not in bare[0] and render_texts(bare) == []
