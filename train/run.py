"""A training run on one rank: the model cut for this rank, the step loop, held-out evaluation, the log, the
checkpoint, and at the end the dense model exported in transformers' layout with its curve.

    every rank                                   rank 0 alone
    ─────────────────────────────────────────    ────────────────────────────────────────────────────
    batch = the step's rows (train/data.py)
    its replica's rows → micro-batches
    Trainer.step  (train/step.py: ★ collectives)  train_log.jsonl row, the progress line
    every eval_interval: held-out loss            eval row
    end: checkpoint/rank<r>.pt, gather_dense       save_pretrained, loss.png
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from train.settings import TrainSettings

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.float32}


def train_init(model: torch.nn.Module, seed: int, n_layers: int) -> torch.nn.Module:
    """GPT-2's initialization: every matrix N(0, 0.02), the projections back into the residual stream (attn_out,
    mlp_down, o, down) scaled by 1/sqrt(2L), biases 0, norms 1. Drawn on the CPU: the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim < 2:
                is_norm = "norm" in name or ".ln_" in f".{name}"
                p.fill_(1.0 if is_norm and name.endswith("weight") else 0.0)
                continue
            std = 0.02 / math.sqrt(2 * n_layers) if name.split(".")[-2] in ("attn_out", "mlp_down", "o", "down") \
                else 0.02
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * std)
    return model


class Progress:
    """One line on stderr: step, loss, held-out loss, tokens/s, time left; rewritten in place on a terminal."""

    def __init__(self, total: int):
        self.total, self.tty = total, sys.stderr.isatty()

    def show(self, step: int, loss: float, eval_loss: float | None, tokens_per_s: float, left_s: float) -> None:
        line = (f"step {step}/{self.total}  loss {loss:.3f}" + (f"  held-out {eval_loss:.3f}" if eval_loss else "")
                + f"  {tokens_per_s:,.0f} tok/s  {int(left_s) // 60}:{int(left_s) % 60:02d} left")
        print(("\r" + line.ljust(78)) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr,
              flush=True)

    def close(self) -> None:
        if self.tty:
            print(file=sys.stderr)


