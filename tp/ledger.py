"""The traffic ledger: which layer sent how many bytes, in which collective, and how long it took.

Off by default: every collective in tp/comm.py asks `active()` for the ledger and,
finding none, does nothing more. Switched on with

    ledger = TrafficLedger(world_size=p, device=device)
    with ledger.attach(stack):      # records while inside; layer index from the stack's blocks
        stack(x)
    ledger.records                  # one CommRecord per collective issued, forward and backward

Bytes follow the ring model for the bytes each rank sends:
all-reduce of M elements 2(p-1)/p·M·e, all-gather to M elements and reduce-scatter of M elements (p-1)/p·M·e.
Counting costs the host nothing: a record is written when the collective is issued, and nothing waits
for the device. Per-collective times only when asked (`TrafficLedger(..., timing=True)`; run_block's
profiling and the sweeps ask): then the rank's compute stream is drained before the clock starts (queued
compute is not billed to the collective) and after the collective returns. That is a wait on this rank's
own stream, never a device-wide synchronize, which would also wait for other streams' work (the
prefill/decode hand-over's sends). A time includes waiting for the slowest rank to arrive.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import time
from dataclasses import dataclass, fields

import torch
from torch.autograd.profiler import record_function

from tp.dist import wait_for_stream

_profiling = torch._C._autograd._profiler_enabled

_ACTIVE: contextvars.ContextVar["TrafficLedger | None"] = contextvars.ContextVar("tp_traffic_ledger", default=None)

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
_SPELLINGS = {"all_reduce": ("allreduce", "all_reduce"), "all_gather": ("allgather", "all_gather"),  # in this order
              "reduce_scatter": ("reduce_scatter",), "all_to_all": ("alltoall", "all_to_all"),
              "broadcast": ("broadcast",)}


def collective_kind(op) -> str:
    """Our name for a collective operator as PyTorch reports it (CommDebugMode's c10d ops): all_reduce, all_gather."""
    name = str(op)
    kinds = [kind for kind, spellings in _SPELLINGS.items() if any(s in name for s in spellings)]
    return kinds[0] if kinds else name.rsplit(".", 1)[-1].strip("_")


def ring_bytes_per_rank(kind: str, elements: int, p: int, elem_bytes: int) -> float:
    """Bytes one rank sends in a ring collective. `elements`: the reduced tensor (all-reduce, reduce-scatter: the
    full input each rank holds), the gathered output (all-gather), or the message (broadcast: p-1 copies of it are
    sent in all, counted here as an average over the p ranks). A reduce-scatter is the all-reduce's first
    half: (p-1)/p·M·e, like the all-gather that is its second half. An all-to-all's bytes follow its split sizes,
    not its shape: they are given to the ledger and the model (sent_bytes)."""
    if kind == "all_reduce":
        return 2 * (p - 1) * elements * elem_bytes / p
    if kind in ("all_gather", "reduce_scatter", "broadcast"):  # broadcast: p - 1 copies of M, spread over p ranks
        return (p - 1) * elements * elem_bytes / p
    raise ValueError(f"unknown collective kind {kind!r}")


@dataclass(frozen=True)
class Traffic:
    """One collective as the analytic model predicts it (tp/traffic_model.py)."""

    layer: int | None  # index of the block that issued it; None outside any block
    sublayer: str  # "attn" or "mlp"
    site: str  # e.g. "all-reduce #1", "gather #3", "qkv dx" (the all-reduce of an input gradient)
    phase: str  # "forward" or "backward"
    kind: str  # "all_reduce", "all_gather" or "reduce_scatter"
    shape: tuple[int, ...]  # the logical tensor: what is reduced, or the gathered output
    dtype: str
    logical_bytes: int
    bytes_per_rank: float

    @classmethod
    def of(cls, *, layer, sublayer, site, phase, kind, shape, dtype: torch.dtype, p: int,
           sent_bytes: float | None = None) -> "Traffic":
        """sent_bytes: what this rank sends (an all-to-all: the rows of its split sizes bound for other ranks)."""
        elements = math.prod(shape)
        elem_bytes = dtype.itemsize
        return cls(layer, sublayer, site, phase, kind, tuple(shape), str(dtype).removeprefix("torch."),
                   elements * elem_bytes,
                   ring_bytes_per_rank(kind, elements, p, elem_bytes) if sent_bytes is None else sent_bytes)


@dataclass(frozen=True)
class CommRecord(Traffic):
    """One collective as the ledger saw it: the traffic, and the wall time it took (0.0 unless timing was asked)."""

    time_s: float = 0.0

    def traffic(self) -> Traffic:
        return Traffic(*(getattr(self, f.name) for f in fields(Traffic)))


@dataclass(frozen=True)
class Transfer:
    """One point-to-point message (prefill/decode hand-over, serve/pd/) as the model predicts it.

    rank and peer are global ranks; heads is the global range [lo, hi) of attention heads whose K,V the
    message carries ((0, 0) for the first-token message); layer is None when one message carries every layer."""

    kind: str  # "send" or "recv"
    site: str  # "pd/kv" or "pd/first token"
    request: int
    layer: int | None
    rank: int
    peer: int
    heads: tuple[int, int]
    shape: tuple[int, ...]
    dtype: str
    bytes: int

    @property
    def bytes_per_rank(self) -> int:
        """What this rank puts on the wire: a send's bytes (a receive sends nothing)."""
        return self.bytes if self.kind == "send" else 0

    @property
    def logical_bytes(self) -> int:
        return self.bytes


@dataclass(frozen=True)
class TransferRecord(Transfer):
    """One message as the ledger saw it: from posting it to seeing it complete (on the sender, completion is
    checked lazily, so a send's time is an upper bound)."""

    time_s: float = 0.0

    def transfer(self) -> Transfer:
        return Transfer(*(getattr(self, f.name) for f in fields(Transfer)))


def split_site(site: str | None) -> tuple[str, str]:
    """'attn/all-reduce #1' -> ('attn', 'all-reduce #1')."""
    if not site:
        return "", ""
    sublayer, _, label = site.partition("/")
    return (sublayer, label) if label else ("", sublayer)


class TrafficLedger:
    def __init__(self, world_size: int, device: torch.device | str = "cpu", timing: bool = False):
        self.world_size = world_size
        self.device = torch.device(device)
        self.timing = timing  # per-collective wall times: two waits for the compute stream per collective
        self.records: list[CommRecord] = []
        self.transfers: list[TransferRecord] = []  # point-to-point messages (serve/pd/)
        self.layer: int | None = None

    # -- switching on and off ---------------------------------------------------------------------

    @contextlib.contextmanager
    def recording(self):
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    def label_layers(self, stack: torch.nn.Module, first_layer: int = 0) -> list:
        """Label each collective with the index of the block that issued it (first_layer + its index in the stack: a
        pipeline stage's blocks carry the model's layer numbers), for as long as the returned hooks stay (an engine
        keeps them: each step then only records)."""
        handles = []
        for i, block in enumerate(stack.blocks):
            handles.append(block.register_forward_pre_hook(lambda m, a, i=i + first_layer: setattr(self, "layer", i)))
            handles.append(block.register_forward_hook(lambda m, a, o: setattr(self, "layer", None)))
        return handles

    @contextlib.contextmanager
    def attach(self, stack: torch.nn.Module, first_layer: int = 0):
        """Record while inside, each collective labelled with its block (label_layers, for this while only)."""
        handles = self.label_layers(stack, first_layer)
        try:
            with self.recording():
                yield self
        finally:
            for h in handles:
                h.remove()

    def clear(self) -> None:
        self.records.clear()

    def transfer(self, record: TransferRecord) -> None:
        self.transfers.append(record)

    # -- called by tp/comm.py -------------------------------------------------------------------

    def measure(self, fn, *, kind: str, site: str | None, phase: str, layer: int | None,
                shape: tuple[int, ...], dtype: torch.dtype, sent_bytes: float | None = None, p: int | None = None):
        """Run `fn` (the collective) and record it. sent_bytes: an all-to-all's bytes to other ranks. p: the
        collective's group size (None: the ledger's world_size)."""
        # A named scope in profiler traces ("tp attn/all-reduce #1"); opened only while profiling (~10 us).
        scope = record_function(f"tp {site or kind}") if _profiling() else contextlib.nullcontext()
        with scope:
            if not self.timing:
                out, elapsed = fn(), 0.0
            else:
                wait_for_stream(self.device)
                start = time.perf_counter()
                out = fn()
                wait_for_stream(self.device)
                elapsed = time.perf_counter() - start
        sublayer, label = split_site(site)
        traffic = Traffic.of(layer=layer, sublayer=sublayer, site=label, phase=phase, kind=kind, shape=shape,
                             dtype=dtype, p=p or self.world_size, sent_bytes=sent_bytes)
        self.records.append(CommRecord(*(getattr(traffic, f.name) for f in fields(Traffic)), elapsed))
        return out


def active() -> TrafficLedger | None:
    return _ACTIVE.get()
