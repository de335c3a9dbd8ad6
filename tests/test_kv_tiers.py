"""The KV connector seam and its OffloadingConnector (serve/kv_connector/): blocks leaving the device pool spill to a
CPU tier, then a disk tier; a prompt whose next blocks a tier holds loads them back instead of recomputing them.

Oracle: the dense model recomputed with no cache (float64), against which the engine's tokens and logprobs are exact
to 1e-12 with the tiers on, at p = 1 and 2, GPT-2 and Llama with grouped-query attention; the hits are counted per
tier and must happen (a run that never reloads anything would pass the oracle trivially). Faults: an unwritable
directory, a full disk tier (its least recently used files go), a truncated file on one rank (every rank agrees to
recompute from it), a write that fails."""

import os

import pytest
import torch

from layers.models.config import ModelConfig
from layers.models.dense import init_weights
from layers.models.llama import LlamaConfig
from layers.models.lm import dense_lm, shard_lm
from serve.config import EngineConfig
from serve.engine import LLMEngine
from serve.kv_cache import cache_layout_of, layout_block_bytes
from serve.kv_connector.config import KVTransferConfig
from serve.kv_connector.tiers import TierIndex
from tests.common import greedy_logprobs, named, serve_greedy
from tests.harness import run_ranks

GPT2 = ModelConfig(d_model=64, n_heads=4, d_head=16, d_ffn=128, n_layers=2, max_seq_len=96, vocab_size=257)
LLAMA = LlamaConfig(d_model=64, n_heads=8, n_kv_heads=2, d_head=8, d_ffn=96, n_layers=2, max_seq_len=96,
                    vocab_size=257)
SMALL = dict(long_prefill_token_threshold=8, max_num_batched_tokens=16, max_num_seqs=2, block_size=4,
             num_gpu_blocks_override=12)  # a pool that forgets a prompt's blocks once two others have run


def workload(seed: int) -> list[tuple[list[int], int, int]]:
    """(prompt, max_tokens, step it arrives): two long prompts, then unrelated ones that take the pool over (the long
    prompts' named blocks are overwritten: spilled), then the long prompts again with new endings (tier hits)."""
    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(0, 257, (n,), generator=g).tolist()

    a, b = ids(21), ids(18)
    reqs = [(a, 3, 0), (b, 3, 0)]
    for i in range(4):
        reqs.append((ids(22), 4, 4 + 3 * i))
    reqs += [(a[:17] + ids(3), 3, 30), (b + ids(2), 4, 31), (list(a), 2, 40)]
    return reqs


def block_bytes(cfg, p: int, block_size: int) -> int:
    return layout_block_bytes(cfg.n_layers, cache_layout_of(cfg, p), block_size, torch.float64)


def serve(ctx, cfg, reqs, config, spoil=None):
    """Every rank steps its LLMEngine; rank 0 adds each request at its step. spoil(engine, step): called on every rank
    before each step (a fault). Returns rank 0's (outputs: id -> (tokens, chosen logprobs, reason), stats)."""
    dense = init_weights(dense_lm(cfg, torch.float64), seed=0, std=0.1)
    engine = LLMEngine(shard_lm(dense, "v2", ctx.group), ctx, config)
    steps = [0]
    if spoil is not None:  # the fault, on every rank, before each step
        original = engine.step

        def step_with_fault():
            spoil(engine, steps[0])
            steps[0] += 1
            return original()

        engine.step = step_with_fault
    seen = {}
    store = None if engine.connector is None else engine.connector.store
    if store is not None:  # the files as the loop ends, before the connector's close removes this rank's folder
        folder, close = store.dir, store.close

        def listed_close():
            seen["files"] = sorted(os.listdir(store.dir)) if store.dir and os.path.isdir(store.dir) else None
            close()
            seen["folder_gone"] = folder is None or not os.path.exists(folder)

        store.close = listed_close
    done = serve_greedy(engine, named(reqs))  # drive closes the connector as its loop ends
    engine.scheduler.blocks.check()
    if engine.connector is not None:
        engine.connector.index.check()
        assert seen["folder_gone"] or store.dir != folder  # the rank's folder went with it (a fault may move it)
    if not ctx.is_main:
        return None
    stats = engine.stats()
    engine.shutdown()
    return done, dict(stats, files=seen.get("files"))


