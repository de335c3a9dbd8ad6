"""KV cache per token per rank: MHA vs GQA vs MQA vs p, measured in the serving engine's cache, beside the formula.

    torchrun --nproc_per_node=8 benchmarks/bench_kv.py [--out outputs/bench_kv.json]

One launch of W ranks (8 by default). For every p in 1, 2, 4, 8 (up to W) the first p ranks form a TP group and
serve the same requests, llama_tiny's shape (h = 8 query heads of d_head = 32, L = 4, float32) with h_kv = 8 (MHA),
2 (GQA) and 1 (MQA). Each rank reports what its cache allocated: peak bytes / the token capacity held at that
peak (serve/kv_cache.py), and the tokens it served are compared with the single-device oracle. Beside each
measurement, the formula (tp/cost_model.kv_bytes_per_token_per_rank):

    2 · L · max(h_kv / p, 1) · d_head · e          K and V, every layer, this rank's K,V heads (replicated once p > h_kv)

Then the same formula at real sizes (Llama-2-7B, a Llama-3-8B-shaped GQA model, fp16) and DeepSeek-V3's MLA
latent cache, L · (d_latent + d_rope) · e at every p. Writes the JSON; benchmarks/report.py renders the tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from layers.models.dense import init_weights
from layers.models.llama import LLAMA_TINY, valid_llama_tp_sizes
from layers.models.lm import DenseLlamaLM, greedy_reference, shard_lm
from serve.offline import OfflineEngine
from serve.config import EngineConfig
from serve.request import Request
from tp.cost_model import DEEPSEEK_V3, kv_bytes_per_token_per_rank, mla_kv_bytes_per_token
from tp.dist import context, init_from_env, shutdown

KV_HEADS = {"MHA": 8, "GQA": 2, "MQA": 1}
PROMPTS = [(37, 6), (12, 9), (60, 4)]  # (prompt tokens, new tokens)
REAL = [  # (name, L, h, h_kv, d_head, bytes per element) for the formula at real sizes, fp16
    ("Llama-2-7B (MHA)", 32, 32, 32, 128, 2),
    ("Llama-3-8B shape (GQA)", 32, 32, 8, 128, 2),
]
REAL_P = [1, 2, 4, 8, 16, 32]


def requests(vocab: int) -> list[Request]:
    gen = torch.Generator().manual_seed(5)
    return [Request(i, torch.randint(0, vocab, (n,), generator=gen).tolist(), new, 0)
            for i, (n, new) in enumerate(PROMPTS)]


def measure(ctx, h_kv: int) -> dict:
    """Serve the requests on this group; what this rank's cache allocated per token, and the tokens' verdict."""
    cfg = dataclasses.replace(LLAMA_TINY, n_kv_heads=h_kv)
    dense = init_weights(DenseLlamaLM(cfg, torch.float32, ctx.device), seed=0)
    lm = shard_lm(dense, "v2", ctx.group)
    res = OfflineEngine(lm, ctx, EngineConfig(long_prefill_token_threshold=16, max_num_batched_tokens=64, max_num_seqs=64)).run(requests(cfg.vocab_size))
    same = all(r["output_ids"] == greedy_reference(dense, req.prompt, req.max_new_tokens).ids
               for r, req in zip(res.requests, requests(cfg.vocab_size)))
    return {"measured": res.kv_bytes_per_token_per_rank, "peak_bytes": res.kv_peak_bytes_per_rank,
            "cache_heads": lm.cache_heads, "tokens_match_oracle": same}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="outputs/bench_kv.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    world = init_from_env("auto", timeout_s=600.0)
    sizes = [p for p in (1, 2, 4, 8) if p <= world.world_size]
    groups = {p: dist.new_group(list(range(p))) for p in sizes}  # every rank creates every group, in order
    rows = []
    e, L, dh = torch.float32.itemsize, LLAMA_TINY.n_layers, LLAMA_TINY.d_head
    for name, h_kv in KV_HEADS.items():
        for p in sizes:
            cfg = dataclasses.replace(LLAMA_TINY, n_kv_heads=h_kv)
            if p not in valid_llama_tp_sizes(cfg):
                continue
            mine = measure(context(groups[p], world.backend, world.device), h_kv) if world.rank < p else None
            every = [None] * world.world_size
            dist.all_gather_object(every, mine)
            measured = [m for m in every if m is not None]
            rows.append({"attention": name, "n_kv_heads": h_kv, "p": p,
                         "measured_per_rank": sorted({m["measured"] for m in measured}),
                         "cache_heads": sorted({m["cache_heads"] for m in measured}),
                         "formula": kv_bytes_per_token_per_rank(L, h_kv, dh, p, e),
                         "tokens_match_oracle": all(m["tokens_match_oracle"] for m in measured)})
    for row in rows:
        row["ok"] = row["measured_per_rank"] == [row["formula"]] and row["tokens_match_oracle"]
    real = [{"model": name, "n_layers": layers, "n_heads": h, "n_kv_heads": h_kv, "d_head": d,
             "per_rank": {p: kv_bytes_per_token_per_rank(layers, h_kv, d, p, b) for p in REAL_P if h % p == 0}}
            for name, layers, h, h_kv, d, b in REAL]
    v3 = DEEPSEEK_V3
    real.append({"model": "DeepSeek-V3 (MLA, latent 512 + RoPE key 64)", "n_layers": v3["n_layers"],
                 "per_rank": {p: mla_kv_bytes_per_token(v3["n_layers"], v3["d_latent_kv"], v3["d_rope"], 2)
                              for p in REAL_P}})
    report = {"world_size": world.world_size, "backend": world.backend, "dtype": "float32",
              "model": {**LLAMA_TINY.asdict(), "n_kv_heads": "varied"}, "requests": PROMPTS, "rows": rows,
              "real_sizes_fp16": real, "ok": all(r["ok"] for r in rows)}
    if world.is_main:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        from benchmarks.report import kv_section
        print("\n".join(kv_section(report)))
        print(f"wrote {args.out}")
    shutdown()
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
