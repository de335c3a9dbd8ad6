"""The paged KV cache: block tables, prefix caching, preemption, and attention batched per layer.

Oracles: the cache-free dense recompute (greedy_reference), the per-request reference attention, and the same run
without prefix caching. Float64 throughout.
"""

import pytest
import torch

from layers.models.dense import init_weights
from layers.models.llama import LlamaConfig
from layers.models.lm import dense_lm, greedy_reference, shard_lm
from serve.block_manager import KVCacheManager
from serve.offline import OfflineEngine
from serve.config import EngineConfig
from serve.model_runner import prepare_step
from serve.plan import ScheduledRequest, SchedulerOutput
from serve.request import Request
from serve.scheduler import Scheduler, SchedulerError
from tests.harness import run_ranks
from tests.test_serve import CFG

LLAMA = LlamaConfig(d_model=64, n_heads=8, n_kv_heads=2, d_head=8, d_ffn=96, n_layers=2, max_seq_len=96,
                    vocab_size=CFG.vocab_size)
WORKLOAD = [(9, 6, 0), (17, 4, 0), (3, 8, 1), (25, 5, 2), (1, 3, 2)]  # (prompt, max_new_tokens, arrival)


def requests(workload=WORKLOAD, seed=5, prefix=()):
    gen = torch.Generator().manual_seed(seed)
    return [Request(i, list(prefix) + torch.randint(0, CFG.vocab_size, (n,), generator=gen).tolist(), new, arrival)
            for i, (n, new, arrival) in enumerate(workload)]


def model(family):
    return init_weights(dense_lm(CFG if family == "gpt2" else LLAMA, torch.float64), seed=0)


def oracle(dense, reqs):
    out = []
    for r in reqs:
        ref = greedy_reference(dense, r.prompt, r.max_new_tokens)
        assert min(ref.margins) > 1e-9, "near-tie in the oracle: pick another seed"
        out.append(ref.ids)
    return out


# ---- the block manager alone (host data, no torch) --------------------------------------------------------------


def test_block_table_grows_one_block_at_a_time_and_slots_follow_it():
    bm = KVCacheManager(num_blocks=4, block_size=3)
    bm.admit(0, [])
    for end, blocks in [(1, 1), (3, 1), (4, 2), (7, 3)]:
        bm.grow(0, end)
        assert len(bm.tables[0]) == blocks
    assert bm.slots(0, 2, 5) == [bm.tables[0][0] * 3 + 2, bm.tables[0][1] * 3, bm.tables[0][1] * 3 + 1]
    assert bm.num_free == 1 and bm.rows_that_fit(0, 7, 10) == 5  # 2 left in its last block + one free block of 3
    bm.release(0)
    assert bm.num_free == 4
    bm.check()


def test_prefix_blocks_are_shared_counted_and_revived_lru():
    bm = KVCacheManager(num_blocks=6, block_size=2)
    a = [1, 2, 3, 4, 5]
    bm.admit(0, bm.match_prefix(a))
    bm.grow(0, 5)
    bm.commit(0, a, 5)  # two full blocks named; the half-full third is not
    assert len(bm.cached) == 2
    hit = bm.match_prefix([1, 2, 3, 4, 9, 9])
    assert hit == bm.tables[0][:2]
    bm.admit(1, hit)
    assert [bm.blocks[b].ref_count for b in hit] == [2, 2]
    assert bm.match_prefix([1, 2, 3, 4]) == hit[:1]  # a whole-prompt hit still leaves its last token to compute
    assert bm.match_prefix([1, 2, 7, 4, 5]) == hit[:1]  # the chain breaks at the first differing block
    assert bm.match_prefix([2, 1, 3, 4, 5]) == []  # same tokens later, different prefix: a different hash
    bm.release(1)
    bm.release(0)
    bm.check()
    assert bm.num_free == 6 and len(bm.cached) == 2  # freed, still named: a later request can revive them
    hit = bm.match_prefix([1, 2, 3, 4, 0])
    assert len(hit) == 2 and bm.admit_cost([1, 2, 3, 4, 0], 1) == (hit, 3)  # revive 2, one new block
    # Taking blocks for new tokens uses the least recently freed first; the cached ones are overwritten last.
    bm.admit(2, [])
    bm.grow(2, 8)  # 4 blocks: the never-used ones and request 0's unnamed tail block, before the prefix
    assert set(bm.tables[2]).isdisjoint(hit) and len(bm.cached) == 2
    bm.grow(2, 12)  # now the pool is full: the named blocks are taken and forgotten
    assert len(bm.cached) == 0 and bm.match_prefix([1, 2, 3, 4, 0]) == []
    bm.release(2)
    bm.check()