def plot(rows: list[dict], path: Path, title: str) -> None:
    """loss.png: the training loss per logged step and the held-out loss, against tokens seen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in rows if "loss" in r]
    held = [r for r in rows if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    ax.plot([r["tokens"] / 1e6 for r in train], [r["loss"] for r in train], lw=1.2, label="train")
    ax.plot([r["tokens"] / 1e6 for r in held], [r["eval_loss"] for r in held], "o-", lw=1.6, label="held-out")
    ax.set_xlabel("tokens seen (millions)")
    ax.set_ylabel("cross-entropy (nats per token)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run_rank(s: TrainSettings, ctx) -> dict:
    """Train on this rank of the tp x dp world (global rank d·tp + t); return rank 0's summary (the last row)."""
    from layers.models.lm import dense_lm
    from tp.dist import grid_groups
    from train.data import step_batch
    from train.export import gather_dense, save_pretrained
    from train.step import TrainConfig, Trainer, train_lm

    tp, dp = s.tensor_parallel_size, s.data_parallel_size
    tp_groups, dp_groups = grid_groups(ctx.world_size, dp)
    group, dp_group = tp_groups[ctx.rank // tp], dp_groups[ctx.rank % tp]
    replica, out = ctx.rank // tp, Path(s.output_dir)
    data = torch.load(out / "tokens.pt")
    cfg = s.model_config(data["vocab_size"])  # the tokenizer's (transformers is imported by rank 0 alone, to export)
    dense = train_init(dense_lm(cfg, DTYPES[s.dtype], "cpu"), s.seed, cfg.n_layers)
    lm = train_lm(dense, group, s.sequence_parallel).to(ctx.device)
    del dense
    c = TrainConfig(lr=s.lr, min_lr=s.min_lr, warmup_steps=s.warmup_steps, max_steps=s.max_steps,
                    weight_decay=s.weight_decay, grad_clip=s.grad_clip, accumulation=s.accumulation,
                    distributed_optimizer=s.distributed_optimizer, attention=s.attention)
    trainer = Trainer(lm, c, group, dp_group if dp > 1 else None,
                      autocast=torch.bfloat16 if s.dtype == "bfloat16" else None)
    if s.resume:
        resume(trainer, out / "checkpoint")
    main = ctx.rank == 0
    T, per = s.max_seq_len, s.batch_size // dp
    eval_rows = None  # the same held-out rows every time; none when too few tokens are held out for one window
    if data["held_out"].numel() > T + 1:
        eval_rows = step_batch(data["held_out"], -1, s.seed, s.eval_rows, T + 1).to(ctx.device)
    elif main:
        print(f"note: {data['held_out'].numel()} held-out tokens, too few for a window of {T + 1}: no eval_loss",
              file=sys.stderr, flush=True)
    if main and s.resume:  # the rows logged after the checkpoint are logged again
        kept = [line for line in (out / "train_log.jsonl").read_text().splitlines()
                if json.loads(line)["step"] <= trainer.step_count]
        (out / "train_log.jsonl").write_text("".join(line + "\n" for line in kept))
    log = open(out / "train_log.jsonl", "a" if s.resume else "w") if main else None
    progress = Progress(s.max_steps) if main else None
    last, eval_loss = {}, None
    start, since, tokens_since = time.perf_counter(), time.perf_counter(), 0
    first = trainer.step_count
    try:
        for step in range(first, s.max_steps):
            batch = step_batch(data["train"], step, s.seed, s.batch_size, T + 1)
            mine = batch[replica * per:(replica + 1) * per].to(ctx.device)
            row = trainer.step(list(mine.split(s.micro)))
            tokens_since += s.batch_size * T
            done = row["step"]
            evaluated = eval_rows is not None and (done % s.eval_interval == 0 or done == s.max_steps)
            if evaluated:
                eval_loss = trainer.evaluate(eval_rows, s.micro)
            if main and (done % s.log_interval == 0 or done == s.max_steps or evaluated):
                now = time.perf_counter()
                rate = tokens_since / (now - since)
                last = {"step": done, "loss": round(row["loss"], 5), "lr": row["lr"],
                        "grad_norm": round(row["grad_norm"], 5), "tokens_per_s": round(rate, 1),
                        "tokens": done * s.batch_size * T, "elapsed_s": round(now - start, 2)}
                log.write(json.dumps(last) + "\n")
                if evaluated:
                    log.write(json.dumps({"step": done, "eval_loss": round(eval_loss, 5),
                                          "tokens": last["tokens"]}) + "\n")
                    last["eval_loss"] = round(eval_loss, 5)
                log.flush()
                left = (now - start) / (done - first) * (s.max_steps - done)
                progress.show(done, row["loss"], eval_loss, rate, left)
                since, tokens_since = now, 0
            if s.save_interval and done % s.save_interval == 0 and done < s.max_steps:
                save(trainer, out / "checkpoint", main)
    finally:
        if main:
            log.close()
            progress.close()
    save(trainer, out / "checkpoint", main)
    gathered = gather_dense(trainer.lm, group)  # every tp group gathers its replica (they are equal)
    if main:
        from transformers import AutoTokenizer

        save_pretrained(gathered.float(), out, AutoTokenizer.from_pretrained(out))
        rows = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
        plot(rows, out / "loss.png", f"{cfg.family} {s.size}: {sum(p.numel() for p in gathered.parameters()):,} "
             f"parameters, tp {tp} x dp {dp}")
    if dist.is_initialized():
        dist.barrier()
    return last


def save(trainer, directory: Path, main: bool) -> None:
    """Every rank's checkpoint file, then (once all are written) rank 0 records the step in directory/step."""
    trainer.save(directory)
    dist.barrier()
    if main:
        (directory / "step").write_text(f"{trainer.step_count}\n")


def resume(trainer, directory: Path) -> None:
    """Every rank loads its file; a rank that cannot, or files of different steps, stop every rank with one line
    (the ranks agree on it through one exchange before the next step's collectives)."""
    try:
        trainer.load(directory)
        mine = trainer.step_count
    except Exception as exc:  # a missing, foreign or cut-short file
        mine = f"{directory}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    failed = [x for x in every if isinstance(x, str)]
    if failed:
        raise ValueError(failed[0])
    if len(set(every)) > 1:
        raise ValueError(f"{directory}: the ranks' checkpoints are of different steps ({sorted(set(every))}): the run "
                         f"was stopped while saving; start it again without --resume")


def train_world(s: TrainSettings, ctx, prepared: bool) -> None:
    """Prepare the data on rank 0 unless the driver has (its error, if any, reaches every rank: no one waits in
    vain), then train. ValueError: a setting only the run finds wrong, on every rank."""
    if not prepared:
        error = [None]
        if ctx.rank == 0:
            try:
                prepare_output(s)
            except ValueError as exc:
                error = [str(exc)]
        dist.broadcast_object_list(error, src=0)
        if error[0] is not None:
            raise ValueError(error[0])
    run_rank(s, ctx)


def rank_main(s: TrainSettings) -> int:
    """A rank started by `python -m train`: join the world in the file store the driver named, train, leave."""
    from tp.dist import init_from_env, shutdown

    ctx = init_from_env(s.backend, init_method=f"file://{os.environ['TPREF_TRAIN_STORE']}", device=s.device)
    try:
        train_world(s, ctx, prepared=True)
        return 0
    except ValueError as exc:  # a checkpoint the ranks cannot resume from: every rank finds it
        print(f"[rank {ctx.rank}] error: {exc}", file=sys.stderr, flush=True)
        return 2
    finally:
        del ctx
        left = shutdown()
        if left:
            print(f"[rank {os.environ['RANK']}] warning: the process group's threads outlived shutdown "
                  f"({', '.join(left)}): something still refers to the group", file=sys.stderr, flush=True)


def prepare_output(s: TrainSettings) -> dict:
    """output_dir made, the corpus read and tokenized there (train/data.py prepare), the settings written
    (train_settings.json); on resume, only the check that they are the earlier run's (its tokenizer and tokens.pt
    are used)."""
    from train.data import prepare

    out = Path(s.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if s.resume:
        s.check_resume()
        return {}
    data = prepare(s.corpus, s.held_out, s.vocab_size, out, s.tokenizer)
    (out / "train_settings.json").write_text(json.dumps(asdict(s), indent=2) + "\n")  # what --resume checks
    return data
