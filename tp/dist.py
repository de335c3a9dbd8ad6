"""Process groups and devices: the one place that decides NCCL/GPU vs gloo/CPU.

Everything else in the project receives a `TPContext` (or just its `group`)
and never reads the environment or a global process group itself.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import gc
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

BACKENDS = ("auto", "nccl", "gloo")
DEFAULT_TIMEOUT_S = 120.0  # the longest wait for one collective or hand-over message before it fails
DEVICES = ("auto", "cpu", "cuda")


class ConfigError(ValueError):
    """A bad setting found before any collective; the message says what to change."""


@dataclass(frozen=True)
class TPContext:
    """Who this rank is inside one tensor-parallel group, and where its tensors live."""

    group: dist.ProcessGroup
    rank: int
    world_size: int
    backend: str
    device: torch.device
    is_main: bool = field(init=False)  # rank 0: the one that takes requests and answers

    def __post_init__(self):
        object.__setattr__(self, "is_main", self.rank == 0)


def env_world() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) as torchrun sets them; a plain `python` run is one rank."""
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return rank, local_rank, world_size


def resolve_backend(backend: str, local_world_size: int) -> str:
    """Pick the backend without touching any collective.

    "auto" means NCCL with one GPU per rank when this node has at least as many
    GPUs as local ranks, else gloo on CPU. Asking for NCCL without enough GPUs
    is an error, not a silent fallback.
    """
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        return "nccl" if n_gpus >= local_world_size else "gloo"
    if backend == "nccl" and n_gpus < local_world_size:
        raise ConfigError(f"backend=nccl needs one GPU per rank: {local_world_size} local ranks but {n_gpus} CUDA "
                          f"device(s) visible; use backend=gloo (CPU) or fewer ranks")
    return backend


def resolve_device(device: str, backend: str) -> str:
    """"auto": the GPU under NCCL, the CPU under gloo. device=cuda with gloo puts every rank's tensors on
    a GPU (ranks share the GPUs there are, round robin): CUDA kernels and bf16 on a single-GPU machine."""
    if device not in DEVICES:
        raise ConfigError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
    if backend == "nccl":
        if device == "cpu":
            raise ConfigError("backend=nccl reduces GPU tensors: use device=auto or device=cuda (or backend=gloo)")
        return "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA device is visible; use device=auto or cpu")
    return "cuda" if device == "cuda" else "cpu"


