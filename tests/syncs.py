"""Count the calls that make the host wait for the device, per serving iteration.

On a GPU each of these blocks the host until the device has caught up:
  - reading a tensor's values: `tolist`, `cpu`, `numpy` (patched on torch.Tensor: on a CPU tensor they reach no
    operator), and every operator that returns a Python number (`item`, `bool`/`int`/`float`/`index` of a tensor:
    aten._local_scalar_dense, counted as "item");
  - operators whose output size or result depends on the values, which wait inside C++: `nonzero`, boolean-mask
    indexing (aten.index / index_put with a bool index), `masked_select`, `bincount`, `unique`, `equal`,
    `repeat_interleave` without an output size. These are counted at the dispatcher (a TorchDispatchMode), so a
    wait that no Python method shows is counted too;
  - the explicit waits: `torch.cuda.synchronize`, a stream's or an event's `synchronize`, tp.dist.wait_for_stream
    wherever it was imported.
On the CPU they cost nothing, which is why they are counted rather than timed: the count is what a GPU would pay
(and launch/gpu_check.py runs the same iterations on CUDA under torch.cuda.set_sync_debug_mode("error"), which
raises on any of them). Work inside tp.dist.host_control() is host-side control traffic (under NCCL its tensors
are CPU tensors on the group's gloo backend) and is counted apart, in `control`.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tp.dist

READS = ("tolist", "cpu", "numpy")  # reach no operator on a CPU tensor: patched
aten = torch.ops.aten
WAITING_OPS = {  # operator -> its label; these wait for the device on a GPU whatever their inputs
    aten._local_scalar_dense.default: "item", aten.nonzero.default: "nonzero", aten.masked_select.default:
    "masked_select", aten.bincount.default: "bincount", aten.equal.default: "equal", aten._unique2.default: "unique",
    aten.unique_dim.default: "unique", aten.unique_consecutive.default: "unique", aten.is_nonzero.default: "item",
}
BOOL_INDEXED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


def waiting_label(func, args, kwargs) -> str | None:
    """The label of an operator call that waits for the device, or None."""
    if func in WAITING_OPS:
        return WAITING_OPS[func]
    if func in BOOL_INDEXED:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
            return "index(bool mask)"
    if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
        return "repeat_interleave"
    return None


class _Dispatch(TorchDispatchMode):
    def __init__(self, count):
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        label = waiting_label(func, args, kwargs)
        if label is not None:
            self.count(label)
        return func(*args, **kwargs)


class SyncCounter:
    def __init__(self):
        self.device: Counter = Counter()  # what a GPU would wait for
        self.control: Counter = Counter()  # reads inside tp.dist.host_control(): host tensors only

    def _count(self, name: str) -> None:
        (self.control if tp.dist.in_host_control() else self.device)[name] += 1

    @contextlib.contextmanager
    def counting(self):
        saved = []

        def wrap(owner, name, label):
            original = getattr(owner, name)

            def counted(*args, **kwargs):
                self._count(label)
                return original(*args, **kwargs)

            saved.append((owner, name, original))
            setattr(owner, name, counted)

        for name in READS:
            wrap(torch.Tensor, name, name)
        wrap(torch.cuda, "synchronize", "cuda.synchronize")
        wrap(torch.cuda.Stream, "synchronize", "stream.synchronize")
        wrap(torch.cuda.Event, "synchronize", "event.synchronize")
        original_sync = tp.dist.wait_for_stream
        for module in list(sys.modules.values()):  # tp.dist.synchronize under every name it was imported as
            for attr in ("synchronize", "wait_for_stream"):
                if getattr(module, attr, None) is original_sync:
                    wrap(module, attr, "tp.dist.wait_for_stream")
        try:
            with _Dispatch(self._count):
                yield self
        finally:
            for owner, name, original in reversed(saved):
                setattr(owner, name, original)

    def snapshot(self) -> tuple[int, int]:
        return sum(self.device.values()), sum(self.control.values())