def offloading(cpu_blocks: int, disk_blocks: int, bb: int, path=None) -> dict:
    extra = {"cpu_bytes": cpu_blocks * bb}
    if disk_blocks:
        extra |= {"disk_path": str(path), "disk_bytes": disk_blocks * bb}
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


def check_against_oracle(cfg, reqs, done):
    dense = init_weights(dense_lm(cfg, torch.float64), seed=0, std=0.1)
    for i, (prompt, new, _) in enumerate(reqs):
        ids, lps = greedy_logprobs(dense, prompt, new)
        got_ids, got_lps, _ = done[f"r{i}"]
        assert got_ids == ids, (i, got_ids, ids)
        assert max(abs(a - b) for a, b in zip(got_lps, lps)) < 1e-12


@pytest.mark.parametrize("cfg,p,attention", [(GPT2, 1, "cpu"), (LLAMA, 2, "batched")], ids=["gpt2-p1", "llama-p2"])
def test_tiers_give_the_oracles_tokens_and_their_hits_happen(cfg, p, attention, tmp_path):
    reqs = workload(seed=p)
    bb = block_bytes(cfg, p, SMALL["block_size"])
    # without a connector: what the device pool alone finds again
    plain_done, plain = run_ranks(p, serve, cfg, reqs, EngineConfig(**SMALL, attention=attention))[0]
    config = EngineConfig(**SMALL, attention=attention, kv_transfer_config=offloading(3, 64, bb, tmp_path))
    done, stats = run_ranks(p, serve, cfg, reqs, config)[0]
    check_against_oracle(cfg, reqs, done)
    assert {k: ids for k, (ids, *_) in done.items()} == {k: ids for k, (ids, *_) in plain_done.items()}
    hits = stats["kv_tier_hit_blocks"]
    assert stats["kv_offloaded_blocks"] > 0 and stats["kv_demoted_blocks"] > 0, stats
    assert hits["cpu"] > 0 and hits["disk"] > 0, stats
    assert plain["prefix_hit_tokens"] < stats["prefix_hit_tokens"]  # the tiers' blocks were not recomputed
    assert stats["kv_disk_unreadable_blocks"] == 0 and stats["kv_disk_write_errors"] == 0  # no fault, none seen
    files = stats["files"]  # rank 0's folder, before the engine went
    assert len(files) == stats["kv_tier_blocks"]["disk"] and all(f.endswith(".kv") for f in files)


def test_a_full_disk_tier_forgets_its_oldest_and_a_cpu_tier_alone_works(tmp_path):
    reqs = workload(seed=3)
    bb = block_bytes(GPT2, 1, SMALL["block_size"])
    done, stats = run_ranks(1, serve, GPT2, reqs, EngineConfig(**SMALL, kv_transfer_config=offloading(
        2, 3, bb, tmp_path)))[0]
    check_against_oracle(GPT2, reqs, done)
    assert stats["kv_tier_blocks"] == {"cpu": 2, "disk": 3} and len(stats["files"]) == 3
    done, stats = run_ranks(1, serve, GPT2, reqs, EngineConfig(**SMALL, kv_transfer_config=offloading(64, 0, bb)))[0]
    check_against_oracle(GPT2, reqs, done)
    assert stats["kv_tier_hit_blocks"]["cpu"] > 0 and stats["kv_demoted_blocks"] == 0


def truncate_rank1_files(engine, step):
    """On rank 1 only, before step 30 (the long prompts come back): every disk file loses its last byte."""
    store = engine.connector.store
    if step == 30 and engine.ctx.rank == 1:
        for key in list(engine.connector.index.held["disk"]):
            store.readable(key)  # its write has landed
            with open(store.path(key), "r+b") as f:
                f.truncate(store.nbytes - 1)


def test_a_truncated_file_on_one_rank_makes_every_rank_recompute(tmp_path):
    reqs = workload(seed=2)
    bb = block_bytes(LLAMA, 2, SMALL["block_size"])
    config = EngineConfig(**SMALL, kv_transfer_config=offloading(1, 64, bb, tmp_path))
    done, stats = run_ranks(2, serve, LLAMA, reqs, config, truncate_rank1_files)[0]
    check_against_oracle(LLAMA, reqs, done)
    assert stats["kv_disk_unreadable_blocks"] > 0, stats


