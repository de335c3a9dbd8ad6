"""The rank processes behind `LLM`: started, watched, called and stopped (vLLM's MultiprocExecutor, in our size).

The driver starts world = tp · pp processes itself (no torchrun) running serve/worker.py; they meet in a file store
under a private directory and rank 0 connects back over an authenticated Unix socket. Every call goes to rank 0 and
waits for its reply while watching every process: a rank that failed (its traceback in error-RANK.txt) or died makes
the call raise RuntimeError within a second, naming the rank, and every rank is stopped. Ranks never outlive the
driver: a finalizer stops them when the driver's object goes away, and a rank whose driver is gone exits.

The ranks run in their own process group, so a terminal's Ctrl-C (SIGINT to the foreground group) reaches the
driver alone: a server drains as on SIGTERM, and a script's KeyboardInterrupt, wherever the driver waits, stops
every rank at once (killed: nothing they were doing is worth finishing, and they print nothing) and goes on up to
the caller.
"""

from __future__ import annotations

import os
import pickle
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from multiprocessing.connection import Listener
from pathlib import Path

from serve.worker import AUTHKEY_ENV, RankSpec

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 600.0  # building the ranks (imports, weights) may take long on a laptop; a dead rank is seen at once


class MultiprocExecutor:
    def __init__(self, spec: RankSpec, world_size: int, gpus: str | None = None):
        """Start world_size rank processes for spec and wait until rank 0 has built its engine (RuntimeError naming
        the rank if one fails first). info: rank 0's start reply (backend, device). gpus: the GPUs these ranks may
        see (CUDA_VISIBLE_DEVICES: a data-parallel replica's own; rank r takes the r-th), None: the process's."""
        self.procs: list[subprocess.Popen] = []
        self.closed = False
        self.dir = tempfile.mkdtemp(prefix="tpref-llm-")
        with open(os.path.join(self.dir, "spec.pkl"), "wb") as f:
            pickle.dump(spec, f)
        key = secrets.token_bytes(16)
        listener = Listener(os.path.join(self.dir, "driver.sock"), "AF_UNIX", authkey=key)
        env = dict(os.environ, **{AUTHKEY_ENV: key.hex()})
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [v for v in [env.get("PYTHONPATH")] if v])
        env["OMP_NUM_THREADS"] = str(spec.threads)  # before torch loads: OpenMP sizes its pool once
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus
        self.conn = None
        self._link: dict = {}  # what the finalizer needs (not self: that would keep this object alive)
        self._finalizer = weakref.finalize(self, MultiprocExecutor._stop, self.procs, self._link, self.dir)
        try:
            for rank in range(world_size):
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-c", "from serve.worker import main; main()",
                     "--rank", str(rank), "--world-size", str(world_size), "--dir", self.dir],
                    env=env if rank == 0 else {k: v for k, v in env.items() if k != AUTHKEY_ENV}, cwd=ROOT,
                    start_new_session=True))  # their own process group: a terminal's SIGINT is the driver's alone
        except BaseException:  # interrupted (or out of processes) half-way: the ranks started so far go too
            listener.close()
            self.kill()
            raise
        accepted: list = []
        accepting = threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True)
        accepting.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while accepting.is_alive():
                accepting.join(0.05)
                self.check("start", deadline)
        except KeyboardInterrupt:
            self.kill()
            raise
        finally:
            listener.close()
        self.conn = self._link["conn"] = accepted[0]
        self.info = self.wait("start", deadline)[1]

    def exited(self) -> list[tuple[int, int]]:
        """(rank, exit code) of every rank process that has exited (any thread may ask: nothing is sent)."""
        return [(r, proc.returncode) for r, proc in enumerate(self.procs) if proc.poll() is not None]

    def check(self, what: str, deadline: float | None = None) -> None:
        """RuntimeError (every rank stopped) if a rank has exited, or the deadline has passed."""
        if self.closed:
            raise RuntimeError("this LLM is shut down")
        dead = self.exited()
        if dead or (deadline is not None and time.monotonic() > deadline):
            self._fail(what, dead)

    def call(self, op: str, *args):
        """op on rank 0, and its answer."""
        self.check(op)  # a rank that died while we were away: say so now, not after a call that hangs
        self.conn.send((op, args))
        return self.wait(op)[1]

    def send(self, op: str, *args) -> None:
        """op to rank 0 without waiting for an answer (it sends none, or its answers are read with wait())."""
        self.conn.send((op, args))

    def poll(self, what: str, timeout: float) -> bool:
        """Whether rank 0 has sent something within timeout seconds; RuntimeError if a rank died meanwhile."""
        end = time.monotonic() + timeout
        try:
            while not self.conn.poll(max(0.0, min(0.05, end - time.monotonic()))):
                self.check(what)
                if time.monotonic() >= end:
                    return False
        except KeyboardInterrupt:
            self.kill()
            raise
        return True

    def wait(self, what: str, deadline: float | None = None):
        """Rank 0's next message (kind, value); its ValueError raised here; RuntimeError at once if a rank failed.
        KeyboardInterrupt while waiting: every rank is killed, and it goes on up."""
        try:
            while not self.conn.poll(0.05):
                self.check(what, deadline)
            kind, value = self.conn.recv()
        except KeyboardInterrupt:
            self.kill()
            raise
        except (EOFError, OSError):  # rank 0 gone mid-message (a reset pipe is an OSError)
            self._fail(what, [(0, self.procs[0].poll())])
        if kind == "ValueError":
            raise ValueError(value)
        return kind, value

    def _fail(self, what: str, dead: list) -> None:
        time.sleep(0.2)  # a failing rank writes its traceback before it exits; a killed one is reaped meanwhile
        dead = [(r, proc.returncode) for r, proc in enumerate(self.procs) if proc.poll() is not None]
        errors = []
        for r in range(len(self.procs)):
            f = Path(self.dir) / f"error-{r}.txt"
            if f.is_file():
                errors.append((r, f.read_text()))
        self.shutdown()
        reported = {rank for rank, _ in errors}
        silent = [f"rank {r} exited (code {code}) without a Python error" for r, code in dead if r not in reported]
        if silent or errors:  # a rank killed from outside first: it is the cause, the others' errors follow from it
            raise RuntimeError(f"{what}: " + "; ".join(silent + [f"rank {r} failed: {text}" for r, text in errors])
                               + "; every rank is stopped")
        raise RuntimeError(f"{what}: no answer from rank 0; every rank is stopped")

    def shutdown(self) -> None:
        """Stop every rank (harmless when called again)."""
        if not self.closed:
            self.closed = True
            self._finalizer()

    def kill(self) -> None:
        """Stop every rank now, without asking rank 0 (the caller was interrupted mid-call: the pipe may hold a
        half-read answer, and rank 0 may be mid-step)."""
        conn = self._link.pop("conn", None)
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        self.shutdown()
        if conn is not None:
            conn.close()

    @staticmethod
    def _stop(procs, link, directory) -> None:
        conn = link.get("conn")
        try:
            if conn is not None and procs and procs[0].poll() is None:
                conn.send(("shutdown", ()))
        except (OSError, ValueError):
            pass
        end = time.monotonic() + 10
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if conn is not None:
            conn.close()
        shutil.rmtree(directory, ignore_errors=True)
