"""`python -m train` and launch/train.py: a run from the command line writes a model that transformers and LLM
serve, the same batches give the same losses at every layout, and bad settings are one line before any rank starts.

The runs are tiny (a 2-layer model, 32-token sequences, a few stdlib packages as the corpus): what they check is the
program around the step (train/step.py's own tests check the step against one device)."""

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from tests.launching import ROOT, launch_on_pool

TINY = ["--size", "tiny", "--vocab-size", "384", "--max-seq-len", "32", "--max-steps", "8", "--batch-size", "4",
        "--micro-batch-size", "2", "--eval-interval", "4", "--log-interval", "2", "--eval-rows", "4",
        "--warmup-steps", "2", "--lr", "0.01", "--save-interval", "0"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A few stdlib packages' sources, copied: a corpus of ~100 k tokens."""
    root, out = Path(sysconfig.get_paths()["stdlib"]), tmp_path_factory.mktemp("corpus")
    for package in ("json", "email"):
        shutil.copytree(root / package, out / package, ignore=shutil.ignore_patterns("__pycache__", "test*"))
    return out


def log_rows(directory: Path) -> tuple[list[dict], list[dict]]:
    rows = [json.loads(line) for line in (directory / "train_log.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r], [r for r in rows if "eval_loss" in r]


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory) -> Path:
    """`python -m train` at tp 2 (it starts its two ranks itself)."""
    out = tmp_path_factory.mktemp("tp2")
    proc = subprocess.run([sys.executable, "-m", "train", "--output-dir", str(out), "--corpus", str(corpus),
                           "--tensor-parallel-size", "2", *TINY], cwd=ROOT, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 8/8" in proc.stderr  # the progress line
    assert "outlived shutdown" not in proc.stderr  # each rank's group ended with it (tp/dist.py init_from_env)
    return out


def test_python_m_train_writes_the_model_its_log_and_curve(trained):
    train, held = log_rows(trained)
    assert [r["step"] for r in train] == [2, 4, 6, 8] and [r["step"] for r in held] == [4, 8]
    for r in train:
        assert {"step", "loss", "lr", "tokens_per_s"} <= set(r) and r["tokens_per_s"] > 0
    assert train[-1]["loss"] < train[0]["loss"]  # it learns something even in 8 steps
    assert (trained / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in trained.iterdir()}


def one_device_losses(directory: Path) -> list[float]:
    """The run's steps on one device in this process: the dense model from the same initial weights, the step's
    whole batch as its micro-batches, the same settings (train_settings.json)."""
    from layers.models.lm import dense_lm
    from train.data import step_batch
    from train.run import train_init
    from train.settings import TrainSettings
    from train.step import TrainConfig, Trainer

    s = TrainSettings(**json.loads((directory / "train_settings.json").read_text()))
    data = torch.load(directory / "tokens.pt")
    cfg = s.model_config(data["vocab_size"])
    c = TrainConfig(lr=s.lr, min_lr=s.min_lr, warmup_steps=s.warmup_steps, max_steps=s.max_steps,
                    weight_decay=s.weight_decay, grad_clip=s.grad_clip, accumulation=s.batch_size // s.micro)
    trainer = Trainer(train_init(dense_lm(cfg, torch.float32, "cpu"), s.seed, cfg.n_layers), c)
    return [trainer.step(list(step_batch(data["train"], step, s.seed, s.batch_size, s.max_seq_len + 1).split(
        s.micro)))["loss"] for step in range(s.max_steps)]


def test_the_losses_are_one_devices_at_tp_2_and_through_launch_train_at_dp_2(trained, corpus, tmp_path):
    """python -m train at tp 2, and launch/train.py with Hydra's keys at tp 1 x dp 2 with the distributed optimizer
    (each replica takes its rows of the step's batch; run on a pool of two ranks, as torchrun's ranks run it): both
    log the losses of one device training the dense model on the whole batches (float32: the sums' order differs)."""
    keys = [f"{flag.removeprefix('--').replace('-', '_')}={value}" for flag, value in zip(TINY[::2], TINY[1::2])]
    proc, _ = launch_on_pool(2, f"output_dir={tmp_path}", f"corpus={corpus}", "data_parallel_size=2",
                             "distributed_optimizer=true", *keys, run_dir=tmp_path / "hydra", script="train.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = one_device_losses(trained)
    for run in (trained, tmp_path):
        logged = {r["step"]: r["loss"] for r in log_rows(run)[0]}
        torch.testing.assert_close([logged[k] for k in sorted(logged)], [want[k - 1] for k in sorted(logged)],
                                   rtol=1e-4, atol=0)


def test_llm_serves_the_trained_model_as_transformers_does(trained):
    """LLM at tp 2 and transformers, both from the exported directory: the same greedy tokens from the tokenizer's
    text."""
    transformers = pytest.importorskip("transformers")
    from serve.llm import LLM
    from serve.sampling_params import SamplingParams

    tok = transformers.AutoTokenizer.from_pretrained(trained)
    hf = transformers.AutoModelForCausalLM.from_pretrained(trained).eval()
    prompt = tok("def ")["input_ids"]
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                       pad_token_id=0)[0, len(prompt):].tolist()
    with LLM(str(trained), tensor_parallel_size=2) as llm:
        got = llm.generate(["def "], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].outputs[0]
    assert got.token_ids == want


@pytest.mark.parametrize("flags, message", [
    (["--tensor-parallel-size", "3"], "does not divide"),
    (["--data-parallel-size", "2", "--batch-size", "6", "--micro-batch-size", "2"], "is not divisible into"),
    (["--distributed-optimizer"], "set data_parallel_size > 1"),
    (["--family", "mixtral"], "gpt2 | llama"),
    (["--dtype", "float16"], "float32, bfloat16, float64"),
    (["--resume"], "no checkpoint of an earlier run"),
])
def test_bad_settings_are_one_line_before_any_rank_starts(tmp_path, capsys, corpus, flags, message):
    from train.__main__ import main

    assert main(["--output-dir", str(tmp_path / "out"), "--corpus", str(corpus), *TINY, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err, err


def test_an_empty_corpus_and_a_world_of_another_size_are_refused(tmp_path, capsys, monkeypatch):
    from train.__main__ import main

    (tmp_path / "empty").mkdir()
    assert main(["--output-dir", str(tmp_path / "out"), "--corpus", str(tmp_path / "empty")]) == 2
    assert "nothing to train on" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")  # a rank of a 4-process torchrun job, asked for tp 2 x dp 1
    assert main(["--output-dir", str(tmp_path / "out"), "--tensor-parallel-size", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("[rank 1] error: ") and "the world has 4" in err, err


def test_a_resume_with_other_settings_is_refused_naming_them(tmp_path, capsys, corpus):
    """--resume checks the earlier run's train_settings.json on every rank before any collective."""
    from dataclasses import asdict

    from train.__main__ import main
    from train.settings import TrainSettings

    out = tmp_path / "out"
    (out / "checkpoint").mkdir(parents=True)
    (out / "tokens.pt").write_bytes(b"")
    flags = ["--output-dir", str(out), "--corpus", str(corpus), *TINY]
    earlier = TrainSettings(output_dir=str(out), corpus=str(corpus), size="tiny", vocab_size=384, max_seq_len=32,
                            max_steps=8, batch_size=4, micro_batch_size=2, eval_interval=4, log_interval=2,
                            eval_rows=4, warmup_steps=2, lr=0.01, save_interval=0)
    (out / "train_settings.json").write_text(json.dumps(asdict(earlier)))
    assert main([*flags, "--resume", "--batch-size", "8", "--seed", "1"]) == 2
    err = capsys.readouterr().err
    assert "batch_size=4 (here 8)" in err and "seed=0 (here 1)" in err, err
