"""lm-evaluation-harness tasks over the held-out part of the training corpus (docs/eval.md):

    python -m train.eval_tasks DIR      # then: lm_eval --include_path DIR --tasks tpref_stdlib_mc,tpref_stdlib_ppl

The held-out files are train/data.py's split: code the trained model never saw.
"""

from __future__ import annotations

import ast
import json
import random
import sys
from pathlib import Path

from train.data import corpus_files, read, split

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
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: python -m train.eval_tasks DIR (lm-evaluation-harness tasks over held-out code)", file=sys.stderr)
        return 2
    names = write_lm_eval_tasks(argv[0])
    print(f"wrote {', '.join(names)} to {argv[0]}: lm_eval --include_path {argv[0]} --tasks {','.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
