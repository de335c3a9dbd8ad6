"""Loading a sharded bfloat16 Llama-shaped checkpoint on p = 1, 2, 4 ranks: each rank's peak resident memory and
load time, per-rank slices (launch/serve.py's path, layers/models/hf.CheckpointSource) against load everything
(every rank reads every file whole, builds the dense model, then cuts its shard).

    python benchmarks/bench_load.py                # 0.67B parameters: 1.3 GB of bfloat16 in 6 files
    python benchmarks/bench_load.py --layers 2     # small and quick
    python benchmarks/bench_load.py --docs         # also rewrite its section of docs/benchmarks.md

The checkpoint is synthetic (random bfloat16 weights, seeded) in save_pretrained's sharded layout. The p ranks of one
run load at the same time, as on one node; peaks are the kernel's high-water mark per rank (launch/loading.py).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import OUT, parse_args, rewrite_sections, table, write_json

SHAPE = dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=4, head_dim=128, intermediate_size=5632,
             vocab_size=32000, max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False)
TARGET = 1.3  # peak above the base per rank <= 1.3 x (checkpoint / p); all ranks together <= 1.3 x checkpoint


def tensors(cfg: dict, layers: int):
    """(name, shape) of a LlamaForCausalLM's weights, in save_pretrained's order."""
    d, f, dh = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    h, kv, v = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    yield "model.embed_tokens.weight", (v, d)
    for i in range(layers):
        pre = f"model.layers.{i}."
        yield from ((pre + "input_layernorm.weight", (d,)), (pre + "self_attn.q_proj.weight", (h * dh, d)),
                    (pre + "self_attn.k_proj.weight", (kv * dh, d)), (pre + "self_attn.v_proj.weight", (kv * dh, d)),
                    (pre + "self_attn.o_proj.weight", (d, h * dh)), (pre + "post_attention_layernorm.weight", (d,)),
                    (pre + "mlp.gate_proj.weight", (f, d)), (pre + "mlp.up_proj.weight", (f, d)),
                    (pre + "mlp.down_proj.weight", (d, f)))
    yield "model.norm.weight", (d,)
    yield "lm_head.weight", (v, d)


def make_checkpoint(path: Path, layers: int, shard_bytes: int) -> Path:
    """Write (or reuse) the synthetic checkpoint: random bfloat16 weights, files of about shard_bytes each."""
    from safetensors.torch import save_file

    config = dict(SHAPE, model_type="llama", architectures=["LlamaForCausalLM"], num_hidden_layers=layers,
                  hidden_act="silu", torch_dtype="bfloat16")
    made = {"config": config, "shard_bytes": shard_bytes}  # what a cached checkpoint must have been made with
    if (path / "bench_load_made.json").is_file() and json.loads((path / "bench_load_made.json").read_text()) == made:
        return path
    path.mkdir(parents=True, exist_ok=True)
    for old in path.glob("model-*.safetensors"):
        old.unlink()
    gen = torch.Generator().manual_seed(0)
    groups, current, size = [], [], 0
    for name, shape in tensors(config, layers):
        nbytes = math.prod(shape) * 2
        if current and size + nbytes > shard_bytes:
            groups.append(current)
            current, size = [], 0
        current.append((name, shape))
        size += nbytes
    groups.append(current)
    weight_map = {}
    for i, group in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        out = {name: (torch.randn(shape, generator=gen) * (0.02 if len(shape) == 2 else 1)).to(torch.bfloat16)
               for name, shape in group}
        save_file(out, str(path / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in out})
        del out
    total = sum(math.prod(s) * 2 for _, s in tensors(config, layers))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                    "weight_map": weight_map}, indent=2))
    (path / "config.json").write_text(json.dumps(config))
    (path / "bench_load_made.json").write_text(json.dumps(made))
    return path


def _measure(ctx, path: str, how: str) -> dict:
    """One rank's load, one way; every rank's figures (and a checksum of what it loaded) gathered to rank 0."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    from launch.loading import LoadMeter
    from layers.models.hf import CheckpointSource, load_lm, read_config, read_state
    from layers.models.lm import dense_lm, shard_lm

    cfg, ckpt = read_config(path), read_state(path)
    meter = LoadMeter(ckpt if how == "per-rank slices" else None, path=how)
    with meter:
        if how == "per-rank slices":
            lm = shard_lm(CheckpointSource(ckpt, cfg, torch.bfloat16), "v2", ctx.group)
        else:
            state = {}
            for file in ckpt.files:
                state.update(load_file(str(Path(path) / file)))
            dense = load_lm(dense_lm(cfg, torch.bfloat16), state)
            lm = shard_lm(dense, "v2", ctx.group)
            del state, dense
    load = meter.report(ctx, lm)
    sums = [None] * ctx.world_size
    dist.all_gather_object(sums, sum(float(p.detach().double().sum()) for p in lm.parameters()), group=ctx.group)
    load["checksums"] = sums
    return load


