"""Perplexity through LLM (serve/eval.py) against transformers on the same checkpoint, window by window (float64)."""

import math

import pytest
import torch

from serve.eval import main, perplexity, windows

TEXT = ("def read(path):\n    with open(path) as f:\n        return f.read()\n\n"
        "def write(path, text):\n    with open(path, 'w') as f:\n        f.write(text)\n") * 3


def test_windows_score_every_token_but_the_first_once():
    for n, window, stride in ((50, 16, 8), (17, 16, 5), (5, 16, 8), (40, 4, 1), (33, 10, 9)):
        spans = windows(n, window, stride)
        scored = [pos for _, end, first in spans for pos in range(first, end)]
        assert scored == list(range(1, n)), (n, window, stride)
        assert all(end - start <= window and first > start for start, end, first in spans)
    with pytest.raises(ValueError, match="1 <= stride < window"):
        windows(10, 8, 8)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    from serve.toy_model import write

    path = tmp_path_factory.mktemp("eval") / "gpt2"
    write(path, "gpt2", "tiny", seed=2)
    return path


def test_perplexity_equals_transformers_window_by_window(toy, tmp_path, capsys):
    """LLM at p = 2 (float64, prompts in chunks of 16) against transformers' log_softmax over the same windows: the
    same mean negative log-likelihood to 1e-9; the CLI prints it, and refuses a missing file in one line."""
    from transformers import AutoModelForCausalLM

    from serve import LLM

    with LLM(str(toy), tensor_parallel_size=2, dtype="float64", long_prefill_token_threshold=16) as llm:
        ids = llm.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
        got = perplexity(llm, ids, window=32, stride=12)
    hf = AutoModelForCausalLM.from_pretrained(toy, dtype=torch.float64).eval()
    total = 0.0
    for start, end, first in windows(len(ids), 32, 12):
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([ids[start:end]])).logits[0], -1)
        total -= sum(logp[pos - start - 1, ids[pos]].item() for pos in range(first, end))
    assert got.tokens == len(ids) - 1 and got.windows > 3
    assert abs(got.nll - total / (len(ids) - 1)) < 1e-9 and math.isclose(got.perplexity, math.exp(got.nll))
    (tmp_path / "t.txt").write_text(TEXT)
    assert main(["--model", str(toy), "--file", str(tmp_path / "t.txt"), "--window", "32", "--stride", "12",
                 "--dtype", "float64"]) == 0
    out = capsys.readouterr().out
    assert f"{got.tokens} tokens in {got.windows} windows: {got.nll:.4f} nats/token" in out
    assert main(["--model", str(toy), "--file", str(tmp_path / "none.txt")]) == 2
    assert "--file" in capsys.readouterr().err


def test_lm_eval_against_the_server_gives_what_its_hf_backend_gives(toy, tmp_path):
    """lm-evaluation-harness (the `eval` extra; skipped where it is not installed, as in CI: .ci/run installs the
    test extras only) on our two tasks over held-out code: its local-completions client against python -m serve.api
    at p = 2 and its hf backend on the same checkpoint give the same accuracy and perplexities (float64)."""
    lm_eval = pytest.importorskip("lm_eval")
    import json
    import subprocess
    import sys

    from lm_eval.tasks import TaskManager

    from train.eval_tasks import write_lm_eval_tasks

    tasks = write_lm_eval_tasks(tmp_path / "tasks", count=8)
    context = json.loads((toy / "config.json").read_text())["n_positions"]
    server = subprocess.Popen([sys.executable, "-m", "serve.api", "--model", str(toy), "--tensor-parallel-size", "2",
                               "--port", "0", "--served-model-name", "toy", "--dtype", "float64"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = next(line.split(" on ", 1)[1].split()[0] for line in server.stdout if line.startswith("serving "))
        manager = TaskManager(include_path=str(tmp_path / "tasks"))
        api = lm_eval.simple_evaluate(
            model="local-completions", tasks=tasks, task_manager=manager, batch_size=1,
            model_args=f"model=toy,base_url={url}/completions,tokenizer={toy},tokenizer_backend=huggingface,"
                       f"max_length={context},max_retries=1")
    finally:
        server.terminate()
        server.wait(30)
    hf = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={toy},dtype=float64,max_length={context}",
                                 tasks=tasks, task_manager=manager, batch_size=4, device="cpu")
    for task, metric in (("tpref_stdlib_mc", "acc,none"), ("tpref_stdlib_ppl", "word_perplexity,none"),
                         ("tpref_stdlib_ppl", "bits_per_byte,none")):
        assert api["results"][task][metric] == pytest.approx(hf["results"][task][metric], rel=1e-9), (task, metric)
