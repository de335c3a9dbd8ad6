"""Per-rank loading of save_pretrained checkpoints (layers/models/checkpoint.py, layers/models/hf.CheckpointSource).

Against load dense, then shard (the dense model read from the same files one whole tensor at a time, then cut by
the same plan): bitwise equal parameters on every rank, for GPT-2 (Conv1D transposes, tied head) and Llama (GQA
with p > h_kv, untied head), single-file and sharded safetensors and .bin, float32 and bfloat16 files. And the
mechanism: every rank copies out of the files exactly the bytes of its own slices, no more.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.harness import run_ranks
from tests.launching import settings_phase

transformers = pytest.importorskip("transformers")

# GPT-2: 12 heads and ffn 192 split over p = 1, 2, 3, 4; vocab 301 pads at every p > 1. Llama: h_kv = 2, so p = 4
# replicates each K,V head on 2 ranks; p = 3 cannot split it (skipped there).
GPT2 = dict(n_embd=48, n_head=12, n_layer=2, n_positions=64, vocab_size=301)
LLAMA = dict(hidden_size=48, num_attention_heads=12, num_key_value_heads=2, num_hidden_layers=2,
             intermediate_size=96, vocab_size=301, max_position_embeddings=64, tie_word_embeddings=False)
SHARD = "12KB"  # forces several files: every layer's tensors spread over them


def _save(path, family: str, dtype: torch.dtype, sharded: bool, safe: bool = True):
    torch.manual_seed(0)
    if family == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    with torch.no_grad():
        for p in model.parameters():  # norms and biases off their 1 / 0 initial values
            p.add_(0.1 * torch.randn_like(p))
    model = model.to(dtype)
    if safe:
        model.save_pretrained(path, max_shard_size=SHARD if sharded else "10GB")
        return str(path)
    # the .bin layout older save_pretrained wrote (pytorch_model.bin.index.json and two files; the tied lm_head kept)
    model.config.save_pretrained(path)
    state = model.state_dict()
    keys = list(state)
    files = {f"pytorch_model-0000{i + 1}-of-00002.bin": keys[i::2] for i in range(2)}
    for name, mine in files.items():
        torch.save({k: state[k].clone() for k in mine}, path / name)
    (path / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: name for name, mine in files.items() for k in mine}}))
    return str(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    out = {}
    for family in ("gpt2", "llama"):
        for dtype in (torch.float32, torch.bfloat16):
            for sharded in (False, True):
                name = f"{family}-{str(dtype)[6:]}-{'sharded' if sharded else 'single'}"
                out[name] = _save(root / name, family, dtype, sharded)
    out["gpt2-float32-bin"] = _save(root / "gpt2-bin", "gpt2", torch.float32, sharded=True, safe=False)
    return out


def test_sharded_saves_are_sharded(checkpoints):
    from layers.models.checkpoint import Checkpoint

    for name, path in checkpoints.items():
        ckpt = Checkpoint(path)
        assert len(ckpt.files) == (2 if "bin" in name else 1) or "sharded" in name and len(ckpt.files) > 3
        assert ckpt.format == ("bin" if "bin" in name else "safetensors")


def _expected_read(lm, itemsize: int) -> int:
    """The bytes of this rank's parameters that come from the files: all but the vocabulary's padding rows."""
    from layers.parallel.vocab import VocabParallelEmbedding

    n = sum(p.numel() for p in lm.parameters())
    pads = {id(m): m for m in lm.modules() if isinstance(m, VocabParallelEmbedding)}
    return (n - sum((m.per_rank - m.n_real) * m.weight.shape[1] for m in pads.values())) * itemsize


class _Counted:
    """safetensors.safe_open, counting the bytes every get_slice[...] and get_tensor hands over: the reads as the
    library performs them, whatever layers/models/checkpoint.py does with them afterwards."""

    handed = 0

    def __init__(self, real, *args, **kwargs):
        self.f = real(*args, **kwargs)

    def __enter__(self):
        self.f.__enter__()
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)

    def _count(self, t):
        _Counted.handed += t.numel() * t.element_size()
        return t

    def get_tensor(self, key):
        return self._count(self.f.get_tensor(key))

    def get_slice(self, key):
        view, count = self.f.get_slice(key), self._count

        class Slice:
            def __getitem__(self, index):
                return count(view[index])

            def __getattr__(self, name):
                return getattr(view, name)

        return Slice()


def _load_both_ways(ctx, checkpoints: dict):
    import safetensors

    from layers.models.hf import CheckpointSource, load_lm, read_config, read_state
    from layers.models.lm import dense_lm, shard_lm

    p, done = ctx.world_size, []
    for name, path in checkpoints.items():
        cfg = read_config(path)
        if cfg.family == "llama" and p == 3:
            continue
        file_dtype = torch.bfloat16 if "bfloat16" in name else torch.float32
        runs = [(file_dtype, "v2", True)]
        if file_dtype == torch.bfloat16 and "single" in name:
            runs += [(torch.float32, "v2", True)]  # converted slice by slice
        if cfg.family == "gpt2" and "sharded" in name:
            runs += [(torch.float32, "v1", False)]  # column-cut output projections, replicated embedding
        for dtype, variant, vocab_parallel in runs:
            ckpt, real = read_state(path), safetensors.safe_open
            _Counted.handed = 0
            safetensors.safe_open = lambda *a, **k: _Counted(real, *a, **k)  # noqa: E731
            try:
                lazy = shard_lm(CheckpointSource(ckpt, cfg, dtype), variant, ctx.group, vocab_parallel)
            finally:
                safetensors.safe_open = real
            read, handed = ckpt.bytes_read, _Counted.handed
            dense = load_lm(dense_lm(cfg, dtype), read_state(path))  # whole tensors, then the same plan's cuts
            ref = shard_lm(dense, variant, ctx.group, vocab_parallel)
            mine, theirs = lazy.state_dict(), ref.state_dict()
            assert mine.keys() == theirs.keys()
            for key in mine:
                assert mine[key].dtype == dtype and torch.equal(mine[key], theirs[key]), (name, key, ctx.rank)
            assert read == _expected_read(lazy, file_dtype.itemsize), (name, variant, read)
            assert handed == (0 if ckpt.format == "bin" else read), (name, variant, handed, read)
            assert read < ckpt.total_bytes or p == 1
            done.append((name, str(dtype), variant))
    return done


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_per_rank_slices_equal_dense_then_shard_bitwise(checkpoints, p):
    done = run_ranks(p, _load_both_ways, checkpoints)
    assert all(d == done[0] for d in done) and len(done[0]) == (8 if p == 3 else 13)


def test_reading_a_slice_copies_only_its_bytes(checkpoints):
    """get_slice hands over only the ranges asked for: rows, columns, and a stacked pair (Llama's gate|up)."""
    from layers.models.checkpoint import Checkpoint
    from layers.models.hf import CheckpointSource, read_config
    from layers.parallel.shard import cols, rows

    path = checkpoints["llama-bfloat16-sharded"]
    ckpt = Checkpoint(path)
    down = ckpt["model.layers.1.mlp.down_proj.weight"]  # [48, 96]
    assert ckpt.bytes_read == down.numel() * 2
    out = torch.empty(48, 24, dtype=torch.float32)
    before = ckpt.bytes_read
    ckpt.fill(out, "model.layers.1.mlp.down_proj.weight", 1, ((24, 48),))
    assert ckpt.bytes_read - before == 48 * 24 * 2 and torch.equal(out, down[:, 24:48].float())
    source = CheckpointSource(ckpt, read_config(path), torch.float32)
    gate, up = ckpt["model.layers.0.mlp.gate_proj.weight"], ckpt["model.layers.0.mlp.up_proj.weight"]
    both = torch.cat([gate, up])  # our gate_up [192, 48]
    cut = rows((90, 100), (120, 130))  # the first range spans gate's end and up's start
    dest = torch.empty(20, 48)
    before = ckpt.bytes_read
    source.fill(dest, "stack.blocks.0.gate_up.weight", cut)
    assert ckpt.bytes_read - before == 20 * 48 * 2 and torch.equal(dest, cut.of(both).float())
    dest = torch.empty(192, 12)
    source.fill(dest, "stack.blocks.0.gate_up.weight", cols((12, 24)))
    assert torch.equal(dest, both[:, 12:24].float())


def test_a_gpt2_bin_whose_head_is_not_its_embedding_is_refused(checkpoints, tmp_path):
    from layers.models.config import ModelConfig  # noqa: F401
    from layers.models.hf import check_state, read_config, read_state
    from tp.dist import ConfigError

    path = checkpoints["gpt2-float32-bin"]
    state = read_state(path)
    assert "lm_head.weight" in state  # the .bin format keeps the tied head
    check_state(read_config(path), state, lm=True)
    full = {k: state[k].clone() for k in state}
    full["lm_head.weight"][300, 5] += 1
    with pytest.raises(ConfigError, match="lm_head.weight differs from wte.weight"):
        check_state(read_config(path), full, lm=True)


# ---- bad checkpoints: one line, exit 2, before any collective -------------------------------------------------


def _broken(tmp_path, checkpoints, how: str) -> str:
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path / "ckpt"
    shutil.copytree(checkpoints["llama-float32-sharded"], path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    where = index["weight_map"]
    key = "model.layers.1.self_attn.k_proj.weight"
    if how == "missing file":
        (path / where[key]).unlink()
    elif how == "tensor not in its file":
        other = next(f for f in sorted(set(where.values())) if f != where[key])
        where[key] = other
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    elif how == "truncated shard":
        data = (path / where[key]).read_bytes()
        (path / where[key]).write_bytes(data[:-100])
    elif how == "shape":
        tensors = load_file(path / where[key])
        tensors[key] = tensors[key][:4]
        save_file(tensors, path / where[key], metadata={"format": "pt"})
    return str(path)


BROKEN = {
    "missing file": "model.safetensors.index.json names model-0000",
    "tensor not in its file": "model.safetensors.index.json puts model.layers.1.self_attn.k_proj.weight in model-0000",
    "truncated shard": "is truncated: ",
    "shape": "model.layers.1.self_attn.k_proj.weight has shape (4, 48), config.json's model needs (8, 48)",
}


@pytest.mark.parametrize("how", list(BROKEN))
def test_a_broken_sharded_checkpoint_is_a_one_line_setting_error(tmp_path, checkpoints, how):
    path = _broken(tmp_path, checkpoints, how)
    proc = settings_phase([f"hf_checkpoint={path}"], world=2, script="serve.py")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"[rank 1] error: hf_checkpoint={path}: "), lines
    assert BROKEN[how] in lines[0], lines


# ---- what each rank holds in memory ---------------------------------------------------------------------------


def test_check_auto_turns_the_oracle_off_where_the_dense_model_would_not_fit(monkeypatch, checkpoints):
    """Each rank needs its 1/p shard; the dense oracle needs the whole model as well. check=auto drops the oracle
    (with a note) where only the shards fit; check=true is refused there, naming check=false."""
    import launch.serve_settings as serve
    import launch.settings as settings
    from layers.models.hf import read_config, read_state
    from serve.request import Request
    from tp.dist import ConfigError

    path = checkpoints["llama-bfloat16-sharded"]
    model, weights = read_config(path), read_state(path)
    n = settings.parameter_count(model, True)
    common = dict(model=model, dtype=torch.float32, device="cpu", weights=weights)
    requests = [Request(0, [1, 2, 3], 4, 0)]
    # 4 ranks: the shards need 4 * n*4/4 bytes, the dense models 4 * n*4 more; 0.9 * have sits between
    monkeypatch.setattr(settings, "available_host_memory", lambda: int(3 * n * 4 / 0.9))
    notes: list[str] = []
    assert serve.check_and_memory("auto", common, requests, None, 4, 4, notes) is False
    assert len(notes) == 1 and notes[0].startswith("check=auto is off: the dense oracle would hold"), notes
    with pytest.raises(ConfigError, match="every rank holds the dense model and its 1/4 shard.*set check=false"):
        serve.check_and_memory("true", common, requests, None, 4, 4, [])
    monkeypatch.setattr(settings, "available_host_memory", lambda: int(20 * n * 4))
    assert serve.check_and_memory("auto", common, requests, None, 4, 4, notes) is True and len(notes) == 1


def test_dtype_and_eos_auto_come_from_the_checkpoint(checkpoints):
    """dtype=auto and eos_id=auto (the defaults): a saved bfloat16 Llama is served in bfloat16 and stops at its
    eos_token_id, each said beside the value; given values win; presets stay float32 with no EOS."""
    from hydra import compose, initialize_config_dir

    from launch.run_block import parse_settings as block_settings
    from tests.launching import ROOT
    from tests.test_paged import serve_settings

    s = serve_settings(f"hf_checkpoint={checkpoints['llama-bfloat16-single']}")
    assert s.dtype == torch.bfloat16 and s.dtype_from == "auto: the checkpoint's torch_dtype"
    assert s.eos_id == transformers.LlamaConfig().eos_token_id and s.eos_from == "auto: the checkpoint's eos_token_id"
    given = serve_settings(f"hf_checkpoint={checkpoints['llama-bfloat16-single']}", "dtype=float64", "eos_id=null")
    assert given.dtype == torch.float64 and given.dtype_from is None and given.eos_id is None
    preset = serve_settings()
    assert preset.dtype == torch.float32 and preset.dtype_from == "auto: random weights" and preset.eos_id is None
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        block = block_settings(compose("config", overrides=[f"hf_checkpoint={checkpoints['gpt2-bfloat16-sharded']}",
                                                            "n_tokens=8"]), 2, 2)
    assert block.dtype == torch.bfloat16 and block.dtype_from == "auto: the checkpoint's torch_dtype"


def _stages_from_files(ctx, checkpoints: dict, pp: int):
    """Each rank's pipeline stage read from the files (layers/models/hf.CheckpointSource) against the same stage cut
    from the dense model loaded whole: equal bit for bit, and the bytes read are the stage's own parameters only."""
    import torch.distributed as dist

    from layers.models.hf import CheckpointSource, load_lm, read_config, read_state
    from layers.models.lm import dense_lm
    from layers.models.pipeline import check_layout, new_pp_groups, shard_pp_lm

    rank, done = dist.get_rank(), []
    for name in ("gpt2-float32-sharded", "llama-float32-sharded", "llama-bfloat16-single"):
        path = checkpoints[name]
        cfg = read_config(path)
        dtype = torch.bfloat16 if "bfloat16" in name else torch.float32
        layout = check_layout(ctx.world_size, pp, cfg.n_layers, "v2")
        stages = new_pp_groups(layout)
        group = stages[layout.stage_of(rank)]
        ckpt = read_state(path)
        lazy = shard_pp_lm(CheckpointSource(ckpt, cfg, dtype), "v2", layout, rank, group)
        ref = shard_pp_lm(load_lm(dense_lm(cfg, dtype), read_state(path)), "v2", layout, rank, group)
        mine, theirs = lazy.state_dict(), ref.state_dict()
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine), (name, rank)
        assert ckpt.bytes_read == _expected_read(lazy, dtype.itemsize), (name, rank, ckpt.bytes_read)
        done.append((ckpt.bytes_read, ckpt.total_bytes))
    return done


