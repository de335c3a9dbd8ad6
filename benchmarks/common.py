"""What the benchmark scripts share: their command lines, random prompts, JSON output, markdown tables, runs timed in
turn, the LLM's timed generate, and docs/benchmarks.md rewritten section by section."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = Path("outputs")


def parse_args(doc: str, flags: dict, argv=None) -> argparse.Namespace:
    """The script's command line, its docstring as the help. `flags` maps each --flag to its default, which gives its
    type (a list: one or more values of its first item's type; False: a switch), or to add_argument's keywords where
    a default cannot say all (a help text, choices, a None default)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, spec in flags.items():
        if isinstance(spec, dict):
            ap.add_argument(flag, **spec)
        elif spec is False:
            ap.add_argument(flag, action="store_true")
        elif isinstance(spec, list):
            ap.add_argument(flag, nargs="+", type=type(spec[0]), default=spec)
        else:
            ap.add_argument(flag, type=type(spec), default=spec)
    return ap.parse_args(argv)


def random_prompts(lengths: list[int], seed: int, vocab: int = 50257) -> list[list[int]]:
    """Prompts of these lengths, token ids uniform in [0, vocab) (GPT-2's by default) from one seeded generator."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def write_json(path, data) -> Path:
    """data as JSON at path (its folder made first), and a line saying where."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    print(f"wrote {path}")
    return path


def save_figure(fig, name: str) -> Path:
    """fig laid out and written to outputs/<name>, and the same bytes to docs/<name> (the page shows the last run's)."""
    path = ROOT / "outputs" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    (ROOT / "docs" / name).write_bytes(path.read_bytes())
    return path


def load_json(name: str, out: Path = OUT):
    """outputs/<name>'s data, or None where the benchmark left none."""
    path = out / name
    return json.loads(path.read_text()) if path.exists() else None


def table(header: list[str], rows) -> list[str]:
    """A markdown table: the header, its rule, then a line per row of cells (an empty cell is one space wide)."""
    def line(cells) -> str:
        return "|" + "".join(f" {cell} |" if cell != "" else " |" for cell in cells)

    return [line(header), "|" + "---|" * len(header)] + [line(cells) for cells in rows]


def print_table(header: list[str], rows) -> None:
    """The markdown table, and a blank line after it."""
    print("\n".join(table(header, rows)) + "\n")


def refuse(message: str) -> int:
    """A command line the script will not run: the reason on stderr, and the exit status 2."""
    print(f"error: {message}", file=sys.stderr)
    return 2


def in_turn(runs: dict, repeats: int) -> dict[str, list]:
    """Each run called `repeats` times, the order reversed every other round (A B, B A, A B, ...) so that the
    machine's drift falls on all alike; each run's results, in the order they came."""
    names, out = list(runs), {name: [] for name in runs}
    for rep in range(repeats):
        for name in (names if rep % 2 == 0 else names[::-1]):
            out[name].append(runs[name]())
    return out


def median_each(results: list[dict]) -> dict:
    """Each key's median over results that share their keys (one run's figures each)."""
    return {key: statistics.median(r[key] for r in results) for key in results[0]}


def median_time(fn, repeats: int, before=None) -> float:
    """fn's median wall time over `repeats` calls after one warm-up call; before() (a barrier) ahead of each."""
    fn()
    samples = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def timed_generate(llm, prompts, params) -> tuple[list[list[int]], float]:
    """Each request's generated token ids from llm.generate, and generate()'s wall time."""
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outs], time.perf_counter() - start


@contextmanager
def attention_labelled():
    """While open, each of the layers' paged_attention calls runs inside torch.profiler's
    record_function("paged_attention"), so that a profile can tell attention's share."""
    import torch

    import layers.attention.attention as attention_module

    inner = attention_module.paged_attention

    def labelled(q, kv, layer):
        with torch.profiler.record_function("paged_attention"):
            return inner(q, kv, layer)

    attention_module.paged_attention = labelled
    try:
        yield
    finally:
        attention_module.paged_attention = inner


def sections(text: str) -> tuple[str, dict[str, str]]:
    """The page's preamble, and each "## " section (its heading line -> its whole text), in order."""
    parts = text.split("\n## ")
    return parts[0], {("## " + p).split("\n", 1)[0]: "## " + p for p in parts[1:]}


def merge(new: str, old: str) -> tuple[str, list[str]]:
    """The sections rendered now replace theirs on the page; a section the page has and this run has no data for
    (its benchmark not run here) stays as it stands, in its place; a section new to the page goes after the one
    rendered before it. Returns the page and the headings kept (a renamed heading's old section is kept too: delete
    it by hand)."""
    head, fresh = sections(new)
    _, before = sections(old)
    order = list(before)
    previous = None
    for h in fresh:
        if h not in order:
            order.insert(order.index(previous) + 1 if previous in order else len(order), h)
        previous = h
    kept = [h for h in before if h not in fresh]
    body = [fresh.get(h) or before[h] for h in order]
    return "\n".join([head.rstrip("\n") + "\n"] + [b.rstrip("\n") + "\n" for b in body]), [h[3:] for h in kept]


def rewrite_sections(lines: list[str], page: Path = Path("docs/benchmarks.md")) -> None:
    """Replace (or append) the sections in `lines` on the page, its preamble and every other section kept."""
    old = page.read_text()
    head, _ = sections(old)
    page.write_text(merge(head.rstrip("\n") + "\n\n" + "\n".join(lines), old)[0])
