"""Count the calls that make the host wait for the device, per serving iteration.

On a GPU each of these blocks the host until the device has caught up: reading a tensor's values
(`item`, `tolist`, `cpu`, `numpy`, `bool`/`int`/`float`/`index` of a tensor) and the explicit waits
(`torch.cuda.synchronize`, a stream's or an event's `synchronize`, tp.dist.wait_for_stream wherever it was
imported). On the CPU they cost nothing, which is why they are counted rather than timed: the count is
what a GPU would pay. Work inside tp.dist.host_control() is host-side control traffic (under NCCL its
tensors are CPU tensors on the group's gloo backend) and is counted apart, in `control`.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter

import torch

import tp.dist

READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


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
            yield self
        finally:
            for owner, name, original in reversed(saved):
                setattr(owner, name, original)

    def snapshot(self) -> tuple[int, int]:
        return sum(self.device.values()), sum(self.control.values())