def test_release_below_zero_is_caught():
    bm = KVCacheManager(num_blocks=2, block_size=2)
    bm.admit(0, [])
    bm.grow(0, 2)
    b = bm.tables[0][0]
    bm.blocks[b].ref_count = 0  # a bug elsewhere: the count already dropped
    with pytest.raises(AssertionError, match="freed more often than taken"):
        bm.release(0)


def test_a_request_that_cannot_fit_alone_is_refused_with_the_minimum():
    with pytest.raises(SchedulerError, match=r"raise num_gpu_blocks_override to at least 4"):
        Scheduler(EngineConfig(long_prefill_token_threshold=4, max_num_batched_tokens=8, max_num_seqs=8, block_size=4), KVCacheManager(3, 4), [Request(0, [1] * 10, 4)])  # 13 positions: 4 blocks of 4


def drive(reqs, num_gpu_blocks_override, block_size, chunk=4, budget=8, enable_prefix_caching=True):
    """The scheduler alone with made-up tokens (the request id): every plan, and the manager."""
    bm = KVCacheManager(num_gpu_blocks_override, block_size, enable_prefix_caching)
    sched, plans, index = Scheduler(EngineConfig(long_prefill_token_threshold=chunk, max_num_batched_tokens=budget, max_num_seqs=budget, block_size=block_size, enable_prefix_caching=enable_prefix_caching), bm, reqs), [], 0
    while sched.has_work():
        plan = sched.schedule(index)
        if plan is None:
            index = sched.next_arrival()
            continue
        plans.append((plan, bm.num_used))
        assert bm.num_used <= num_gpu_blocks_override
        sched.update_from_output(plan, {c.request: 100 + c.request for c in plan.scheduled if c.sample})
        bm.check()
        index += 1
    return sched, plans


def test_preemption_when_a_decode_needs_a_block_and_none_is_free():
    reqs = [Request(i, [i] * 6, 7) for i in range(3)]  # 12 positions each: 3 blocks of 4, 9 for all three
    sched, plans = drive(reqs, num_gpu_blocks_override=5, block_size=4, enable_prefix_caching=False)
    assert sched.preemptions > 0
    assert all(r.finished and r.output == [100 + r.id] * 7 for r in reqs)
    assert sched.blocks.num_free == 5
    first = next(p for p, _ in plans if p.preempted)
    assert first.preempted == (2,)  # the most recently admitted gives its blocks back
    # the victim recomputes prompt + generated tokens from scratch (prefix caching off), then samples its next
    # token at the end of that recompute
    again = [c for p, _ in plans for c in p.scheduled if c.request == 2 and p.index > first.index]
    assert again[0].q_start == 0 and not again[0].decode


def test_a_request_arriving_with_cached_positions_waits_without_holding_blocks():
    """It takes blocks for its cached positions and its first decode row only when all are free: a waiting request
    never holds blocks that the running ones need (that could leave nothing to run and nothing admissible)."""
    a = Request(0, [1, 2, 3, 4, 5], 6)
    handed = Request(1, [7] * 8, 2, arrival=1, output=[3], num_computed_tokens=8)  # 8 positions cached: 3 blocks with its row
    sched, plans = drive([a, handed], num_gpu_blocks_override=4, block_size=4)
    joined = next(p for p, _ in plans if 1 in p.admitted)
    assert all(c.request == 0 for p, _ in plans if p.index < joined.index for c in p.scheduled)
    assert 0 not in {c.request for c in joined.scheduled} and a.finished  # it joined when request 0 had finished
    assert handed.output == [3, 101] and sched.blocks.num_free == 4


