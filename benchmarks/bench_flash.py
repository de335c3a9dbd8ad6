"""FlashAttention's memory traffic against the materializing algorithm's, and the flash backend's cost on this CPU
(docs/flash.md).

    python benchmarks/bench_flash.py [--parts traffic,speed,invariance,trainer] [--repeats 3]

  traffic   formulas only (layers/attention/flash.py): elements moved between HBM and on-chip memory per head for
            a causal prompt of N tokens, d_head = 128, the paper's blocks for an on-chip memory M of 96K elements (192
            KiB of 16-bit values, within an H100 SM's 228 KB of shared memory) and of d² = 16K, against Algorithm 0's
            4·N·d + 4·N²,
            N = 512 .. 128K; plotted.
  speed     the trained model (models/stdlib) through LLM, 16 requests of 192-token prompts, 32 greedy tokens: the
            flash backend against the cpu backend (PyTorch's fused SDPA per request), generate() in turn, medians;
            the tokens compared. The flash backend is a readable reference of a GPU kernel, not a CPU kernel.

  invariance  Thinking Machines' measurement on the trained model: one prompt (a fixed piece of Python) asked 1,000 times
            at temperature 0 (32 tokens), in 40 generate() calls of 25 copies each among 25 other prompts of
            random lengths 8..200, every call's order shuffled (so each copy meets other batches, chunk boundaries and
            places); float32 and bfloat16, without and with batch_invariant: distinct completions of the prompt,
            distinct sequences of their chosen logprobs (bit for bit), and tokens/s of the whole run, with the mode /
            without.
  trainer   RL's check on the trained model: 100 requests (the prompt above and random prompts of 8..200 tokens)
            sampled at temperature 1 (each its seed) for 32 tokens in two generate() calls at tp 1, then the trainer's
            forward (train/step.py tp_logprobs on the checkpoint's weights, in this process, 4 sequences at a time)
            over prompt + completion; float32 and bfloat16, the engine and the trainer both without and both with
            batch_invariant: requests whose every chosen logprob equals the trainer's to the bit, and the largest
            difference.

Writes outputs/bench_flash.json and outputs/flash_traffic.png (copied to docs/).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (ROOT, in_turn, parse_args, print_table, random_prompts, save_figure, timed_generate,
                               write_json)

D = 128
MEMORIES = {"M = 96K (192 KiB of 16-bit values; an H100 SM has up to 228 KB of shared memory)": 96 * 1024,
            "M = d² = 16K": D * D}
LENGTHS = [512 * 2 ** i for i in range(9)]  # 512 .. 128K


def part_traffic(out) -> None:
    from layers.attention.flash import flash_traffic, sram_blocks, standard_traffic

    rows = []
    for n in LENGTHS:
        row = {"n": n, "standard": standard_traffic(n, n, D)}
        for name, m in MEMORIES.items():
            b_r, b_c = sram_blocks(m, D)
            row[name] = flash_traffic(n, n, D, b_r, b_c, causal=True)
        out["traffic"].append(row)
        rows.append([f"{n:,}", f"{row['standard']:.3g}"] + [f"{row[k]:.3g} ({row[k] / row['standard']:.2f}x)"
                                                             for k in MEMORIES])
    print_table(["N", "materialized (4Nd + 4N²)"] + [f"flash, {k}" for k in MEMORIES], rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    for name in MEMORIES:
        ax.loglog(LENGTHS, [r[name] for r in out["traffic"]], "s-", label=f"flash (causal), {name}")
    # drawn last, dashed and hollow: at M = d² the flash line lies on it
    ax.loglog(LENGTHS, [r["standard"] for r in out["traffic"]], "o--", color="black", mfc="none", markersize=9,
              label="materialized: 4Nd + 4N²")
    ax.set_xlabel("N (tokens of one causal prompt)")
    ax.set_ylabel("HBM elements moved per head")
    ax.set_title(f"Attention's memory traffic, d_head = {D}")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16))  # below: the lines fill the axes
    save_figure(fig, "flash_traffic.png")


def part_speed(args, out) -> None:
    from serve import LLM
    from serve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    llms = {name: LLM(str(ROOT / args.model), attention=name, enable_prefix_caching=False) for name in ("cpu", "flash")}
    try:
        prompts = random_prompts([192] * 16, seed=1, vocab=llms["cpu"].model_config.vocab_size)
        got = in_turn({name: (lambda llm=llm: timed_generate(llm, prompts, params)) for name, llm in llms.items()},
                      args.repeats)
    finally:
        for llm in llms.values():
            llm.shutdown()
    times = {name: statistics.median(t for _, t in runs) for name, runs in got.items()}
    same = got["cpu"][-1][0] == got["flash"][-1][0]
    out["speed"] = {"generate_s": times, "flash_over_cpu": times["flash"] / times["cpu"], "same_tokens": same}
    print(f"generate(), flash / cpu backend: {out['speed']['flash_over_cpu']:.2f}x; the same tokens: {same}")


PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Parse the arguments and"


def part_invariance(args, out) -> None:
    import random
    import time

    from serve import LLM
    from serve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=0)
    rows = []
    for dtype in ("float32", "bfloat16"):
        for invariant in (False, True):
            rng = random.Random(0)  # the same calls and orders for every setting
            with LLM(str(ROOT / args.model), dtype=dtype, batch_invariant=invariant, max_num_seqs=16,
                     max_num_batched_tokens=256) as llm:
                vocab = llm.model_config.vocab_size
                completions, scored, tokens, start = [], [], 0, time.perf_counter()
                for _ in range(args.calls):
                    batch = [PROMPT] * args.copies + [[rng.randrange(vocab) for _ in range(rng.randint(8, 200))]
                                                      for _ in range(args.copies)]
                    rng.shuffle(batch)
                    for prompt, o in zip(batch, llm.generate(batch, params)):
                        tokens += len(o.outputs[0].token_ids)
                        if prompt == PROMPT:
                            c = o.outputs[0]
                            completions.append(tuple(c.token_ids))
                            scored.append(tuple(lp[t] for lp, t in zip(c.logprobs, c.token_ids)))  # the bits
                wall = time.perf_counter() - start
            row = {"dtype": dtype, "batch_invariant": invariant, "requests": len(completions),
                   "distinct": len(set(completions)), "distinct_logprobs": len(set(scored)),
                   "tokens_per_s": tokens / wall}
            out["invariance"].append(row)
            rows.append([dtype, "on" if invariant else "off", row["requests"], row["distinct"],
                         row["distinct_logprobs"], f"{row['tokens_per_s']:.0f}"])
            print(rows[-1], flush=True)
    print_table(["dtype", "batch_invariant", "requests of the prompt", "distinct completions",
                 "distinct logprob sequences (bits)", "tokens/s"], rows)
    for dtype in ("float32", "bfloat16"):
        off, on = (next(r for r in out["invariance"] if r["dtype"] == dtype and r["batch_invariant"] == m)
                   for m in (False, True))
        print(f"{dtype}: tokens/s with the mode / without: {on['tokens_per_s'] / off['tokens_per_s']:.2f}")


def part_trainer(args, out) -> None:
    import os
    import random

    import torch
    import torch.distributed as dist

    from serve import LLM
    from serve.build import dense_model
    from serve.sampling_params import SamplingParams
    from train.step import tp_logprobs, train_lm

    torch.set_num_threads(1)  # the mode's one thread, here as on the engine's rank
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)
    rows = []
    for dtype in ("float32", "bfloat16"):
        for invariant in (False, True):
            rng = random.Random(1)
            with LLM(str(ROOT / args.model), dtype=dtype, batch_invariant=invariant, max_num_seqs=16,
                     max_num_batched_tokens=256) as llm:
                cfg, vocab = llm.model_config, llm.model_config.vocab_size
                outs = []
                for call in range(2):
                    batch = [PROMPT] * 10 + [[rng.randrange(vocab) for _ in range(rng.randint(8, 200))]
                                             for _ in range(40)]
                    rng.shuffle(batch)
                    params = [SamplingParams(temperature=1.0, seed=100 * call + i, max_tokens=32, ignore_eos=True,
                                             logprobs=0) for i in range(len(batch))]
                    outs += llm.generate(batch, params)
            weights = dense_model(cfg, str(ROOT / args.model), getattr(torch, dtype), "cpu")
            trainer = train_lm(weights, dist.group.WORLD)
            equal, worst, tokens = 0, 0.0, 0
            with torch.no_grad():
                for i in range(0, len(outs), 4):
                    part = outs[i:i + 4]
                    seqs = [o.prompt_token_ids + o.outputs[0].token_ids for o in part]
                    for o, lps in zip(part, tp_logprobs(trainer, seqs, batch_invariant=invariant)):
                        c = o.outputs[0]
                        engine = [lp[t] for lp, t in zip(c.logprobs, c.token_ids)]
                        mine = lps[len(o.prompt_token_ids) - 1:].tolist()
                        equal += engine == mine
                        worst = max(worst, max(abs(a - b) for a, b in zip(engine, mine)))
                        tokens += len(engine)
            row = {"dtype": dtype, "batch_invariant": invariant, "requests": len(outs), "tokens": tokens,
                   "equal_to_the_bit": equal, "max_abs_diff": worst}
            out["trainer"].append(row)
            rows.append([dtype, "on" if invariant else "off", len(outs), tokens, f"{equal} / {len(outs)}",
                         f"{worst:.1e}"])
            print(rows[-1], flush=True)
    print_table(["dtype", "batch_invariant (engine and trainer)", "requests", "sampled tokens",
                 "requests whose logprobs equal the trainer's (bits)", "largest |difference|"], rows)


def main(argv=None) -> None:
    args = parse_args(__doc__, {"--parts": "traffic,speed,invariance", "--repeats": 3, "--model": "models/stdlib",
                                "--calls": 40, "--copies": 25}, argv)
    out = {"d_head": D, "memories": MEMORIES, "traffic": [], "invariance": [], "trainer": []}
    parts = args.parts.split(",")
    if "traffic" in parts:
        part_traffic(out)
    if "speed" in parts:
        part_speed(args, out)
    if "invariance" in parts:
        part_invariance(args, out)
    if "trainer" in parts:
        part_trainer(args, out)
    write_json(ROOT / "outputs" / "bench_flash.json", out)


if __name__ == "__main__":
    main()
