"""Running the launchers from tests: under torchrun, as a lone rank's process, or a lone rank's settings phase in
this process.

A bad setting must fail on every rank before any collective. The launchers validate in one function
(launch.settings.start: parse the settings, and only then join the group), so the rule is checked at three depths:
a few settings under torchrun (every rank prints, the job exits non-zero, fast), a few as the last rank's own
process with nobody to meet (the entry point exits 2), and every other one through `settings_phase`: the same
start() a rank runs, in this process, with joining the group replaced by a failure. That last form costs
milliseconds instead of the seconds a Python process importing torch costs.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CONFIG_NAME = {"run_block.py": "config", "serve.py": "serve", "train.py": "train"}


def torchrun(nproc: int, *overrides: str, run_dir: Path, timeout: float = 240, script: str = "run_block.py"):
    """launch/<script> under torchrun on nproc ranks: (CompletedProcess, seconds). A hung run is killed, every rank
    with it, and fails the test."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "launch" / script), f"hydra.run.dir={run_dir}", *overrides]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and every rank it started
        stdout, stderr = proc.communicate()
        pytest.fail(f"launcher hung for {timeout}s:\n{stdout}\n{stderr}")
    # An orderly end on every rank: the process group's threads joined before interpreter teardown (a rank whose
    # group outlives shutdown() says so; left to teardown it can abort after the run passed)
    assert "outlived shutdown" not in stderr and "terminate called" not in stderr, stderr[-3000:]
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr), time.monotonic() - start


def _lone_env(world: int) -> dict[str, str]:
    """The last rank of a `world`-rank job, with a rendezvous address nobody listens on."""
    last = str(world - 1)
    return dict(RANK=last, LOCAL_RANK=last, WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1", MASTER_PORT="1")


def lone_rank_process(run_dir, overrides, world: int = 2, script: str = "serve.py") -> subprocess.CompletedProcess:
    """The last rank of a `world`-rank job started alone as its own process: settings are validated before anyone
    is met, so a bad one exits 2 at once instead of waiting at the rendezvous."""
    return subprocess.run([sys.executable, str(ROOT / "launch" / script), f"hydra.run.dir={run_dir}", *overrides],
                          cwd=ROOT, env=dict(os.environ, **_lone_env(world)), capture_output=True, text=True,
                          timeout=60)


class JoinedTheGroup(AssertionError):
    """The settings passed validation: a lone rank would now wait for the others."""


def _compose(script: str, overrides: list[str], run_dir: str | None):
    """The launcher's config as hydra.main would build it (the preset chosen, what the command line set, the run
    directory, made as hydra.main makes it), installed as the current HydraConfig; returns the job's config.
    run_dir None: "." and nothing made (a settings phase that fails writes nothing)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(CONFIG_NAME[script], overrides=overrides, return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = run_dir or "."
    if run_dir is not None:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


@contextlib.contextmanager
def _as_rank(env: dict[str, str], replace: str, by, out: io.StringIO, err: io.StringIO):
    """Inside: the rank's environment, launch.settings.<replace> replaced by `by`, stdout and stderr captured.
    Everything is put back afterwards, the HydraConfig cleared."""
    from hydra.core.hydra_config import HydraConfig

    import launch.settings as settings

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    real = getattr(settings, replace)
    setattr(settings, replace, by)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            yield
    finally:
        HydraConfig.instance().cfg = None
        setattr(settings, replace, real)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def settings_phase(overrides, world: int = 2, script: str = "serve.py") -> subprocess.CompletedProcess:
    """What the last rank of a `world`-rank job does before it joins the group, run in this process: the launcher's
    own preset check and launch.settings.launch (parse the settings; a bad one prints `[rank r] error: ...` and
    returns 2). Returns a CompletedProcess with that exit code and what was printed. Settings that pass validation
    raise JoinedTheGroup (the point where a real rank would start meeting the others)."""
    import launch.settings as settings

    module = importlib.import_module(f"launch.{Path(script).stem}")
    overrides = list(overrides)

    def join(*args, **kwargs):
        raise JoinedTheGroup(f"{script} {' '.join(overrides)}: the settings passed validation")

    out, err = io.StringIO(), io.StringIO()
    with _as_rank(_lone_env(world), "init_from_env", join, out, err):
        try:
            settings.refuse_bad_arguments([script, *overrides], world - 1, CONFIG_NAME[script])
            code = settings.launch(_compose(script, overrides, None), module.parse_settings, join)
        except SystemExit as exc:
            code = exc.code
    return subprocess.CompletedProcess([script, *overrides], code, out.getvalue(), err.getvalue())


# ---- a launcher on a pool of ranks ---------------------------------------------------------------------------------


def _launcher_on_rank(ctx, script: str, overrides: list[str], run_dir: str) -> tuple[int, str, str]:
    """One rank of `script`'s whole run, on a pool rank whose process group already exists (tests/harness.py):
    init_from_env finds it and describes it, and the launcher's final shutdown leaves it for the next task."""
    module = importlib.import_module(f"launch.{Path(script).stem}")
    env = dict(RANK=str(ctx.rank), LOCAL_RANK=str(ctx.rank), WORLD_SIZE=str(ctx.world_size),
               LOCAL_WORLD_SIZE=str(ctx.world_size))
    out, err = io.StringIO(), io.StringIO()
    with _as_rank(env, "shutdown", lambda: None, out, err):
        try:
            code = module.run(_compose(script, overrides, run_dir))
        except SystemExit as exc:
            code = exc.code
    return code, out.getvalue(), err.getvalue()


def launch_on_pool(nproc: int, *overrides: str, run_dir: Path, script: str = "run_block.py", timeout: float = 240):
    """launch/<script> on a pool of nproc gloo ranks in this pytest session, as under torchrun but without starting
    nproc Python processes that import torch (seconds each on two cores): (CompletedProcess, seconds). returncode:
    the first non-zero rank's exit code (else 0); stdout and stderr: every rank's, in rank order. The real
    torchrun path (environment, hydra.main, exit codes, .hydra/ records) keeps its own tests (torchrun above)."""
    from tests.harness import run_ranks

    start = time.monotonic()
    ranks = run_ranks(nproc, _launcher_on_rank, script, list(overrides), str(run_dir), timeout=timeout)
    code = next((c for c, _, _ in ranks if c), 0)
    return subprocess.CompletedProcess([script, *overrides], code, "".join(o for _, o, _ in ranks),
                                       "".join(e for _, _, e in ranks)), time.monotonic() - start


def refused(overrides, message: str, world: int = 2, script: str = "serve.py") -> subprocess.CompletedProcess:
    """Bad settings, as every rank meets them before any collective (the last rank's settings phase, above): exit code
    2 and one line, `[rank world-1] error: ...`, that holds `message`."""
    proc = settings_phase(overrides, world, script)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"[rank {world - 1}] error: ") and message in lines[0], lines
    return proc