def fail_writes(engine, step):
    if step == 0:
        engine.connector.store.dir = "/proc/no-such-dir"  # every write from now on fails


def test_a_failed_write_is_counted_and_the_block_recomputed(tmp_path):
    reqs = workload(seed=4)
    bb = block_bytes(GPT2, 1, SMALL["block_size"])
    config = EngineConfig(**SMALL, kv_transfer_config=offloading(1, 64, bb, tmp_path))
    done, stats = run_ranks(1, serve, GPT2, reqs, config, fail_writes)[0]
    check_against_oracle(GPT2, reqs, done)
    # (a block demoted and loaded back in one step comes from memory, whatever its write does: it may still hit)
    assert stats["kv_disk_write_errors"] > 0 and stats["kv_disk_unreadable_blocks"] > 0


def test_settings_are_checked_in_one_line(tmp_path):
    bad = [({"kv_connector": "Nope"}, "choose OffloadingConnector"),
           ({"kv_connector": "OffloadingConnector"}, "needs a tier"),
           ({"kv_connector": "OffloadingConnector", "kv_role": "kv_producer",
             "kv_connector_extra_config": {"cpu_bytes": 1}}, "kv_role='kv_both'"),
           ({"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_byte": 1}}, "unknown key"),
           ({"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"disk_path": "x"}}, "go together"),
           ({"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes": -1}}, "at least 0"),
           ("OffloadingConnector", "must be a dict")]
    for value, message in bad:
        with pytest.raises(ValueError, match=message):
            EngineConfig(kv_transfer_config=value)
    ok = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes": 1 << 20}}
    for extra, message in [(dict(enable_prefix_caching=False), "enable_prefix_caching=True"),
                           (dict(kv_cache_dtype="fp8"), "kv_cache_dtype='auto'"),
                           (dict(kv_eviction={"policy": "streaming", "window_tokens": 64}), "kv_eviction")]:
        with pytest.raises(ValueError, match=message):
            EngineConfig(kv_transfer_config=ok, **extra)
    with pytest.raises(ValueError, match="pp > 1"):
        EngineConfig(kv_transfer_config=ok).check_pipeline(2)
    with pytest.raises(ValueError, match="kv_transfer_config is not built"):
        EngineConfig(kv_transfer_config=ok).check_context_parallel(2)
    blocked = tmp_path / "file"
    blocked.write_text("")
    kv = KVTransferConfig.of({"kv_connector": "OffloadingConnector",
                              "kv_connector_extra_config": {"disk_path": str(blocked / "sub"), "disk_bytes": 1}})
    with pytest.raises(ValueError, match="not a writable directory"):
        kv.check_disk()


def test_the_index_spills_down_and_loads_without_moving_a_block():
    index = TierIndex(cpu_blocks=2, disk_blocks=2)
    for key in range(1, 6):
        index.leaving(key, 0, (key,), block=key)
    index.check()
    # 5 spilled: cpu holds the last two, disk the two before, the first was dropped
    assert list(index.held["cpu"]) == [4, 5] and list(index.held["disk"]) == [2, 3]
    kinds = [(op.kind, op.key) for op in index.take_ops()]
    assert kinds.count(("save", 1)) == 1 and ("demote", 1) in kinds and ("drop", 1) in kinds
    index.leaving(4, 0, (4,), block=9)  # leaving again while a tier holds it: touched, nothing saved
    assert index.take_ops() == [] and list(index.held["cpu"]) == [5, 4]
    assert index.lookup([(2, 0, (2,)), (3, 0, (3,)), (7, 0, (7,))]) == [(2, "disk"), (3, "disk")]
    assert index.lookup([(2, 0, (99,))]) == []  # the same hash for other tokens: a collision misses
    index.load([(2, "disk")], [11])
    assert [(op.kind, op.key, op.block, op.tier) for op in index.take_ops()] == [("load", 2, 11, "disk")]
    assert list(index.held["disk"]) == [3, 2]