@pytest.mark.parametrize("pp,world", [(2, 2), (2, 4)])
def test_pipeline_stages_read_only_their_own_slices(checkpoints, pp, world):
    """A stage of a tp-rank group reads less than 1/tp of the files (it skips the other stages' layers and ends)."""
    tp = world // pp
    for rank, runs in enumerate(run_ranks(world, _stages_from_files, checkpoints, pp)):
        for read, total in runs:
            assert read < total / tp, (rank, read, total)


def test_dtype_auto_is_the_checkpoints_in_the_library_and_the_cli(checkpoints, capsys):
    """dtype "auto" everywhere: a saved bfloat16 Llama runs in bfloat16 through LLM (LLM.dtype says so) and through
    python -m serve with default settings (and --temperature 0), and both give the same greedy tokens; a given dtype (a name or a
    torch.dtype) wins."""
    from serve import LLM, SamplingParams
    from serve.__main__ import main

    path = checkpoints["llama-bfloat16-sharded"]
    prompt = [1, 2, 3, 4]
    with LLM(path) as llm:
        assert llm.dtype == "bfloat16"
        ids = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0].outputs[0].token_ids
    capsys.readouterr()
    # --temperature 0: the CLI samples at vLLM's default temperature 1.0 unless told to decode greedily
    assert main(["--model", path, "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", "6",
                 "--ignore-eos", "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    assert "dtype bfloat16" in err and out.split() == [str(t) for t in ids], (out, err)
    with LLM(path, dtype=torch.float32, num_gpu_blocks_override=4) as llm:
        assert llm.dtype == "float32"
