"""KV cache per token per rank: MHA vs GQA vs MQA vs p, measured in the serving engine's cache, beside the formula.

    torchrun --nproc_per_node=8 benchmarks/bench_kv.py [--out outputs/bench_kv.json]

One launch of W ranks (8 by default). For every p in 1, 2, 4, 8 (up to W) the first p ranks form a TP group and
serve the same requests on llama_tiny's shape with h_kv = 8 (MHA), 2 (GQA) and 1 (MQA); each rank reports the peak
bytes its cache allocated per token position (serve/kv_cache.py) and its tokens are checked against the
single-device oracle, beside 2 · L · max(h_kv / p, 1) · d_head · e (tp/cost_model.kv_bytes_per_token_per_rank).
Then the formula at real sizes, fp16, and DeepSeek-V3's MLA latent cache. Writes the JSON and prints its section of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from benchmarks.common import table, write_json
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
    config = EngineConfig(long_prefill_token_threshold=16, max_num_batched_tokens=64, max_num_seqs=64)
    res = OfflineEngine(lm, ctx, config).run(requests(cfg.vocab_size))
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
        print("\n".join(section(report)))
        write_json(args.out, report)
    shutdown()
    return 0 if report["ok"] else 1


def section(kv: dict | None) -> list[str]:
    """docs/benchmarks.md's section (benchmarks/report.py): KV cache per token per rank, measured in the engine's
    cache beside 2·L·max(h_kv/p, 1)·d_head·e; the script prints it too."""
    if not kv:
        return []
    m, sizes = kv["model"], sorted({r["p"] for r in kv["rows"]})
    rows = []
    for name in dict.fromkeys(r["attention"] for r in kv["rows"]):
        by_p = {r["p"]: r for r in kv["rows"] if r["attention"] == name}
        rows.append([name, next(iter(by_p.values()))["n_kv_heads"]] + [kv_cell(by_p.get(p)) for p in sizes])
    ps = sorted({int(p) for r in kv["real_sizes_fp16"] for p in r["per_rank"]})
    real = []
    for r in kv["real_sizes_fp16"]:
        per = {int(p): b for p, b in r["per_rank"].items()}
        real.append([r["model"]] + [f"{per[p] / 1024:g} KiB" if p in per else "-" for p in ps])
    return ["## KV cache per token per rank: MHA vs GQA vs p", "",
            f"`.venv/bin/torchrun --nproc_per_node={kv['world_size']} benchmarks/bench_kv.py`: the serving engine on "
            f"llama_tiny's shape (h = {m['n_heads']} query heads of d_head = {m['d_head']}, L = {m['n_layers']}, "
            f"{kv['dtype']}), {len(kv['requests'])} requests, each run's tokens checked against the "
            "single-device oracle. Measured: the bytes the rank's cache tensors held per token position at their "
            "peak (every rank of the group agrees; attention wrote every token's K,V into those tensors and read them "
            "back, and the tokens equal the oracle's); formula: 2·L·max(h_kv/p, 1)·d_head·e.", "",
            *table(["attention", "h_kv"] + [f"p = {p}" for p in sizes], rows), "",
            "Each cell: measured bytes (formula), K,V heads per rank. MHA halves with every doubling of p; "
            "GQA stops at p = h_kv = 2 and MQA never shrinks: from there on each K,V head is replicated on "
            "p/h_kv ranks. " + ("Every measurement equals the formula and every run's tokens equal the oracle's."
                                if kv["ok"] else "**Some measurement or token check failed (≠ above).**"), "",
            "The same formula at real sizes, fp16 (formula only):", "",
            *table(["model"] + [f"p = {p}" for p in ps], real), "",
            "MLA caches one latent vector per token that every TP rank holds whole, so its per-rank cache "
            "does not shrink with p at all; GQA's stops shrinking at p = h_kv.", ""]


def kv_cell(r: dict | None) -> str:
    """Measured bytes (formula), K,V heads per rank; ≠ where the two differ or the tokens missed the oracle's."""
    if r is None:
        return "-"
    heads = r["cache_heads"][0]
    return (f"{', '.join(f'{b:,}' for b in r['measured_per_rank'])} B ({r['formula']:,})"
            f"{'' if r['ok'] else ' **≠**'}, {heads} head" + ("s" if heads > 1 else ""))


if __name__ == "__main__":
    sys.exit(main())