def run(layers: int, shard_bytes: int, ps: list[int]) -> dict:
    from launch.spawn import spawn_ranks

    path = make_checkpoint(OUT / f"bench_load_ckpt_L{layers}", layers, shard_bytes)
    from layers.models.checkpoint import Checkpoint

    ckpt = Checkpoint(path)
    rows = []
    for p in ps:
        runs = {}
        for how in ("per-rank slices", "load everything"):
            start = time.perf_counter()
            runs[how] = spawn_ranks(p, _measure, str(path), how, backend="gloo")
            print(f"p={p} {how}: {time.perf_counter() - start:.1f} s including start-up", flush=True)
        lazy, full = runs["per-rank slices"], runs["load everything"]
        row = {"p": p, "same_parameters": lazy["checksums"] == full["checksums"]}
        for key, r in (("lazy", lazy), ("full", full)):
            above = [pk - b for pk, b in zip(r["peak_rss_bytes"], r["base_rss_bytes"])]
            row[key] = {"peak_rss_bytes": r["peak_rss_bytes"], "base_rss_bytes": r["base_rss_bytes"],
                        "above_base_bytes": above, "time_s": r["time_s"], "weights_bytes": r["weights_bytes"],
                        "read_bytes": r["read_bytes"], "peak_is_lifetime": r["peak_is_lifetime"],
                        "max_above_over_share": max(above) / (ckpt.total_bytes / p),
                        "total_above_over_checkpoint": sum(above) / ckpt.total_bytes}
        row["time_full_over_lazy"] = max(full["time_s"]) / max(lazy["time_s"])
        row["meets_target"] = (row["lazy"]["max_above_over_share"] <= TARGET
                               and row["lazy"]["total_above_over_checkpoint"] <= TARGET)
        rows.append(row)
    params = sum(math.prod(s) for s in ckpt.shapes.values())
    return {"layers": layers, "parameters": params, "checkpoint_bytes": ckpt.total_bytes, "files": len(ckpt.files),
            "shape": SHAPE, "target": TARGET, "rows": rows}


def section(data: dict | None) -> list[str]:
    """Its section of docs/benchmarks.md."""
    if not data:
        return []
    gib, mib = 2 ** 30, 2 ** 20
    s = data["shape"]
    lines = ["## Loading a checkpoint: per-rank slices", "",
             f"`.venv/bin/python benchmarks/bench_load.py`: a synthetic Llama-shaped checkpoint (d={s['hidden_size']}, "
             f"h={s['num_attention_heads']}, h_kv={s['num_key_value_heads']}, ffn={s['intermediate_size']}, "
             f"L={data['layers']}, vocab={s['vocab_size']}, untied head): {data['parameters'] / 1e9:.2f}B parameters, "
             f"{data['checkpoint_bytes'] / gib:.2f} GiB of bfloat16 in {data['files']} safetensors files with "
             f"their index, loaded in bfloat16 by p ranks at once. Per-rank slices: each rank reads only what it "
             f"holds (launch/serve.py's path); load everything: every rank reads every file, builds the dense "
             f"model, then cuts its shard (the path before). Memory is each rank's peak resident memory above "
             f"its resident memory just before loading (Python, torch, the process group).", ""]
    rows = []
    for r in data["rows"]:
        for key, name in (("lazy", "per-rank slices"), ("full", "load everything")):
            m = r[key]
            rows.append([r["p"], name, f"{max(m['above_base_bytes']) / mib:,.0f} MiB",
                         f"{m['max_above_over_share']:.2f}", f"{m['total_above_over_checkpoint']:.2f}"]
                        + ([f"{r['time_full_over_lazy']:.2f}", "yes" if r["same_parameters"] else "NO"]
                           if key == "lazy" else ["", ""]))
    lines += table(["p", "path", "peak above base, per rank (max)", "/ (checkpoint / p)", "all ranks / checkpoint",
                    "load time, slowest rank: load everything / per-rank slices", "same parameters"], rows)
    met, last = all(r["meets_target"] for r in data["rows"]), data["rows"][-1]
    lines += ["", f"Target (peak per rank ≤ {data['target']} × checkpoint/p above the base, all ranks together ≤ "
                  f"{data['target']} × the checkpoint): {'met' if met else 'NOT met'} by per-rank slices at every p "
                  f"measured; load everything holds {last['full']['total_above_over_checkpoint']:.1f} × the "
                  f"checkpoint over its {last['p']} ranks (each: the files read whole, the dense model, its shard).",
              ""]
    return lines


def main(argv=None) -> int:
    args = parse_args(__doc__, {"--layers": 12,
                                "--shard-mb": dict(type=int, default=256, help="size of each checkpoint file (MiB)"),
                                "--p": [1, 2, 4], "--out": str(OUT / "bench_load.json"),
                                "--docs": dict(action="store_true", help="rewrite this section of docs/benchmarks.md")},
                      argv)
    data = run(args.layers, args.shard_mb * 2 ** 20, args.p)
    write_json(args.out, data)
    print("\n".join(section(data)))
    if args.docs:  # the same section benchmarks/report.py writes
        rewrite_sections(section(data))
    return 0 if all(r["same_parameters"] for r in data["rows"]) else 1  # the target's verdict is in the text


if __name__ == "__main__":
    sys.exit(main())
