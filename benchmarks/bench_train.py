"""Training throughput: the TP stack's train step against transformers' GPT2LMHeadModel trained by a plain PyTorch
loop, same shape and batches, and `python -m train` at each layout; model FLOPs utilisation against this machine's
matmul peak.

    python benchmarks/bench_train.py [--steps 12] [--repeats 3] [--layouts 1x1 2x1 1x2]

1. In one process, alternating (benchmarks/common.in_turn): `Trainer.step` at tp = dp = 1 (train/step.py, one rank)
   and transformers' GPT2LMHeadModel (sdpa attention, dropout 0) with torch's AdamW and clip_grad_norm_, both on the
   default model's shape (train/settings.py size small: d 128, 4 layers, 4 heads, FFN 512, vocabulary 4096,
   sequences of 256, batch 16), float32, every thread of the process. Each run times `steps` steps after 2 of warm-up;
   the ratio is ours / theirs of the medians.
2. `python -m train` at each layout (tp x dp; the program as a user runs it, its ranks started by it), on the
   stdlib corpus: tokens/s of its log after the first rows.
MFU: (6 N + 6 L T d) FLOPs per token (the weights' forward and backward, plus attention's scores and values), against
the peak a 1024 x 1024 float32 matmul reaches here on the same threads.
Writes outputs/bench_train.json and prints its section of docs/benchmarks.md.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import OUT, ROOT, in_turn, parse_args, table, write_json

SHAPE = dict(d=128, layers=4, heads=4, ffn=512, vocab=4096, T=256, B=16)


def matmul_peak(threads: int, n: int = 1024, repeats: int = 20) -> float:
    """FLOP/s of an n x n float32 matmul on this many threads (the best of repeats)."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best


def flops_per_token(n_params: int, s: dict) -> float:
    return 6 * n_params + 6 * s["layers"] * s["T"] * s["d"]


def side_by_side(steps: int, repeats: int) -> dict:
    """Our Trainer at tp = dp = 1 against transformers' GPT2LMHeadModel, alternating; tokens/s each."""
    import os

    import torch
    import transformers

    from layers.models.config import ModelConfig
    from layers.models.lm import dense_lm, shard_lm
    from tp.dist import init_from_env
    from train.run import train_init
    from train.step import TrainConfig, Trainer

    s = SHAPE
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    ctx = init_from_env("gloo", init_method=f"file://{tempfile.mkdtemp()}/store")
    cfg = ModelConfig(d_model=s["d"], n_heads=s["heads"], d_head=s["d"] // s["heads"], d_ffn=s["ffn"],
                      n_layers=s["layers"], max_seq_len=s["T"], vocab_size=s["vocab"])
    lm = shard_lm(train_init(dense_lm(cfg, torch.float32, "cpu"), 0, s["layers"]), "v2", ctx.group)
    ours = Trainer(lm, TrainConfig(lr=1e-3, warmup_steps=2, max_steps=10_000), ctx.group)
    hf_cfg = transformers.GPT2Config(n_embd=s["d"], n_layer=s["layers"], n_head=s["heads"], n_inner=s["ffn"],
                                     vocab_size=s["vocab"], n_positions=s["T"], activation_function="gelu_new",
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa")
    hf = transformers.GPT2LMHeadModel(hf_cfg)
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, s["vocab"], (s["B"], s["T"] + 1), generator=gen) for _ in range(steps + 2)]

    def theirs_step(ids):
        hf(ids[:, :-1], labels=ids[:, :-1]).loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def timed(step) -> float:
        for ids in batches[:2]:
            step(ids)
        start = time.perf_counter()
        for ids in batches[2:]:
            step(ids)
        return steps * s["B"] * s["T"] / (time.perf_counter() - start)

    runs = in_turn({"ours": lambda: timed(lambda ids: ours.step([ids])), "transformers": lambda: timed(theirs_step)},
                   repeats)
    n_params = sum(p.numel() for p in lm.parameters())
    return {"tokens_per_s": {k: statistics.median(v) for k, v in runs.items()}, "runs": runs,
            "parameters": n_params, "threads": torch.get_num_threads()}


def layout_run(tp: int, dp: int, steps: int, directory: Path) -> dict:
    """`python -m train` at tp x dp for `steps` steps; its tokens/s after the first logged rows."""
    import os

    out = directory / f"tp{tp}dp{dp}"
    env = {k: v for k, v in os.environ.items()  # not a rank of side_by_side's one-rank world
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    r = subprocess.run([sys.executable, "-m", "train", "--output-dir", str(out), "--tensor-parallel-size", str(tp),
                        "--data-parallel-size", str(dp), "--max-steps", str(steps), "--log-interval", "2",
                        "--eval-interval", str(steps)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if r.returncode:
        sys.exit(f"bench_train: tp {tp} x dp {dp} failed: {r.stderr.strip()[-800:]}")
    rows = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    rates = [row["tokens_per_s"] for row in rows if "tokens_per_s" in row][1:]
    return {"tp": tp, "dp": dp, "tokens_per_s": statistics.median(rates)}


def section(result: dict | None) -> list[str]:
    """Its section of docs/benchmarks.md."""
    if not result:
        return []
    side, peak = result["side_by_side"], result["peak_flops"]
    per_token = flops_per_token(side["parameters"], SHAPE)
    ours, theirs = side["tokens_per_s"]["ours"], side["tokens_per_s"]["transformers"]
    lines = ["## Training throughput", "",
             "`.venv/bin/python benchmarks/bench_train.py`: the default model's shape (GPT-2, d 128, 4 layers, "
             "vocabulary 4096, batch 16 x 256 tokens, float32). MFU against a 1024 x 1024 float32 matmul's "
             f"{peak / 1e9:.1f} GFLOP/s on {side['threads']} threads; {per_token / 1e6:.1f} MFLOP per token.", ""]
    lines += table(["what", "tokens/s (median)", "MFU", "ratio"], [
        ["TP stack, Trainer.step at tp 1 x dp 1", f"{ours:,.0f}", f"{ours * per_token / peak:.0%}",
         f"{ours / theirs:.2f}x"],
        ["transformers GPT2LMHeadModel, plain loop", f"{theirs:,.0f}", f"{theirs * per_token / peak:.0%}", "1.00x"],
    ] + [[f"`python -m train` at tp {r['tp']} x dp {r['dp']}", f"{r['tokens_per_s']:,.0f}",
          f"{r['tokens_per_s'] * per_token / peak:.0%}", f"{r['tokens_per_s'] / theirs:.2f}x"]
         for r in result["layouts"]])
    return lines + [""]


def main(argv=None) -> int:
    args = parse_args(__doc__, {"--steps": 12, "--repeats": 3, "--layout-steps": 30,
                                "--layouts": ["1x1", "2x1", "1x2"]}, argv)
    import torch

    side = side_by_side(args.steps, args.repeats)
    peak = matmul_peak(torch.get_num_threads())
    layouts = []
    with tempfile.TemporaryDirectory() as tmp:
        for layout in args.layouts:
            tp, dp = (int(x) for x in layout.split("x"))
            layouts.append(layout_run(tp, dp, args.layout_steps, Path(tmp)))
            print(layouts[-1], flush=True)
    result = {"side_by_side": side, "peak_flops": peak, "layouts": layouts, "shape": SHAPE}
    write_json(OUT / "bench_train.json", result)
    print("\n".join(section(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
