"""Start p ranks from inside one Python process (for sweeps over p); rank 0's return value comes back.

torchrun is the way to run one job at one p; a sweep over several p starts its own
ranks here, with the same backend choice as the launcher (tp.dist.init_from_env).
"""

from __future__ import annotations

import os
import pickle
import tempfile
from pathlib import Path

import torch.multiprocessing as mp


def _entry(rank: int, world_size: int, store: str, backend: str, fn, args, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    import torch

    from tp.dist import init_from_env, shutdown

    torch.set_num_threads(1)
    ctx = init_from_env(backend, init_method=f"file://{store}")
    try:
        result = fn(ctx, *args)
    finally:
        del ctx  # the last reference to the group, so shutdown() ends its threads before teardown
        shutdown()
    if rank == 0:
        Path(out).write_bytes(pickle.dumps(result))


def spawn_ranks(world_size: int, fn, *args, backend: str = "auto"):
    """Run fn(ctx, *args) on `world_size` fresh ranks; return rank 0's result. fn must be importable."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rank0.pkl")
        # The ranks meet in a file store: no port to pick, so nothing to collide with.
        mp.start_processes(_entry, args=(world_size, str(Path(tmp) / "store"), backend, fn, args, out),
                           nprocs=world_size, start_method="spawn")
        return pickle.loads(Path(out).read_bytes())
