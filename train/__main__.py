"""python -m train --output-dir DIR [--tensor-parallel-size 2 --data-parallel-size 2 --max-steps 800 ...]

Trains a model on this Python's standard library source (train/data.py) with the TP stack and writes into DIR
transformers' save_pretrained files, the tokenizer, train_log.jsonl and loss.png (train/run.py). It starts its
tp x dp ranks itself, as LLM does (one rank: in this process); under torchrun, launch/train.py is the entry point.
Every flag is a field of train/settings.py TrainSettings; launch/train.py takes the same settings as Hydra keys.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from train.settings import TrainSettings, add_flags, from_mapping

ROOT = Path(__file__).resolve().parent.parent


def threads(s: TrainSettings) -> int:
    """Each rank's intra-op threads (tp/dist.py threads_per_rank): the setting, OMP_NUM_THREADS, else the cores
    shared among the ranks, none kept for the driver (it only waits while they train)."""
    from tp.dist import threads_per_rank

    return threads_per_rank(s.world, s.device, s.threads_per_rank, reserved=0)[0]


def start_ranks(s: TrainSettings, argv: list[str]) -> int:
    """Start the world's ranks as `python -m train` processes meeting in a file store; wait; the first failing
    rank's exit code (the others are stopped), else 0."""
    with tempfile.TemporaryDirectory(prefix="tpref-train-") as tmp:
        env = dict(os.environ, TPREF_TRAIN_STORE=str(Path(tmp) / "store"), WORLD_SIZE=str(s.world), LOCAL_WORLD_SIZE=str(s.world), OMP_NUM_THREADS=str(threads(s)))
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [v for v in [env.get("PYTHONPATH")] if v])
        # their own session: a terminal's Ctrl-C reaches the driver alone, which stops them (below)
        # in this directory, as the user's paths are (the repository is on PYTHONPATH)
        procs = [subprocess.Popen([sys.executable, "-m", "train", *argv], start_new_session=True,
                                  env=dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in range(s.world)]
        try:
            while True:
                codes = [p.poll() for p in procs]
                failed = [c for c in codes if c not in (None, 0)]
                if failed or all(c == 0 for c in codes):
                    break
                time.sleep(0.2)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            for p in procs:
                p.wait()
        return failed[0] if failed else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m train", description=__doc__.split("\n\n")[1])
    add_flags(parser)
    args = parser.parse_args(argv)
    rank = os.environ.get("RANK")
    who = f"[rank {rank}] " if rank is not None else ""
    try:
        s = from_mapping(vars(args))
        s.validate(int(os.environ["WORLD_SIZE"]) if rank is not None else None)
    except ValueError as exc:
        print(f"{who}error: {exc}", file=sys.stderr, flush=True)
        return 2
    from train.run import prepare_output, rank_main

    if rank is not None:  # a rank started below (under torchrun, launch/train.py is the entry point)
        if "TPREF_TRAIN_STORE" not in os.environ:
            print(f"{who}error: under torchrun, run launch/train.py (Hydra's keys: tensor_parallel_size=2 ...)",
                  file=sys.stderr, flush=True)
            return 2
        return rank_main(s)
    t0 = time.perf_counter()
    try:
        data = prepare_output(s)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted while reading the corpus", file=sys.stderr)
        return 130
    if data:
        print(f"corpus: {data['files'][0]} files for training ({data['train'].numel():,} tokens), "
              f"{data['files'][1]} held out ({data['held_out'].numel():,} tokens); BPE of {len(data['tokenizer'])} "
              f"tokens ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
    cfg = s.model_config(len(data["tokenizer"]) if data else None)
    print(f"training {cfg.family} {s.size} (d_model {cfg.d_model}, {cfg.n_layers} layers) at tp "
          f"{s.tensor_parallel_size} x dp {s.data_parallel_size}, {threads(s)} thread(s) per rank, {s.max_steps} steps "
          f"of {s.batch_size} x {s.max_seq_len} tokens, into {s.output_dir}", file=sys.stderr, flush=True)
    os.environ["OMP_NUM_THREADS"] = str(threads(s))
    try:
        if s.world == 1:  # this process is the one rank
            import torch

            torch.set_num_threads(threads(s))
            with tempfile.TemporaryDirectory(prefix="tpref-train-") as tmp:
                os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                                  TPREF_TRAIN_STORE=str(Path(tmp) / "store"))
                code = rank_main(s)
        else:
            code = start_ranks(s, argv)
    except KeyboardInterrupt:  # the ranks are stopped (start_ranks' finally)
        step = Path(s.output_dir) / "checkpoint" / "step"  # written once every rank's file of that step is
        print("\ninterrupted: the ranks are stopped" + (
            f"; {step.parent} holds the checkpoint of step {step.read_text().strip()}: the same command with --resume "
            f"continues from it" if step.is_file() else "; no checkpoint was written yet"), file=sys.stderr)
        return 130
    if code == 0:
        took = time.perf_counter() - t0
        print(f"wrote {s.output_dir}: the model, its tokenizer, train_log.jsonl, loss.png ({took:.0f} s in all)",
              file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
