"""Run the quick commands the README and docs/ show, and set each one's verdict beside the page (make docs-check).

    .venv/bin/python launch/docs_check.py [--timeout 60] [--only PAGE]

Every `.venv/bin/torchrun ... launch/*.py ...` and `.venv/bin/python -m serve ...` command of the pages
(tests/test_docs.py finds them and checks their settings and flags without running them) runs here as written, in a
scratch run directory, unless it names a placeholder (DIR, /path/to/..., P, D) or runs past --timeout seconds. Its
verdict is its last PASS/FAIL line (the pages' text model, /tmp/toy, is written first with python -m
serve.toy_model when it is not there), or its one-line error; "on page" says whether the page shows that same line
(numbers that vary from run to run, such as times, are not compared: only the line's words up to its first digit).
Exit 1 if a command fails and its page does not show that failure. Slow (every command starts its ranks): run it
before a change to the docs lands, not in CI.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from launch.gpu_check import bounded  # noqa: E402
from tests.test_docs import documented_commands  # noqa: E402

TOY = "/tmp/toy"  # the pages' text model: python -m serve.toy_model /tmp/toy
PLACEHOLDER = re.compile(r"DIR|/path/to|=P\b|=D\b|\.\.\.|<|>")
RUNNABLE = ("launch/run_block.py", "launch/serve.py", "serve/__main__.py")


def verdict(rc: int, stdout: str, stderr: str) -> str:
    lines = [ln for ln in stdout.splitlines() if ln.startswith(("PASS", "FAIL"))]
    if lines:
        return lines[-1]
    errors = [ln for ln in stderr.splitlines() if "error: " in ln]
    if errors:
        return errors[0][errors[0].index("error: "):]
    tail = (stdout.strip().splitlines() or ["(no output)"])[-1]
    return f"exit {rc}: {tail[:100]}"  # python -m serve prints the completion and exits 0


def shown(line: str, page: str) -> bool:
    """The page shows the verdict: its words up to the first digit (times and counts vary between runs)."""
    stem = re.split(r"\d", line, maxsplit=1)[0].strip()
    return bool(stem) and stem in (ROOT / page).read_text()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--only", help="one page, e.g. docs/serving.md")
    args = ap.parse_args()
    failed = 0
    rows = []
    for where, script, rest, raw in documented_commands(with_raw=True):
        page = where.split(":")[0]
        if script not in RUNNABLE or (args.only and page != args.only) or (script == "serve/__main__.py" and not rest):
            continue  # not runnable here, another page, or a mention of the command rather than a command
        if PLACEHOLDER.search(" ".join(rest)):
            rows.append((where, "skipped (a placeholder to fill in)", ""))
            continue
        if TOY in rest and not os.path.isdir(TOY):
            subprocess.run([str(ROOT / ".venv/bin/python"), "-m", "serve.toy_model", TOY], cwd=ROOT, check=True)
        with tempfile.TemporaryDirectory() as run_dir:
            if script == "serve/__main__.py":
                argv = [str(ROOT / ".venv/bin/python"), "-m", "serve", *rest]
            else:
                torchrun = [a for a in raw if a.startswith("--")]
                argv = [str(ROOT / ".venv/bin/torchrun"), *torchrun, script, *rest, f"hydra.run.dir={run_dir}"]
                if "--standalone" not in torchrun:
                    argv.insert(1, "--standalone")
            start = time.monotonic()
            rc, out, err = bounded(argv, args.timeout, stderr=subprocess.PIPE)
            if rc is None:
                rows.append((where, f"skipped (over {args.timeout:g} s)", ""))
                print(f"{where}: {rows[-1][1]}", flush=True)
                continue
        line = verdict(rc, out, err)
        on_page = shown(line, page)
        if rc != 0 and not on_page:
            failed += 1
        rows.append((where, f"{line}  [{time.monotonic() - start:.0f} s]", "on page" if on_page else
                     ("NOT ON PAGE" if rc else "")))
        print(f"{rows[-1][0]}: {rows[-1][1]} {rows[-1][2]}", flush=True)
    print(f"\n{len(rows)} documented commands; {sum('skipped' in r[1] for r in rows)} skipped; {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