def threads_per_rank(world_size: int, device: str, requested: int | None = None,
                     reserved: int = 1) -> tuple[int, str]:
    """Each rank's intra-op (OpenMP) threads, and why, for a start-up line. A given number wins, then OMP_NUM_THREADS
    from the environment. Else, on a CPU, the cores this process may use (its affinity), one of them left to the
    driver and the rest of the machine (vLLM's reserved CPU), shared among the ranks: one thread each on 2 cores.
    OpenMP's threads spin while they wait for each other, so a rank with a thread on a core something else keeps
    busy runs many times slower (measured: docs/benchmarks.md); one core to spare keeps a default off that cliff.
    On CUDA one each, as vLLM sets for its GPU workers: the host only launches kernels. reserved: the cores left to
    the driver (0 where it only waits for the ranks, as python -m train's does)."""
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise ConfigError(f"threads_per_rank={requested!r} must be a positive integer")
        return requested, "threads_per_rank"
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env), "OMP_NUM_THREADS"
    if device == "cuda":
        return 1, "a GPU per rank"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    kept = {0: "none", 1: "one"}.get(reserved, str(reserved))
    return max(1, (cores - reserved) // world_size), f"{cores} cores, {kept} left to the driver, {world_size} rank" + \
        ("s" if world_size > 1 else "")


def device_for(backend: str, local_rank: int, device: str = "auto") -> torch.device:
    if backend == "nccl":
        return torch.device("cuda", local_rank)  # one GPU per rank
    if resolve_device(device, backend) == "cuda":
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def group_device(group: dist.ProcessGroup) -> torch.device:
    """Where a group's collectives want their tensors: this rank's GPU under NCCL, else the CPU."""
    if "nccl" in str(dist.get_backend(group)):  # "nccl", or a multi-backend "cpu:gloo,cuda:nccl"
        bound = getattr(group, "bound_device_id", None)
        return bound if bound is not None else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_HOST_CONTROL: contextvars.ContextVar[bool] = contextvars.ContextVar("tp_host_control", default=False)


@contextlib.contextmanager
def host_control():
    """Host-side control traffic (the engine's plan agreement): small CPU tensors exchanged over the group's gloo
    backend, so that reading them never waits for a GPU. Marked so that tests counting device waits can tell it
    apart (tests/syncs.py)."""
    token = _HOST_CONTROL.set(True)
    try:
        yield
    finally:
        _HOST_CONTROL.reset(token)


def in_host_control() -> bool:
    return _HOST_CONTROL.get()


def control_device(group: dist.ProcessGroup) -> torch.device:
    """Where control messages live: the CPU whenever the group has a gloo backend (gloo alone, or NCCL's groups,
    created as "cpu:gloo,cuda:nccl" by init_from_env); the GPU only for a group that is NCCL alone."""
    return torch.device("cpu") if "gloo" in str(dist.get_backend(group)) else group_device(group)


def wait_for_stream(device: torch.device) -> None:
    """Wait until this rank's compute stream (the current stream of `device`) has run what was queued on it, e.g.
    before reading a clock. Not torch.cuda.synchronize: that waits for every stream of the device, the NCCL
    point-to-point streams of the prefill/decode hand-over included. Nothing to wait for on the CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def init_from_env(backend: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S, init_method: str | None = None,
                  device: str = "auto") -> TPContext:
    """Join the torchrun job (or a one-rank job when run without torchrun).

    The whole world is one tensor-parallel group: tp = WORLD_SIZE. If a process group
    already exists, the context reports that group's backend and device, not `backend`.
    init_method: where ranks meet (default: torchrun's MASTER_ADDR/MASTER_PORT); a
    "file://..." path cannot collide with another job's port.
    """
    if dist.is_initialized():  # somebody else created the group: describe it as it is, change nothing
        return context(dist.group.WORLD, backend=str(dist.get_backend()), device=group_device(dist.group.WORLD))
    rank, local_rank, world_size = env_world()
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    backend = resolve_backend(backend, local_world_size)
    device = device_for(backend, local_rank, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if init_method is None:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
    # Before the group exists: torch.distributed.nn's functions take group=group.WORLD as a default, evaluated when
    # it is imported; imported later (torch.compile and torch.optim import it) they would hold the world group
    # forever, its threads would outlive shutdown() and it would wait its 5 s for them at every exit.
    import torch.distributed.nn  # noqa: F401
    # Under NCCL every group also gets a gloo backend for CPU tensors (the engine's per-iteration plan agreement,
    # object exchanges): control messages go host to host and never wait for a GPU stream.
    dist.init_process_group(backend="cpu:gloo,cuda:nccl" if backend == "nccl" else backend, init_method=init_method,
                            rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s),
                            device_id=device if backend == "nccl" else None)
    return context(dist.group.WORLD, backend=backend, device=device)


def context(group: dist.ProcessGroup, backend: str, device: torch.device) -> TPContext:
    return TPContext(group=group, rank=dist.get_rank(group), world_size=dist.get_world_size(group), backend=backend,
                     device=device)


def grid_groups(world: int, outer: int) -> tuple[list[dist.ProcessGroup], list[dist.ProcessGroup]]:
    """A world of outer × inner ranks, global rank o·inner + i: (the inner groups by o, each of inner consecutive
    ranks; the outer groups by i, each of the ranks with that i). Context parallelism's cp × tp and training's dp × tp
    grids. Every rank creates every group, in the same order (new_group requires it)."""
    inner = world // outer
    inner_groups = [dist.new_group(list(range(o * inner, (o + 1) * inner))) for o in range(outer)]
    outer_groups = [dist.new_group(list(range(i, world, inner))) for i in range(inner)]
    return inner_groups, outer_groups


def same_on_every_rank(values: torch.Tensor, group: dist.ProcessGroup) -> bool:
    """All-gather a small vector and compare every rank's copy with rank 0's. Every rank gets the same answer."""
    values = values.to(group_device(group)).contiguous()
    gathered = [torch.empty_like(values) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, values, group=group)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def max_over_ranks(values: list[float], group: dist.ProcessGroup) -> list[float]:
    """Element-wise maximum over the group's ranks (e.g. the slowest rank's timings)."""
    if not values:
        return []
    t = torch.tensor(values, dtype=torch.float64, device=group_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


GROUP_THREAD_PREFIXES = ("pt_gloo", "gloo_", "pt_nccl")  # the native threads of gloo and NCCL process groups


def group_threads() -> list[str]:
    """The names of this process's native threads that belong to a process group (gloo's work loops and transport
    loop, NCCL's watchdog and heartbeat), read from /proc (empty where there is no /proc)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    names = []
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended while we looked
            pass
    return sorted(n for n in names if n.startswith(GROUP_THREAD_PREFIXES))


def shutdown() -> list[str]:
    """Leave the process group and end its threads now, while the interpreter is whole. Returns the process-group
    threads still running (none, unless something still refers to the group).

    destroy_process_group() forgets the group, but the C++ group and its worker threads live on while any Python
    object refers to it (a TPContext, a layer's .group). Left to interpreter teardown, a gloo worker that frees the
    last collective's tensors needs the GIL, finds the interpreter finalizing, and its thread exit unwinds through a
    noexcept destructor: "terminate called without an active exception", SIGABRT, a non-zero exit after the run
    has passed (about 1 exit in 10 on a loaded machine). Callers drop their references to the group first (a
    launcher's work returns; the context goes out of scope); cycles are collected here, and the last reference
    going away joins the group's threads (torch releases the GIL while it waits for them)."""
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
    gc.collect()
    deadline = time.monotonic() + 5.0  # a loaded machine (2 cores, 4 busy processes) may take seconds to end them
    while (left := group_threads()) and time.monotonic() < deadline:
        time.sleep(0.05)
        gc.collect()
    return left
