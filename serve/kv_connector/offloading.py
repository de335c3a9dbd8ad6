"""OffloadingConnector: blocks leaving the device pool spill to a CPU tier, then to a disk tier, least recently used
first; a prompt whose next full blocks a tier holds gets them loaded back instead of recomputed (docs/kv_tiers.md).

    LLM(model, kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                   "kv_connector_extra_config": {"cpu_bytes": N, "disk_path": DIR, "disk_bytes": M}})

Keys are the prefix cache's own block hashes (serve/block_manager.py block_hash): the tiers extend the prefix cache
downwards, and a block is found in a tier exactly when it would have been found on the device had the pool been
larger. The scheduler side keeps the index (serve/kv_connector/tiers.py, the same on every rank); the worker side
(TierStore) holds this rank's share of each block (its own K,V heads) and moves it:

    save     before the forward: the leaving blocks' K,V gathered off the pool (they are overwritten in this step)
    load     a copy thread (a side stream on a GPU) writes the loaded blocks layer by layer while the forward runs;
             layer i waits for its own copy only (wait_for_layer_load)
    disk     one IO thread writes, reads and deletes files (DIR/tpref-kv-<pid>/<hash>.kv: each rank process its own
             folder, so replicas and other runs sharing DIR never collide; written whole then renamed; the folder
             goes when the engine does), in the order the index made them; a failed write is said once and the
             block is forgotten at its next lookup

Faults, so that no rank diverges and nothing hangs: before a disk block is counted as a hit, each rank checks its file
(present, its exact size) and the ranks agree (★ one all-reduce of the unreadable tail over the group, only for
lookups that reach the disk tier): from the first block some rank cannot read, the request recomputes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from serve.block_manager import ROOT, block_hash
from serve.kv_connector.base import KVConnectorBase
from serve.kv_connector.config import KVTransferConfig
from serve.kv_connector.tiers import Op, TierIndex
from tp.comm import all_reduce_values
from tp.dist import control_device, host_control

CHECK_SITE = "engine/kv disk check"  # tp/traffic_model.py predict_tier_checks
LOAD_TIMEOUT_S = 300.0


class OffloadingConnector(KVConnectorBase):
    def __init__(self, config: KVTransferConfig, block_size: int, block_bytes: int, group=None, cache=None,
                 rank: int = 0):
        """block_bytes: one block's bytes on this rank (the tiers' capacities are counted in blocks: bytes // it).
        group: the TP group the disk checks agree over (None: one rank). cache: this rank's KVPool (None: the index
        alone, as a trace replay runs it)."""
        self.config, self.block_size, self.group = config, block_size, group
        for name, size in (("cpu_bytes", config.cpu_bytes), ("disk_bytes", config.disk_bytes)):
            if 0 < size < block_bytes:
                raise ValueError(f"kv_transfer_config kv_connector_extra_config {name}={size} holds no KV block of "
                                 f"{block_bytes} bytes (block_size={block_size} positions on this rank); raise it to "
                                 f"at least {block_bytes}, or leave it at 0")
        self.index = TierIndex(config.cpu_bytes // block_bytes, config.disk_bytes // block_bytes)
        self.store = None if cache is None else TierStore(cache, config.disk_path, rank)
        self._pending: dict[int, list[tuple[int, str]]] = {}
        self.checks = 0

    # -- scheduler side ----------------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int:
        bs, tokens = self.block_size, request.tokens
        chain, previous = [], ROOT
        for i in range((len(tokens) - 1) // bs):  # full blocks, leaving the last token to compute
            ids = tuple(tokens[i * bs:(i + 1) * bs])
            key = block_hash(previous, ids)
            if i >= num_computed_tokens // bs:
                chain.append((key, previous, ids))
            previous = key
        hits = self._readable(self.index.lookup(chain))
        self._pending[request.id] = hits
        return len(hits) * bs

    def _readable(self, hits: list[tuple[int, str]]) -> list[tuple[int, str]]:
        """The hits up to the first disk block some rank cannot read (agreed); that block is forgotten."""
        if not any(tier == "disk" for _, tier in hits):
            return hits
        queued = {op.key for op in self.index.ops if op.kind == "demote"}  # this step's loads read them from memory
        usable = next((i for i, (key, tier) in enumerate(hits) if tier == "disk" and key not in queued
                       and self.store is not None and not self.store.readable(key)), len(hits))
        if self.group is not None and self.group.size() > 1:
            self.checks += 1
            with host_control():  # a host tensor over the group's gloo backend: no device wait
                tail = torch.tensor([len(hits) - usable], dtype=torch.int64, device=control_device(self.group))
                usable = len(hits) - int(all_reduce_values(tail, self.group, "max", CHECK_SITE))  # ★ every rank alike
        if usable < len(hits):
            self.index.drop(hits[usable][1], hits[usable][0])
            self.index.counts["disk_unreadable"] += 1
        return hits[:usable]

    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        hits = self._pending.pop(request.id, [])[:num_external_tokens // self.block_size]
        self.index.load(hits, block_ids)

    def block_leaving(self, key: int, parent: int, token_ids: tuple, block: int) -> None:
        self.index.leaving(key, parent, token_ids, block)

    def build_connector_meta(self, plan) -> list[Op]:
        self._pending.clear()  # lookups of requests that were not admitted: asked again next time
        self.index.unpin()
        return self.index.take_ops()

    # -- worker side -------------------------------------------------------------------------------------------------

    def start_load_kv(self, metadata) -> None:
        if self.store is not None and metadata:
            self.store.apply(metadata)

    def wait_for_layer_load(self, layer: int) -> None:
        if self.store is not None:
            self.store.wait_layer(layer)

    def wait_for_save(self) -> None:
        if self.store is not None:
            self.store.wait_layer(None)

    # -- both --------------------------------------------------------------------------------------------------------

    def stats(self) -> dict:
        c = self.index.counts
        return {"kv_offloaded_blocks": c["offloaded"], "kv_demoted_blocks": c["demoted"],
                "kv_tier_hit_blocks": {"cpu": c["cpu_hits"], "disk": c["disk_hits"]},
                "kv_tier_blocks": {t: len(self.index.held[t]) for t in self.index.held},
                "kv_disk_unreadable_blocks": c["disk_unreadable"],
                "kv_disk_write_errors": 0 if self.store is None else self.store.write_errors}

    def step_checks(self) -> int:
        return self.checks

    def begin_step(self) -> None:
        self.checks = 0

    def close(self) -> None:
        super().close()
        if self.store is not None:
            self.store.close()


class TierStore:
    """This rank's share of the tiers: CPU tensors by hash, files under DIR/tpref-kv-<pid>/, and the threads that move
    them (an IO thread for files, in the order the index made its operations; a copy thread for the loads)."""

    def __init__(self, cache, disk_path: str | None, rank: int):
        self.cache, self.rank = cache, rank
        kv = cache.kv
        self.shape = (kv.shape[0], kv.shape[1], cache.block_size, kv.shape[3], kv.shape[4])  # one block
        self.nbytes = kv.element_size() * kv.shape[0] * kv.shape[1] * cache.block_size * kv.shape[3] * kv.shape[4]
        self.cpu: dict[int, torch.Tensor] = {}
        self.dir = None if disk_path is None else os.path.join(disk_path, f"tpref-kv-{os.getpid()}")
        if self.dir is not None:
            os.makedirs(self.dir, exist_ok=True)
        self.io = ThreadPoolExecutor(1, thread_name_prefix="kv-tier-io")  # files, in the order they were asked
        self.copier = ThreadPoolExecutor(1, thread_name_prefix="kv-tier-copy")  # loads into the pool
        self.writes: dict[int, Future] = {}  # the latest write of each key, until a lookup has waited for it
        self.write_errors = 0
        self.cuda = kv.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(kv.device) if self.cuda else None
        self.job: _LoadJob | None = None

    def path(self, key: int) -> str:
        return os.path.join(self.dir, f"{key & (2**64 - 1):016x}.kv")

    def readable(self, key: int) -> bool:
        """This rank's file of a disk-tier block is there, whole (its write waited for if still in flight)."""
        pending = self.writes.pop(key, None)
        if pending is not None:
            pending.result()
        try:
            return os.path.getsize(self.path(key)) == self.nbytes
        except OSError:
            return False

    def apply(self, ops: list[Op]) -> None:
        """One step's operations, in the order the index made them. The saves read the pool first (the loads write it
        later, on the copy thread); files are written, read and deleted on the IO thread in order, except that a
        file this step loads is deleted after its read."""
        self.wait_layer(None)
        saves = [op for op in ops if op.kind == "save"]
        saved = dict(zip((op.key for op in saves), self._gather([op.block for op in saves]))) if saves else {}
        read_here = {op.key for op in ops if op.kind == "load" and op.tier == "disk"}
        loads, deferred, demoted = [], [], {}
        for op in ops:
            if op.kind == "save":
                self.cpu[op.key] = saved[op.key]
            elif op.kind == "demote":
                demoted[op.key] = self.cpu.pop(op.key)  # a load of it in this step reads this, not the file
                self.writes[op.key] = self.io.submit(self._write, op.key, demoted[op.key])
            elif op.kind == "drop" and op.tier == "cpu":
                self.cpu.pop(op.key, None)
            elif op.kind == "drop":
                self.writes.pop(op.key, None)
                if op.key in read_here:
                    deferred.append(op.key)
                else:
                    self.io.submit(self._delete, op.key)
            else:  # a load: the CPU tier's tensor (or one demoted in this step), or the file's read
                src = self.cpu[op.key] if op.tier == "cpu" else demoted.get(op.key)
                loads.append((op.block, src if src is not None else self.io.submit(self._read, op.key)))
        for key in deferred:
            self.io.submit(self._delete, key)
        if loads:
            self.job = _LoadJob(self.cache.n_layers)
            self.copier.submit(self.job.run, self, loads)

    def _gather(self, blocks: list[int]) -> list[torch.Tensor]:
        """The blocks' K,V off the pool, each [L, planes, block_size, heads, width], on the host: a block is a run of
        slots, so one copy each. On a GPU: into pinned memory on a side stream, the compute stream waiting for the
        copies before it overwrites the blocks."""
        bs, kv = self.cache.block_size, self.cache.kv
        if not self.cuda:
            return [kv[:, :, b * bs:(b + 1) * bs].clone() for b in blocks]
        compute = torch.cuda.current_stream(kv.device)
        self.copy_stream.wait_stream(compute)
        with torch.cuda.stream(self.copy_stream):
            out = [torch.empty(self.shape, dtype=kv.dtype, pin_memory=True).copy_(kv[:, :, b * bs:(b + 1) * bs],
                                                                                  non_blocking=True) for b in blocks]
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        compute.wait_stream(self.copy_stream)
        done.synchronize()  # the host copies are read by the IO thread (at most one wait per step with spills)
        return out

    def _write(self, key: int, data: torch.Tensor) -> None:
        path = self.path(key)
        tmp = path + ".tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data.contiguous().view(torch.uint8).numpy().tobytes())
            os.replace(tmp, path)
        except OSError as exc:
            if not self.write_errors:
                print(f"rank {self.rank}: the KV disk tier could not write {path}: {exc.strerror or exc}; such blocks "
                      f"are recomputed when next needed", file=sys.stderr, flush=True)
            self.write_errors += 1
            for p in (tmp, path):
                try:
                    os.remove(p)
                except OSError:
                    pass

    def _read(self, key: int) -> torch.Tensor:
        with open(self.path(key), "rb") as f:
            raw = f.read()
        if len(raw) != self.nbytes:
            raise OSError(f"{self.path(key)}: {len(raw)} bytes, a block has {self.nbytes}")
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(self.cache.kv.dtype).view(self.shape)
        return data.pin_memory() if self.cuda else data

    def _delete(self, key: int) -> None:
        try:
            os.remove(self.path(key))
        except OSError:
            pass

    def wait_layer(self, layer: int | None) -> None:
        """Layer `layer`'s loads are in the pool (None: every layer's); an error in the copy is raised here."""
        job = self.job
        if job is None:
            return
        if layer is None:
            self.job = None
        job.wait(layer)

    def close(self) -> None:
        """Every copy waited for; this process's disk folder removed (its files mean nothing without the index)."""
        try:
            self.wait_layer(None)
        finally:
            self.copier.shutdown(wait=True)
            self.io.shutdown(wait=True)
            if self.dir is not None:
                shutil.rmtree(self.dir, ignore_errors=True)


