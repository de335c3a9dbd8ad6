"""The commands the README and docs/ show, checked against the code without running them: every launcher command's
settings compose into the launcher's config (Hydra, and the launcher's own check of the command line), and every
flag given to a script exists in that script's argument parser. A renamed setting or flag fails here, not in a
newcomer's terminal. (make docs-check runs the quick commands themselves.)"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LAUNCHERS = {"launch/run_block.py": "config", "launch/serve.py": "serve"}
COMMAND = re.compile(r"\.venv/bin/(torchrun|python)\s+([^`#\n]*)")


def documented_commands(with_raw: bool = False) -> list[tuple]:
    """(page:line, script or module, its arguments) for every `.venv/bin/torchrun ...` and `.venv/bin/python ...`
    in the pages, in code blocks or inline; a line ending in a backslash continues on the next. with_raw: each also
    with the whole command line as written (launch/docs_check.py runs it)."""
    out = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        for n, line in enumerate(lines):
            for m in COMMAND.finditer(line):
                if "#" in line[:m.start()]:  # inside a comment ("make serve  # = ..."): prose
                    continue
                text, k = m.group(2).rstrip(), n
                while text.endswith("\\") and k + 1 < len(lines):
                    k += 1
                    text = text[:-1] + " " + lines[k].split("#")[0].strip()
                try:
                    argv = raw = shlex.split(text)
                except ValueError:  # an unbalanced quote inside prose: not a command
                    continue
                if m.group(1) == "torchrun":
                    argv = [a for a in argv if not a.startswith("--")] if argv else argv
                    script = next((a for a in argv if a.endswith(".py")), None)
                    args = argv[argv.index(script) + 1:] if script else []
                elif argv[:1] == ["-m"]:
                    script, args = f"{argv[1].replace('.', '/')}/__main__.py", argv[2:]
                elif argv and argv[0].endswith(".py"):
                    script, args = argv[0], argv[1:]
                else:
                    continue
                if script is not None:
                    out.append((f"{page.relative_to(ROOT)}:{n + 1}", script, args) + ((raw,) if with_raw else ()))
    return out


COMMANDS = documented_commands()


def test_the_pages_show_commands():
    """The parser can fail: it finds the commands the pages are known to show."""
    scripts = {script for _, script, _ in COMMANDS}
    assert {"launch/run_block.py", "launch/serve.py", "serve/__main__.py", "serve/api/__main__.py",
            "benchmarks/bench_llm.py"} <= scripts
    assert len(COMMANDS) >= 40


def test_every_documented_flag_exists():
    """Each --flag a page gives a script (python -m serve, python -m serve.api, benchmarks/*.py, ...) is one its
    parser declares: a string literal of the script, or an engine flag (serve/config.py FLAGS), one of LLM's
    (LLM_FLAGS) or a TrainSettings field's (python -m train) where it adds them."""
    from serve.config import FLAGS, LLM_FLAGS
    from train.settings import FIELDS as TRAIN_FIELDS

    bad = []
    for where, script, args in COMMANDS:
        path = ROOT / script
        if script in LAUNCHERS or not path.is_file():
            continue
        source = path.read_text()
        known = set(re.findall(r"[\"'](--[\w-]+)[\"']", source))
        if "add_engine_flags(" in source:
            known |= set(FLAGS) | {"--no-enable-prefix-caching", "--num-gpu-blocks"}
        if "add_llm_flags(" in source:
            known |= {flag for flag, _, _ in LLM_FLAGS} | {"--model"}
        if "from train.settings import" in source and "add_flags(" in source:  # python -m train: TrainSettings'
            known |= {"--" + name.replace("_", "-") for name in TRAIN_FIELDS} | {"--no-resume"}
        bad += [f"{where}: {script} {a}" for a in args if a.startswith("--") and a.split("=")[0] not in known]
    assert not bad, "\n".join(bad)


PLACEHOLDER = re.compile(r"DIR|/path/to|=P\b|=D\b|\.\.\.")


def test_every_documented_launcher_command_passes_the_settings_phase():
    """Each launcher command's settings exist (Hydra composes them after the launcher's own argument check), and
    where it names no placeholder, the settings phase of its last rank passes at the page's rank count (in process,
    tests/launching.py: everything a rank checks before it meets the others, e.g. heads that split over p)."""
    from hydra import compose, initialize_config_dir

    import launch.serve  # noqa: F401 (registers the engine defaults conf/serve.yaml names)
    from launch.settings import refuse_bad_arguments
    from tests.launching import JoinedTheGroup, settings_phase

    bad = []
    for where, script, args, raw in documented_commands(with_raw=True):
        if script not in LAUNCHERS:
            continue
        overrides = [a for a in args if "=" in a]
        nproc = next((int(a.split("=")[1]) for a in raw if re.fullmatch(r"--nproc_per_node=\d+", a)), 1)
        try:
            if PLACEHOLDER.search(" ".join(overrides)):  # a value to fill in: the settings must still exist
                refuse_bad_arguments([script, *overrides], 0, LAUNCHERS[script])
                with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
                    compose(LAUNCHERS[script], overrides=overrides)
                continue
            proc = settings_phase(overrides, world=nproc, script=Path(script).name)
        except JoinedTheGroup:  # the settings passed: a real rank would now meet the others
            continue
        except SystemExit:
            bad.append(f"{where}: {script} {' '.join(overrides)} (refused by the launcher)")
            continue
        except Exception as exc:  # Hydra: no such key, or a malformed override
            bad.append(f"{where}: {script} {' '.join(overrides)} ({str(exc).splitlines()[0]})")
            continue
        bad.append(f"{where}: {script} {' '.join(overrides)} on {nproc} ranks: {proc.stderr.strip()}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("page", [p.relative_to(ROOT) for p in PAGES], ids=str)
def test_no_page_cites_a_document_the_reader_does_not_have(page):
    text = (ROOT / page).read_text()
    assert not re.search(r"SPEC §|SPEC\.md", text), "cite docs/background.md (or the page that explains it)"


@pytest.mark.parametrize("config,page", [("config", "docs/block.md"), ("serve", "docs/serving.md")])
def test_each_launcher_page_names_every_setting(config, page):
    """Every setting of a launcher's config (its top-level keys; pd.* and model.* as groups) is named, in backticks,
    on the page that documents the launcher: a new setting without a word there fails."""
    from launch.settings import known_settings

    import launch.serve  # noqa: F401 (the engine defaults conf/serve.yaml takes from EngineConfig)

    text = (ROOT / page).read_text()
    named = set(re.findall(r"`([\w.]+)(?:[=`\s(])", text)) | {k.split(".")[0] + ".*" for k in
                                                             re.findall(r"`(\w+)\.\*`", text)}
    keys = {k for k in known_settings(config) if "." not in k}
    missing = sorted(k for k in keys if k not in named and f"{k}.*" not in named)
    assert not missing, f"{page} does not name {missing}"


def test_the_server_page_names_every_engine_flag():
    """The engine's flags are derived from EngineConfig's fields (serve/config.py setting): a new one is described
    once, there, and docs/server.md's table names every one of them."""
    from serve.config import FLAGS

    text = (ROOT / "docs" / "server.md").read_text()
    missing = [flag for flag in FLAGS if f"`{flag}`" not in text]
    assert not missing, f"docs/server.md does not name {missing}"
