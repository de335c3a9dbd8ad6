"""Loading the weights a launcher serves, and what it costs each rank: peak resident memory and time.

    per-rank slices     a checkpoint: each rank reads only the slices it holds (layers/models/hf.CheckpointSource)
    dense, then shard   random weights: every rank builds the dense model from `seed` and cuts its slices

The peak is the kernel's own high-water mark (VmHWM in /proc/self/status), reset when loading starts by writing
5 to /proc/self/clear_refs (Linux 4.0+): it counts every resident page, the mapped file pages a read touches
included. Where the reset is refused the peak is the process's lifetime one (ru_maxrss) and says so.
"""

from __future__ import annotations

import resource
import time
from pathlib import Path

import torch.distributed as dist


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


class LoadMeter:
    """`with meter:` around a rank's loading (entered more than once: the peak is the highest, the time the sum).
    `report(ctx, module)` gathers every rank's figures into report.json's `load` section."""

    def __init__(self, checkpoint=None, path: str = "per-rank slices"):
        self.checkpoint, self.path = checkpoint, path
        self.base = self.peak = None
        self.time_s, self.lifetime_peak, self.read_from = 0.0, False, checkpoint.bytes_read if checkpoint else 0

    def __enter__(self) -> "LoadMeter":
        rss = _status_kib("VmRSS")  # resident memory now
        if self.base is None and rss is not None:
            self.base = rss * 1024
        try:  # a new high-water mark from here; where the kernel refuses, the peak is the lifetime one
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            self.lifetime_peak = True
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.time_s += time.perf_counter() - self._start
        hwm = _status_kib("VmHWM")
        peak = hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        self.peak = max(self.peak or 0, peak * 1024)

    def mine(self, module) -> dict:
        weights = sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))  # int8 scales
        read = None if self.checkpoint is None else self.checkpoint.bytes_read - self.read_from
        return {"peak_rss_bytes": self.peak, "base_rss_bytes": self.base, "time_s": self.time_s,
                "weights_bytes": weights, "read_bytes": read}

    def report(self, ctx, module, group=None) -> dict:
        """Every rank's figures (an all-gather over `group`, default ctx.group), one list per field."""
        every: list = [None] * dist.get_world_size(group or ctx.group)
        dist.all_gather_object(every, self.mine(module), group=group or ctx.group)
        out = {"path": self.path if self.checkpoint is not None else "dense, then shard",
               "checkpoint": None if self.checkpoint is None else self.checkpoint.layout,
               "checkpoint_bytes": None if self.checkpoint is None else self.checkpoint.total_bytes,
               "peak_is_lifetime": self.lifetime_peak}
        out.update({key: [e[key] for e in every] for key in every[0]})
        return out


def size(n: float) -> str:
    """Bytes in the largest unit that keeps a figure >= 1 (B, KiB, MiB, GiB)."""
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _span(values) -> str:
    lo, hi = size(min(values)), size(max(values))
    return lo if lo == hi else f"{lo} to {hi}"


def render_load(load: dict) -> str:
    """One line: where the weights came from, and what loading cost each rank."""
    peaks, bases = load["peak_rss_bytes"], load["base_rss_bytes"]
    source = (f"per-rank slices of {load['checkpoint']}, {size(load['checkpoint_bytes'])}"
              if load["checkpoint"] else "dense, then shard (random weights from seed)")
    line = (f"load: {source}; per rank: weights {_span(load['weights_bytes'])}, peak RSS {_span(peaks)} "
            f"({_span([pk - (b or 0) for pk, b in zip(peaks, bases)])} above the "
            f"base{', lifetime peak' if load['peak_is_lifetime'] else ''}), {max(load['time_s']):.2f} s")
    if load["read_bytes"][0] is not None:
        line += f"; read {_span(load['read_bytes'])} of the files"
    return line