def test_a_preempted_request_waits_at_least_one_iteration_and_its_own_blocks_count_as_hits_when_it_returns():
    reqs = [Request(i, [i + 1] * 8, 9) for i in range(3)]  # 16 positions each: 4 blocks of 4
    sched, plans = drive(reqs, num_gpu_blocks_override=9, block_size=4)
    assert sched.preemptions == 1
    for plan, _ in plans:
        assert not set(plan.admitted) & set(plan.preempted)
    # no two prompts share a block; the resumed one finds its own first full block (still named in the free queue)
    assert [(r.preemptions, r.prefix_hit, r.num_cached_tokens) for r in reqs] == [(0, 0, 0), (0, 0, 0), (1, 4, 0)]


# ---- the engine: paged == reference == dense --------------------------------------------------------------------


def paged_equals_oracle(ctx, family, grid):
    dense = model(family)
    lm = shard_lm(dense, "v2", ctx.group)
    reqs = requests()
    want = oracle(dense, reqs)
    longest = max(len(r.prompt) for r in reqs)
    out = {}
    for block_size, chunk in grid:
        chunk = longest if chunk is None else chunk  # None: the whole prompt in one chunk
        for mode in ("batched", "cpu", "reference"):
            res = OfflineEngine(lm, ctx, EngineConfig(long_prefill_token_threshold=chunk, max_num_batched_tokens=longest + 8, block_size=block_size, attention=mode, max_num_seqs=longest + 8)).run(requests())
            out[block_size, chunk, mode] = ([r["output_ids"] for r in res.requests] == want,
                                            res.ledger_matches_model, res.preemptions,
                                            res.free_blocks_at_end == res.num_blocks)
    return out


FULL_GRID = [(b, c) for b in (1, 3, 16) for c in (1, 5, None)]  # (block_size, long_prefill_token_threshold; None: whole prompts)


@pytest.mark.parametrize("family,p", [("gpt2", 1), ("gpt2", 2), ("gpt2", 4), ("llama", 1), ("llama", 4)])
def test_paged_tokens_equal_the_dense_oracle_and_the_reference(family, p):
    """Every block_size x chunk size x attention mode at p = 1 (what paging does is the same on every rank); at
    p = 2, 4 the corners that differ most, one-position blocks with one-token chunks and whole prompts in
    16-position blocks, and the middle; Llama at p = 4 > h_kv = 2 (replicated K,V heads)."""
    grid = FULL_GRID if p == 1 else [(1, 1), (3, 5), (16, None)]
    for res in run_ranks(p, paged_equals_oracle, family, grid):
        assert len(res) == 3 * len(grid)
        for key, (same, ledger_ok, preemptions, all_free) in res.items():
            assert same and ledger_ok and all_free, key
            assert preemptions == 0, key  # num_gpu_blocks_override = null: enough for the worst case


def prefix_rows(ctx, block_size):
    dense = model("gpt2")
    lm = shard_lm(dense, "v2", ctx.group)
    gen = torch.Generator().manual_seed(11)
    shared = torch.randint(0, CFG.vocab_size, (40,), generator=gen).tolist()
    first = requests([(7, 3, 0), (4, 3, 3), (12, 3, 3), (1, 3, 4)], prefix=shared)
    repeat = Request(len(first), list(first[1].prompt), 3, arrival=6)  # an exact repeat of an earlier prompt
    workload = lambda: [Request(r.id, list(r.prompt), r.max_new_tokens, r.arrival) for r in first + [repeat]]  # noqa
    want = oracle(dense, workload())
    runs = {}
    for cache in (True, False):
        res = OfflineEngine(lm, ctx, EngineConfig(long_prefill_token_threshold=16, max_num_batched_tokens=64, block_size=block_size, enable_prefix_caching=cache, max_num_seqs=64)).run(workload())
        runs[cache] = ([r["output_ids"] for r in res.requests], res.rows_computed, res.prefix_hit_tokens,
                       [r["prefix_hit_tokens"] for r in res.requests])
        assert sum(it["prefix_hit_tokens"] for it in res.iterations) == res.prefix_hit_tokens  # per iteration too
    return runs, want, [len(r.prompt) for r in workload()]


