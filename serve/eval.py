"""Perplexity of a model over a text, through LLM (prompt logprobs under the vocab-parallel head):

    python -m serve.eval --model models/stdlib --file held_out.py [--window 256] [--stride 128]
                         [--tensor-parallel-size 2] [engine flags as python -m serve]
    python -m serve.eval --write-lm-eval-tasks DIR     # lm-evaluation-harness tasks over held-out code (docs/eval.md)

The text is encoded whole and scored in windows of `window` tokens that start every `stride` tokens (Hugging Face's
sliding-window perplexity): the first window scores all its tokens but its first, each later window only the tokens
the windows before it did not reach, each with up to window - stride tokens of context before it. Every token but
the text's first is scored once. Prints the tokens scored, the mean negative log-likelihood in nats per token and the
perplexity (exp of it); `perplexity(llm, ids, window, stride)` is the function the benchmarks call.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

from serve.sampling_params import SamplingParams


@dataclass(frozen=True)
class Perplexity:
    tokens: int  # tokens scored (the text's, less its first)
    nll: float  # mean negative log-likelihood, nats per token
    windows: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll)


def windows(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first scored position) of each window over n tokens: [start, end) goes to the model, positions
    first..end - 1 are scored (each position once, every one but 0)."""
    if window < 2 or not 1 <= stride < window:
        raise ValueError(f"window={window}, stride={stride}: need window >= 2 and 1 <= stride < window (each window "
                         f"overlaps the one before, so its first scored token has context)")
    out, scored = [], 1
    for start in range(0, max(n - 1, 1), stride):
        end = min(start + window, n)
        if end > scored:
            out.append((start, end, scored))
            scored = end
        if end == n:
            break
    return out


def perplexity(llm, ids: list[int], window: int | None = None, stride: int | None = None) -> Perplexity:
    """ids' perplexity under llm (LLM): windows of `window` tokens (default: the model's context) every `stride`
    (default: half a window), all windows in one generate call, each scored by its prompt logprobs."""
    window = window or llm.max_model_len
    stride = stride or max(window // 2, 1)
    if window > llm.max_model_len:
        raise ValueError(f"window={window} is longer than the model's context ({llm.max_model_len} positions)")
    if len(ids) < 2:
        raise ValueError(f"the text has {len(ids)} token(s): perplexity needs at least 2")
    spans = windows(len(ids), window, stride)
    # one generated token each (the engine's least); the prompt's scores are what counts
    outs = llm.generate([ids[s:e] for s, e, _ in spans], SamplingParams(max_tokens=1, temperature=0,
                                                                        prompt_logprobs=0, ignore_eos=True))
    total, count = 0.0, 0
    for (start, end, first), out in zip(spans, outs):
        for pos in range(first, end):
            total -= out.prompt_logprobs[pos - start][ids[pos]]
            count += 1
    return Perplexity(count, total / count, len(spans))


MC_TASK = """task: tpref_stdlib_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
ROLLING_TASK = """task: tpref_stdlib_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""


def write_lm_eval_tasks(directory, count: int = 40, held_out: float = 0.05) -> list[str]:
    """Two lm-evaluation-harness tasks over held-out standard-library code (train/data.py's split: the files the
    trained model never saw), written to `directory` as lm-eval YAML and JSON lines (no download):

        tpref_stdlib_mc    multiple choice: a function's lines up to a line at least its third, then the real next
                           line against the next lines of three other functions at the same depth (acc)
        tpref_stdlib_ppl   rolling log-likelihood of `count` held-out functions (word and byte perplexity, bits
                           per byte)

    Run them with `lm_eval --include_path DIRECTORY --tasks tpref_stdlib_mc,tpref_stdlib_ppl`. Returns the task
    names."""
    import ast
    import json
    import random
    from pathlib import Path

    from train.data import corpus_files, read, split

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    _, held = split(corpus_files("stdlib"), held_out)
    functions = []
    for text in read(held):
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines(keepends=True)
        functions += ["".join(lines[n.lineno - 1:n.end_lineno]) for n in tree.body
                      if isinstance(n, ast.FunctionDef) and 6 <= n.end_lineno - n.lineno + 1 <= 30
                      and len("".join(lines[n.lineno - 1:n.end_lineno])) <= 600]  # one window of 256 tokens
    rng = random.Random(0)
    rng.shuffle(functions)
    picked = functions[:count]
    docs = []
    for i, src in enumerate(picked):
        lines = src.splitlines(keepends=True)
        cut = rng.randrange(max(len(lines) // 3, 1), len(lines))
        others = [f.splitlines(keepends=True) for j, f in enumerate(picked) if j != i]
        distractors = [o[min(cut, len(o) - 1)] for o in rng.sample(others, 3)]
        choices = [lines[cut]] + [d for d in distractors if d != lines[cut]][:3]
        order = list(range(len(choices)))
        rng.shuffle(order)
        docs.append({"context": "".join(lines[:cut]), "choices": [choices[k] for k in order], "gold": order.index(0)})
    (out / "stdlib_mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (out / "stdlib_ppl.jsonl").write_text("".join(json.dumps({"text": f}) + "\n" for f in picked))
    (out / "tpref_stdlib_mc.yaml").write_text(MC_TASK.format(data=(out / "stdlib_mc.jsonl").resolve()))
    (out / "tpref_stdlib_ppl.yaml").write_text(ROLLING_TASK.format(data=(out / "stdlib_ppl.jsonl").resolve()))
    return ["tpref_stdlib_mc", "tpref_stdlib_ppl"]


def main(argv: list[str] | None = None) -> int:
    from serve.config import FlagParser, add_engine_flags, add_llm_flags, engine_from_flags, flag_names, llm_settings

    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--write-lm-eval-tasks"]:  # no model: the task files alone
        if len(argv) != 2:
            print("error: --write-lm-eval-tasks DIR (and nothing else)", file=sys.stderr)
            return 2
        names = write_lm_eval_tasks(argv[1])
        print(f"wrote {', '.join(names)} to {argv[1]}: lm_eval --include_path {argv[1]} --tasks {','.join(names)}")
        return 0
    ap = FlagParser(prog="python -m serve.eval", description="A model's perplexity over a text file (or, with "
                    "--write-lm-eval-tasks DIR alone, lm-evaluation-harness tasks over held-out code).")
    add_llm_flags(ap, "a save_pretrained directory with a tokenizer")
    ap.add_argument("--file", required=True, help="the text to score (UTF-8)")
    ap.add_argument("--window", type=int, default=None, help="tokens per window (default: the model's context)")
    ap.add_argument("--stride", type=int, default=None, help="tokens between window starts (default: window / 2)")
    add_engine_flags(ap)
    args = ap.parse_args(argv)
    from serve import LLM
    from serve.llm import check_model_exists, has_tokenizer

    try:
        config = engine_from_flags(args)
        check_model_exists(args.model, "--model ")
        if not has_tokenizer(args.model, args.tokenizer):
            raise ValueError(f"--model {args.model}: no tokenizer to encode the text with (pass --tokenizer DIR)")
        try:
            with open(args.file, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise ValueError(f"--file {args.file!r}: {exc.strerror}") from None
        with LLM(args.model, **llm_settings(args, config)) as llm:
            ids = llm.tokenizer(text, add_special_tokens=False)["input_ids"]
            result = perplexity(llm, ids, args.window, args.stride)
    except ValueError as exc:
        print(f"error: {flag_names(str(exc))}", file=sys.stderr)
        return 2
    print(f"{result.tokens} tokens in {result.windows} windows: {result.nll:.4f} nats/token, "
          f"perplexity {result.perplexity:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
