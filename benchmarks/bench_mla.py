"""MLA against grouped-query attention: requests one pool holds, and decode time absorbed against decompressed.

    python benchmarks/bench_mla.py [--out outputs/bench_mla.json] [--contexts 1024 4096] [--batch 4]

Part 1, pool: the bytes per token each rank's pool allocates (KVPool.for_model on a group of one, beside the formula
for p ranks) for deepseek_tiny's MLA and Llama models of the same width with h_kv = 4, 2, 1; then how many requests
of 512 positions a pool of 16 MiB per rank holds at p = 1, 2, 4. The latent is whole on every rank, so MLA's count
does not grow with p while the heads' caches split.

Part 2, time: one MLA layer of DeepSeek-V3's per-rank shape at TP = 8, float32: `batch` decodes against 1k and 4k
cached latents, decompressed (K, V rebuilt per head from the whole latent every step, then MHA) against absorbed
(q̃ = q_nope·W_UK, MQA over the latent, then W_UV: layers/models/mla.py's serving path); and one prompt of 512 and
2048 tokens from position 0, decompressed (the served prefill) against absorbed. Both outputs are compared (they are
the same attention); each time ratio is measured in one run (median of repeats).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.common import median_time, parse_args, print_table, write_json
from layers.models.llama import LlamaConfig
from layers.models.lm import tp_lm
from layers.models.mla import DEEPSEEK_TINY, DeepseekConfig, absorb, decompress, decompressed, unabsorb
from serve.kv_cache import KVPool
from tp.partition import kv_bytes_per_token, kv_heads_per_rank, mla_kv_bytes_per_token

POOL_BYTES = 16 << 20
BLOCK = 16
POSITIONS = 512  # per request: prompt + output


def one_rank_group() -> dist.ProcessGroup:
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)
    return dist.group.WORLD


def pool_part() -> dict:
    group, e = one_rank_group(), 4
    tiny = DEEPSEEK_TINY
    models = {"MLA (deepseek_tiny)": tiny}
    for h_kv, name in ((4, "MHA"), (2, "GQA"), (1, "MQA")):
        models[f"{name} h_kv={h_kv}"] = LlamaConfig(d_model=64, n_heads=4, n_kv_heads=h_kv, d_head=32, d_ffn=96,
                                                    n_layers=tiny.n_layers, max_seq_len=256, vocab_size=1000)
    rows = []
    for name, cfg in models.items():
        lm = tp_lm(cfg, "v2", group, dtype=torch.float32)
        pool = KVPool.for_model(lm, 4, BLOCK, torch.float32)
        measured = pool.measured_bytes_per_token()
        for p in (1, 2, 4):
            if cfg.family == "deepseek_v3":
                formula = mla_kv_bytes_per_token(cfg.n_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim, e)
            else:
                formula = kv_bytes_per_token(cfg.n_layers, kv_heads_per_rank(cfg.n_kv_heads, p), cfg.d_head, e)
            blocks = POOL_BYTES // (formula * BLOCK)
            rows.append({"model": name, "p": p, "bytes_per_token_per_rank": formula,
                         "measured_at_p1": measured if p == 1 else None,
                         "requests_held": blocks // math.ceil(POSITIONS / BLOCK)})
    return {"pool_bytes_per_rank": POOL_BYTES, "positions_per_request": POSITIONS, "block_size": BLOCK, "rows": rows}


def decode_part(contexts: list[int], batch: int, repeats: int, prompts: list[int]) -> dict:
    cfg = DeepseekConfig(n_heads=16, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                         v_head_dim=128)  # one TP = 8 rank of V3: 128 heads / 8
    gen = torch.Generator().manual_seed(0)
    H = cfg.n_heads
    kv_b = torch.randn(H * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank, generator=gen) * 0.05
    out = []
    for n in contexts:
        latents = [torch.randn(n, cfg.latent_dim, generator=gen) for _ in range(batch)]
        q_nope = torch.randn(batch, H, 1, cfg.qk_nope_head_dim, generator=gen)
        q_rope = torch.randn(batch, H, 1, cfg.qk_rope_head_dim, generator=gen)

        def decompressed_decode():
            res = []
            for b in range(batch):
                k, v = decompress(latents[b], kv_b, cfg)
                q = torch.cat([q_nope[b], q_rope[b]], dim=-1)
                res.append(F.scaled_dot_product_attention(q[None], k[None], v[None], scale=cfg.scale)[0, :, 0])
            return torch.stack(res)  # [B, H, v]

        def absorbed():
            res = []
            for b in range(batch):
                q = absorb(q_nope[b], q_rope[b], kv_b, cfg)  # [H, 1, c + r]
                lat = latents[b][None, None]  # [1, 1, N, c + r]: one K,V "head", shared
                # the H query heads as the latent's H query rows (what the cpu and batched backends do for a decode)
                o = F.scaled_dot_product_attention(q.view(1, 1, H, -1), lat, lat[..., :cfg.kv_lora_rank],
                                                   scale=cfg.scale)  # [1, 1, H, c]
                res.append(unabsorb(o.reshape(1, -1), kv_b, cfg).view(H, -1))
            return torch.stack(res)

        with torch.no_grad():
            err = float((decompressed_decode() - absorbed()).abs().max())
            times = {name: median_time(fn, repeats) for name, fn in (("decompressed", decompressed_decode),
                                                                     ("absorbed", absorbed))}
        read = {"decompressed": n * cfg.latent_dim + n * H * (cfg.qk_head_dim + cfg.v_head_dim),
                "absorbed": n * cfg.latent_dim}  # elements read per request per layer (K,V built, then read)
        out.append({"context": n, "batch": batch, "max_abs_difference": err,
                    "decompressed_over_absorbed": times["decompressed"] / times["absorbed"],
                    "elements_touched_per_request": read})
    prefill = []
    for n in prompts:  # one prompt from position 0, causal: the compute-friendly form against the absorbed one
        latent = torch.randn(n, cfg.latent_dim, generator=gen)
        q_nope = torch.randn(H, n, cfg.qk_nope_head_dim, generator=gen)
        q_rope = torch.randn(H, n, cfg.qk_rope_head_dim, generator=gen)

        def dec():
            return decompressed(q_nope, q_rope, latent, kv_b, cfg, [(0, n)])

        def absorbed_prefill():
            q = absorb(q_nope, q_rope, kv_b, cfg)[None]  # [1, H, n, c + r]
            lat = latent[None, None]
            o = F.scaled_dot_product_attention(q, lat, lat[..., :cfg.kv_lora_rank], is_causal=True, scale=cfg.scale,
                                               enable_gqa=True)
            return unabsorb(o[0].transpose(0, 1).reshape(n, -1), kv_b, cfg)

        with torch.no_grad():
            err = float((dec() - absorbed_prefill()).abs().max())
            times = {name: median_time(fn, repeats) for name, fn in (("decompressed", dec),
                                                                     ("absorbed", absorbed_prefill))}
        prefill.append({"prompt": n, "max_abs_difference": err,
                        "absorbed_over_decompressed": times["absorbed"] / times["decompressed"]})
    return {"shape": cfg.asdict(), "rows": out, "prefill": prefill}


def main(argv=None) -> int:
    args = parse_args(__doc__, {"--out": "outputs/bench_mla.json", "--contexts": [1024, 4096], "--batch": 4,
                                "--repeats": 5, "--prompts": [512, 2048]}, argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    result = {"pool": pool_part(), "decode": decode_part(args.contexts, args.batch, args.repeats, args.prompts)}
    print(f"pool of {POOL_BYTES >> 20} MiB per rank, requests of {POSITIONS} positions, blocks of {BLOCK}:")
    print_table(["model", "p", "B per token per rank (measured at p = 1)", "requests held"],
                [[r["model"], r["p"], r["bytes_per_token_per_rank"] if r["measured_at_p1"] is None else
                  f"{r['bytes_per_token_per_rank']} ({r['measured_at_p1']:.0f})", r["requests_held"]]
                 for r in result["pool"]["rows"]])
    print("one MLA layer of V3's per-rank shape at TP = 8, float32:")
    print_table(["decode: context x batch", "decompressed / absorbed", "max abs difference"],
                [[f"{r['context']} x {r['batch']}", f"{r['decompressed_over_absorbed']:.1f}x",
                  f"{r['max_abs_difference']:.1e}"] for r in result["decode"]["rows"]])
    print_table(["prefill: tokens", "absorbed / decompressed", "max abs difference"],
                [[r["prompt"], f"{r['absorbed_over_decompressed']:.1f}x", f"{r['max_abs_difference']:.1e}"]
                 for r in result["decode"]["prefill"]])
    write_json(args.out, result)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