class _LoadJob:
    """One step's loads, layer by layer, on the copy thread: each layer's copy marked done as it lands, so layer i's
    attention waits for layer i's copies only. A block from disk is read whole first (one file per block)."""

    def __init__(self, n_layers: int):
        self.ready = [threading.Event() for _ in range(n_layers)]
        self.events: list = [None] * n_layers  # a GPU: each layer's copy's CUDA event
        self.error: BaseException | None = None

    def run(self, store: TierStore, loads: list[tuple[int, object]]) -> None:
        try:
            kv, bs = store.cache.kv, store.cache.block_size
            data = torch.stack([src if isinstance(src, torch.Tensor) else src.result() for _, src in loads])
            stream = None
            if store.cuda:
                torch.cuda.set_device(kv.device)
                stream = torch.cuda.Stream(kv.device)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                slots = torch.tensor([b * bs + i for b, _ in loads for i in range(bs)], device=kv.device)
                n, planes = len(loads), kv.shape[1]
                for layer in range(kv.shape[0]):
                    # [n, planes, bs, heads, width] -> [planes, n·bs, heads, width]
                    part = data[:, layer].transpose(0, 1).reshape(planes, n * bs, kv.shape[3], kv.shape[4])
                    kv[layer][:, slots] = part.to(kv.device, non_blocking=True)
                    if stream is not None:
                        self.events[layer] = torch.cuda.Event()
                        self.events[layer].record(stream)
                    self.ready[layer].set()
        except BaseException as exc:
            self.error = exc
            for e in self.ready:
                e.set()

    def wait(self, layer: int | None) -> None:
        for i in (range(len(self.ready)) if layer is None else [layer]):
            if not self.ready[i].wait(LOAD_TIMEOUT_S):
                raise RuntimeError(f"the KV tier's load of layer {i} did not finish in {LOAD_TIMEOUT_S:g} s")
            if self.error is not None:
                raise RuntimeError(f"the KV tier could not load a block back: {self.error}") from self.error
            if self.events[i] is not None:
                torch.cuda.current_stream().wait_event(self.events[i])