@pytest.mark.parametrize("block_size", [1, 16])
def test_prefix_caching_computes_fewer_rows_by_exactly_the_shared_blocks(block_size):
    runs, want, lengths = run_ranks(2, prefix_rows, block_size)[0]
    (ids_on, rows_on, hits_on, per_request), (ids_off, rows_off, hits_off, _) = runs[True], runs[False]
    assert ids_on == ids_off == want
    assert hits_off == 0
    # Request 0 arrives alone and computes everything; later requests share the 40-token prefix's full blocks;
    # the exact repeat of request 1 hits every full block before its last token.
    shared = [0] + [40 // block_size * block_size] * 3 + [(lengths[1] - 1) // block_size * block_size]
    assert per_request == shared and hits_on == sum(shared) > 0
    assert rows_off - rows_on == hits_on  # rows computed drop by exactly the shared full blocks
    if block_size == 1:
        assert per_request[-1] == lengths[-1] - 1  # a whole-prompt hit still computes its last token


def preempting(ctx, family, mode):
    dense = model(family)
    lm = shard_lm(dense, "v2", ctx.group)
    reqs = requests([(9, 12, 0), (17, 10, 0), (3, 14, 0), (12, 12, 1)])
    want = oracle(dense, reqs)
    res = OfflineEngine(lm, ctx, EngineConfig(long_prefill_token_threshold=5, max_num_batched_tokens=16, block_size=4, num_gpu_blocks_override=9, attention=mode, max_num_seqs=16)).run(requests([(9, 12, 0), (17, 10, 0), (3, 14, 0), (12, 12, 1)]))
    # the layout before paging: one contiguous region of prompt + max_new_tokens - 1 positions per request
    contiguous = OfflineEngine(lm, ctx, EngineConfig(long_prefill_token_threshold=5, max_num_batched_tokens=16, block_size=1, enable_prefix_caching=False, reserve_capacity=True, max_num_seqs=16)).run(requests([(9, 12, 0), (17, 10, 0), (3, 14, 0), (12, 12, 1)]))
    return ([r["output_ids"] for r in res.requests] == want == [r["output_ids"] for r in contiguous.requests],
            res.preemptions, res.free_blocks_at_end, max(it["blocks_used"] for it in res.iterations),
            res.ledger_matches_model)


@pytest.mark.parametrize("family,p,mode", [("gpt2", 2, "batched"), ("llama", 4, "batched"), ("gpt2", 1, "reference"),
                                           ("llama", 2, "cpu")])
def test_preemption_by_recompute_leaves_the_tokens_unchanged(family, p, mode):
    """paged (preempting) == contiguous (a full reservation per request) == dense"""
    for same, preemptions, free, peak, ledger_ok in run_ranks(p, preempting, family, mode):
        assert preemptions > 0  # 9 blocks of 4 cannot hold the four requests at once (they need 7 alone)
        assert same and ledger_ok
        assert free == 9 and peak <= 9  # every block back at the end; never more than the pool


# ---- launch shape: aten operations per decode iteration ---------------------------------------------------------


def decode_ops(ctx, counts, mode):
    from benchmarks.bench_paged import decode_ops as count

    lm = shard_lm(model("gpt2"), "v2", ctx.group)
    return [count(lm, [5 + 3 * (i % 20) for i in range(n)], mode, positions_per_block=4) for n in counts]  # < max_seq_len


def test_aten_ops_per_decode_iteration_do_not_grow_with_requests():
    batched = run_ranks(1, decode_ops, [1, 8, 32], "batched")[0]
    reference = run_ranks(1, decode_ops, [1, 8, 32], "reference")[0]
    assert batched[0] == batched[1] == batched[2]
    assert reference[0] < reference[1] < reference[2]  # the per-request loop: the count can fail


def test_auto_picks_the_attention_backend_by_device():
    from layers.attention.backends import BACKENDS, choose
    from serve.config import ATTENTION_MODES

    assert set(ATTENTION_MODES) == {"auto", *BACKENDS}  # the settings' list is the backends'
    assert choose("auto", "cpu") == "cpu" and choose("auto", torch.device("cuda", 1)) == "batched"
    assert [choose(name, "cpu") for name in BACKENDS] == list(BACKENDS)  # a named backend is taken as named
    with pytest.raises(ValueError, match="attention='tiled': choose auto, reference, batched, cpu, flash"):
        choose("tiled", "cpu")


# ---- the launcher's settings ------------------------------------------------------------------------------------


def serve_settings(*overrides):
    """launch/serve.py's validation, in process: everything it checks before the first collective."""
    from hydra import compose, initialize_config_dir

    from launch.serve_settings import parse_settings
    from tests.launching import ROOT

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return parse_settings(compose("serve", overrides=list(overrides)), 2, 2)


PAGING_BAD = [
    (["block_size=0"], "block_size=0 must be an integer of at least 1"),
    (["num_gpu_blocks_override=0"], "num_gpu_blocks_override=0 must be an integer of at least 1"),
    (["prompts=[[1,2,3,4,5,6,7,8,9]]", "max_new_tokens=8", "block_size=4", "num_gpu_blocks_override=3"],
     "request 0 cannot be held even alone: prompt 9 + max_new_tokens 8 - 1 = 16 positions need 4 KV blocks of "
     "block_size=4, more than the pool's num_gpu_blocks_override=3; raise num_gpu_blocks_override to at least 4"),
    (["enable_prefix_caching=maybe"], "enable_prefix_caching='maybe' must be true or false"),
    (["attention=fast"], "attention='fast': choose auto, cpu, batched, reference or flash"),
    (["shared_prefix=-1"], "shared_prefix=-1 must be 0 or more"),
    # prompt + max_new_tokens <= max_seq_len (vLLM's rule): 1024 - 16 = 1008 positions for a prompt
    (["shared_prefix=1008"], "shared_prefix=1008 is too long: with max_new_tokens=16 a prompt has at most 1008 "
                             "positions in model.max_seq_len=1024, and needs one token of its own; use shared_prefix <= 1007"),
    (["shared_prefix=4", "prompts=[[1,2]]"], "shared_prefix=4 applies to random prompts"),
    (["pd.prefill_ranks=1", "pd.decode_ranks=1", "prompts=[[1,2,3,4,5,6,7,8,9]]", "max_new_tokens=8", "block_size=8",
      "num_gpu_blocks_override=2", "pd.decode_block_size=4"],
     "request 0 cannot be held on the decode side: 16 positions need 4 KV blocks of block_size=4"),
    (["pd.decode_block_size=4"], "pd.decode_block_size=4 without pd"),
    (["pd.prefill_ranks=1", "pd.decode_ranks=1", "pd.decode_block_size=0"], "pd.decode_block_size=0 must be a positive"),
]


@pytest.mark.parametrize("overrides,message", PAGING_BAD, ids=[" ".join(b[0]) for b in PAGING_BAD])
def test_bad_paging_settings_are_refused_before_any_collective(overrides, message):
    from tp.dist import ConfigError

    with pytest.raises(ConfigError) as err:
        serve_settings(*overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_shared_prefix_is_prepended_to_every_random_prompt():
    plain, shared = serve_settings("prompt_count=4"), serve_settings("prompt_count=4", "shared_prefix=48")
    prefix = shared.requests[0].prompt[:48]
    assert all(r.prompt[:48] == prefix for r in shared.requests)
    assert [r.prompt[48:] for r in shared.requests] == [r.prompt for r in plain.requests]
    e = shared.engine
    assert (e.block_size, e.num_gpu_blocks_override, e.enable_prefix_caching, e.attention) == (16, None, True, "auto")


def test_kv_blocks_too_small_fails_fast_on_a_lone_rank():
    from tests.launching import refused

    refused(["num_gpu_blocks_override=1"], "[rank 1] error: request 0 cannot be held even alone")


def test_serve_launcher_with_a_shared_prefix_and_a_small_pool(tmp_path):
    import json

    from tests.launching import launch_on_pool
    from tests.test_serve_launcher import SMALL

    proc, _ = launch_on_pool(2, *SMALL, "shared_prefix=24", "block_size=4", "num_gpu_blocks_override=14", run_dir=tmp_path,
                             script="serve.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "paged KV: 14 blocks x 4 positions per rank" in proc.stdout and "PASS" in proc.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    kv, totals = report["kv_cache"], report["totals"]
    assert kv["block_size"] == 4 and kv["blocks"] == 14 and kv["prefix_hit_tokens"] > 0
    assert totals["preemptions"] > 0 and report["check"]["ok"] is True  # preempted, recomputed, still the oracle's
    assert all(0 < it["blocks_used"] <= 14 for it in report["iterations"])
    assert kv["prefix_hit_tokens"] == sum(r["prefix_hit_tokens"] for r in report["requests"])


def test_pd_launcher_on_bounded_pools_with_a_shared_prefix_and_its_own_decode_block_size(tmp_path):
    import json

    from tests.launching import launch_on_pool
    from tests.test_serve_launcher import SMALL

    proc, _ = launch_on_pool(2, *SMALL, "shared_prefix=24", "block_size=4", "num_gpu_blocks_override=18", "pd.prefill_ranks=1",
                             "pd.decode_ranks=1", "pd.decode_block_size=3", run_dir=tmp_path, script="serve.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    kv = report["kv_cache"]
    assert (kv["block_size"], kv["decode_block_size"], kv["kv_blocks"]) == (4, 3, 18) and kv["prefix_hit_tokens"] > 0
    assert max(kv["peak_blocks_used"].values()) <= 18
    assert report["check"]["ok"] is True and report["same_as_colocated"] and report["ledger_matches_model"]


def test_prompt_chunks_are_grouped_by_length_into_a_fixed_number_of_calls():
    from layers.attention.backends import PROMPT_GROUPS, split

    chunks = [ScheduledRequest(i, 0, n, decode=False, sample=True) for i, n in enumerate([300, 4, 6, 5, 120, 310, 7, 128])]
    groups = split(list(range(len(chunks))), chunks)
    assert len(groups) <= PROMPT_GROUPS and sorted(i for g in groups for i in g) == list(range(len(chunks)))
    assert [sorted(chunks[i].q_rows for i in g) for g in groups] == [[4, 5, 6, 7], [120, 128], [300, 310]]
    many = [ScheduledRequest(i, 0, 1 + i % 50, decode=False, sample=True) for i in range(64)]
    assert len(split(list(range(64)), many)) <= PROMPT_GROUPS  # 64 chunks: still at most three calls


def ragged(ctx, family):
    """Every decode iteration through the ragged pass (the threshold forced), against the dense oracle."""
    from layers.attention import backends

    dense = model(family)
    lm = shard_lm(dense, "v2", ctx.group)
    want = oracle(dense, requests())
    saved, backends.RAGGED_BELOW = backends.RAGGED_BELOW, 1e-9
    try:
        res = OfflineEngine(lm, ctx, EngineConfig(long_prefill_token_threshold=5, max_num_batched_tokens=40, block_size=3, attention="batched", max_num_seqs=40)).run(requests())
    finally:
        backends.RAGGED_BELOW = saved
    return [r["output_ids"] for r in res.requests] == want and res.ledger_matches_model


@pytest.mark.parametrize("family,p", [("gpt2", 2), ("llama", 2)])
def test_ragged_decode_pass_equals_the_dense_oracle(family, p):
    assert all(run_ranks(p, ragged, family))


@pytest.mark.parametrize("kv_heads", [4, 1])
def test_ragged_and_padded_decodes_equal_the_reference(kv_heads):
    """One long context among short ones: the batched form takes the ragged pass; it and the cpu backend's calls equal
    the per-request loop."""
    from layers.attention.attention import PagedLayer, attention

    gen = torch.Generator().manual_seed(3)
    lengths, block_size = [1, 2, 1, 3, 90], 4
    free = torch.randperm(200, generator=gen).tolist()  # scattered blocks, no two requests sharing one
    tables = [tuple(free.pop() for _ in range(-(-n // block_size))) for n in lengths]
    pool = torch.randn(2, 200 * block_size, kv_heads, 8, generator=gen, dtype=torch.float64)
    plan = SchedulerOutput(0, tuple(ScheduledRequest(i, n - 1, n, decode=True, sample=True, blocks=t)
                                  for i, (n, t) in enumerate(zip(lengths, tables))))
    q = torch.randn(4, len(lengths), 8, generator=gen, dtype=torch.float64)
    kv = torch.randn(2, kv_heads, len(lengths), 8, generator=gen, dtype=torch.float64)
    out = {}
    for mode in ("batched", "cpu", "reference"):
        step = prepare_step(plan, {i: [0] * n for i, n in enumerate(lengths)}, block_size, "cpu", mode)
        if mode == "batched":
            assert step.batch.meta.decodes is not None  # 97 keys, padded to 5 x 90: ragged
        out[mode] = attention(q, kv, PagedLayer(step.batch, pool.clone()))
    torch.testing.assert_close(out["batched"], out["reference"], rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(out["cpu"], out["reference"], rtol=1e-12, atol=1e-13)
