"""Run a function on p gloo ranks inside one test, and report every rank's failure.

Starting p Python processes that import torch costs seconds, so each world size
gets one pool of ranks that lives for the whole pytest session and runs one task
after another. A task that fails on any rank, or does not finish in time, tears
the pool down (a rank may be stuck in a collective); the next task starts a fresh one.

    def check(ctx, n):            # module level, so it can be pickled by name
        ...                       # ctx: tp.dist.TPContext (group, rank, world_size, device)
        return something_picklable

    results = run_ranks(4, check, 40)   # [result of rank 0, ..., result of rank 3]
"""

from __future__ import annotations

import atexit
import datetime
import os
import queue
import shutil
import tempfile
import traceback

import torch.multiprocessing as mp

_POOLS: dict[tuple[int, str], "RankPool"] = {}


def default_backend() -> str:
    """gloo on the CPU; TPREF_TEST_BACKEND=nccl runs the pools on GPUs, one per rank (tests marked nccl)."""
    return os.environ.get("TPREF_TEST_BACKEND", "gloo")


def _worker(rank: int, world_size: int, store: str, backend: str, tasks, results) -> None:
    import torch
    import torch.distributed as dist

    from tp.dist import context

    torch.set_num_threads(1)
    try:
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
            torch.set_float32_matmul_precision("highest")  # no TF32: the checks are float32 against float32
        dist.init_process_group(
            "cpu:gloo,cuda:nccl" if backend == "nccl" else backend, rank=rank, world_size=world_size,
            init_method=f"file://{store}",
            timeout=datetime.timedelta(seconds=90), device_id=device if backend == "nccl" else None,
        )
        ctx = context(dist.group.WORLD, backend=backend, device=device)
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        return
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(ctx, *args, **kwargs)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    def __init__(self, world_size: int, backend: str = "gloo"):
        self.world_size, self.backend = world_size, backend
        # gloo ranks are forked from this process: they start with torch and every test module already imported
        # (a spawned rank spends seconds importing them, 8 ranks on two cores ~20 s per pool). Each rank runs one
        # intra-op thread (set first thing in _worker), so no OpenMP pool crosses the fork. CUDA cannot be forked:
        # NCCL ranks are spawned.
        spawn = mp.get_context("fork" if backend == "gloo" and os.name == "posix" else "spawn")
        self.results = spawn.Queue()
        self.tasks = [spawn.Queue() for _ in range(world_size)]
        # The ranks meet in a file store (a fresh file per pool): no free port to pick and lose to another job.
        self.store_dir = tempfile.mkdtemp(prefix="tpref-pool-")
        store = os.path.join(self.store_dir, "store")
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        self.procs = [
            spawn.Process(target=_worker, args=(r, world_size, store, backend, self.tasks[r], self.results), daemon=True)
            for r in range(world_size)
        ]
        for proc in self.procs:
            proc.start()

    def run(self, fn, *args, timeout: float = 300.0, **kwargs) -> list:
        for q in self.tasks:
            q.put((fn, args, kwargs))
        got: dict[int, tuple[bool, object]] = {}
        deadline = timeout
        while len(got) < self.world_size:
            try:
                rank, ok, value = self.results.get(timeout=deadline)
            except queue.Empty:
                break
            got[rank] = (ok, value)
            if not ok:
                deadline = 15.0  # the others may be blocked in a collective: give them a moment, no more
        failures = [f"--- rank {r} failed:\n{v}" for r, (ok, v) in sorted(got.items()) if not ok]
        missing = [r for r in range(self.world_size) if r not in got]
        if failures or missing:
            self.close(force=True)
            lines = [f"{fn.__name__} on {self.world_size} ranks:"] + failures
            if missing:
                lines.append(f"--- ranks {missing} did not finish (timeout or stuck in a collective)")
            raise AssertionError("\n".join(lines))
        return [got[r][1] for r in range(self.world_size)]

    def alive(self) -> bool:
        return all(proc.is_alive() for proc in self.procs)

    def close(self, force: bool = False) -> None:
        if not force:
            for q in self.tasks:
                q.put(None)
            for proc in self.procs:
                proc.join(timeout=10)
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        shutil.rmtree(self.store_dir, ignore_errors=True)
        if _POOLS.get((self.world_size, self.backend)) is self:
            del _POOLS[(self.world_size, self.backend)]


def run_ranks(world_size: int, fn, *args, timeout: float = 300.0, backend: str | None = None, **kwargs) -> list:
    """Run fn(ctx, *args, **kwargs) on every rank of a group of `world_size`; return the results by rank.

    backend: gloo (CPU) by default, or TPREF_TEST_BACKEND; with nccl, a test needing more GPUs than there are skips.
    """
    backend = backend or default_backend()
    if backend == "nccl":
        import pytest
        import torch

        if torch.cuda.device_count() < world_size:
            pytest.skip(f"{world_size} ranks on NCCL need {world_size} GPUs, {torch.cuda.device_count()} visible")
    pool = _POOLS.get((world_size, backend))
    if pool is None or not pool.alive():
        if pool is not None:
            pool.close(force=True)
        pool = _POOLS[(world_size, backend)] = RankPool(world_size, backend)
    return pool.run(fn, *args, timeout=timeout, **kwargs)


@atexit.register
def close_all() -> None:
    """End of the session: the ranks hold nothing worth a clean exit, so they are stopped (a clean
    destroy_process_group per rank costs seconds on two cores, 20 s for the session's pools)."""
    for pool in list(_POOLS.values()):
        pool.close(force=True)
