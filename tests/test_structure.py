"""The layout's own rules, read off the source: no import circle, the spine's files stay short, every engine default
is written once and every rule is checked in one place (STYLE.md, "The engine's spine")."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import yaml

from serve.config import EngineConfig

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("tp", "layers", "serve", "launch", "benchmarks")


def sources() -> dict[str, Path]:
    """Module name -> file, every non-test source of the project."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(path: Path, known: set[str]) -> set[str]:
    """The project's modules a file imports, at any depth (a function's own imports too), TYPE_CHECKING aside."""
    tree, found = ast.parse(path.read_text()), set()
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [f"{node.module}.{a.name}" for a in node.names] + [node.module] if isinstance(node, ast.ImportFrom) and \
            node.module else []
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def test_no_import_circle():
    files = sources()
    graph = {m: imports(p, set(files)) - {m} for m, p in files.items()}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(n):] + [n]))
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_the_spine_stays_short():
    lines = {f: len((ROOT / f).read_text().splitlines()) for f in ("serve/engine.py", "launch/serve.py")}
    assert lines["serve/engine.py"] < 400 and lines["launch/serve.py"] < 200, lines


def test_each_engine_default_is_written_once():
    """No signature outside serve/config.py gives an EngineConfig field a default of its own (the object is passed
    whole), and conf/serve.yaml states only the engine settings the demo changes."""
    fields = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    again = []
    for module, path in sources().items():
        if module == "serve.config":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                pairs = list(zip(a.args[len(a.args) - len(a.defaults):], a.defaults)) + \
                    [(arg, d) for arg, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
                again += [f"{path.relative_to(ROOT)}:{node.lineno} {node.name}({arg.arg}=...)" for arg, _ in pairs
                          if arg.arg in fields]
    assert not again, again
    demo = yaml.safe_load((ROOT / "conf" / "serve.yaml").read_text())
    same = [k for k, v in demo.items() if k in fields and v == fields[k]]
    assert not same, f"conf/serve.yaml repeats EngineConfig's defaults: {same}"


RULES = {  # one line of each rule's message: it lives in one function
    "the request fits the pool alone": "raise num_gpu_blocks_override to at least",
    "pp divides the world": "must divide the world of",
    "a full decode batch fits the budget": "is smaller than a full decode",
    "chunk_pipelining needs a pipeline": "chunk_pipelining=True is for a pipeline",
    "prefix caching against the pre-paging rule": "shares nothing: set enable_prefix_caching=False",
    "a prompt fits the model's context": "the model's context of {max_seq_len}",
}


def test_each_rule_is_checked_in_one_place():
    for rule, text in RULES.items():
        places = [str(p.relative_to(ROOT)) for p in sources().values() if text in p.read_text()]
        assert len(places) == 1, f"{rule}: written in {places}"
