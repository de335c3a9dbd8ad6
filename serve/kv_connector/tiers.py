"""The tiers' index: which named blocks (prefix-cache hashes) the CPU tier and the disk tier hold, least recently
used first. Host only, no torch: every rank makes the same decisions from the same scheduler events, so every rank's
index is the same; what each rank stores is its own heads' share (serve/kv_connector/offloading.py TierStore).

    a named block leaves the device pool (taken for new tokens: KVCacheManager.grow)
        in a tier already     touched (most recently used); nothing moves: a tier's copy equals the device's
        else                  Save into the CPU tier; the CPU tier's least recently used block moves down (Demote
                              to disk), the disk tier's least recently used one is deleted (Drop)
    a prompt's next full blocks are in a tier (lookup)
                              Load each into a fresh device block before the step's layers read it; the tier
                              keeps its copy (the tiers hold what the device held, inclusively)

The CPU and disk tiers hold a block at most once between them. The worker applies the operations in the order they
were made (TierStore.apply), which is what keeps a block's data where the index says it is.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class Op:
    """One of the worker's operations: Save (the device block's K,V to the CPU tier), Demote (CPU -> disk), Drop
    (a tier forgets it), Load (the tier's copy into a device block)."""

    kind: str  # "save", "demote", "drop", "load"
    key: int  # the block's hash (serve/block_manager.py block_hash)
    block: int = -1  # save, load: the device block
    tier: str = ""  # drop, load: which tier


TIERS = ("cpu", "disk")


class TierIndex:
    def __init__(self, cpu_blocks: int, disk_blocks: int):
        self.capacity = {"cpu": cpu_blocks, "disk": disk_blocks}
        self.held: dict[str, OrderedDict] = {t: OrderedDict() for t in TIERS}  # hash -> (parent, token ids)
        self.ops: list[Op] = []  # made since the worker last took them (take_ops)
        # an admission's hits between its lookup and its load: the blocks its own growth spills never push them out
        self.pinned: set[int] = set()
        self.counts = {"offloaded": 0, "demoted": 0, "dropped": 0, "cpu_hits": 0, "disk_hits": 0,
                       "disk_unreadable": 0}

    def where(self, key: int, parent: int, token_ids: tuple) -> str | None:
        """The tier holding this named block (its hash, checked against its parent and tokens: a collision misses)."""
        for tier in TIERS:
            if self.held[tier].get(key) == (parent, token_ids):
                return tier
        return None

    def leaving(self, key: int, parent: int, token_ids: tuple, block: int) -> None:
        """A named block leaves the device pool; its K,V are still in device block `block` until the step's forward."""
        tier = self.where(key, parent, token_ids)
        if tier is not None:
            self.held[tier].move_to_end(key)
            return
        if not self.capacity["cpu"] and not self.capacity["disk"]:
            return
        self.ops.append(Op("save", key, block))
        self.counts["offloaded"] += 1
        self._put("cpu", key, (parent, token_ids))

    def _put(self, tier: str, key: int, name: tuple) -> None:
        self.held[tier][key] = name
        self._shrink(tier)

    def _shrink(self, tier: str) -> None:
        """Down to capacity, least recently used first: the CPU tier's to disk (if any), the disk tier's deleted."""
        held = self.held[tier]
        while len(held) > self.capacity[tier]:
            old = next((k for k in held if k not in self.pinned), None)
            if old is None:  # every block pinned: above capacity until the load (check() allows it)
                break
            old_name = held.pop(old)
            if tier == "cpu" and self.capacity["disk"]:
                self.ops.append(Op("demote", old))
                self.counts["demoted"] += 1
                self._put("disk", old, old_name)
            else:
                self.drop(tier, old)

    def drop(self, tier: str, key: int) -> None:
        self.held[tier].pop(key, None)
        self.ops.append(Op("drop", key, tier=tier))
        self.counts["dropped"] += 1

    def lookup(self, chain: list[tuple[int, int, tuple]]) -> list[tuple[int, str]]:
        """The leading blocks of `chain` ([(hash, parent, token ids)], a prompt's next full blocks in order) that a
        tier holds, each with its tier, up to the first that none holds. They are pinned until `load` (or the next
        lookup): the admission's own growth may spill blocks, which must not push them down or out."""
        out = []
        for key, parent, token_ids in chain:
            tier = self.where(key, parent, token_ids)
            if tier is None:
                break
            out.append((key, tier))
        self.pinned = {key for key, _ in out}
        return out

    def load(self, hits: list[tuple[int, str]], blocks: list[int]) -> None:
        """The hits go into device blocks `blocks` (fresh ones, the caller's); each is touched, and unpinned."""
        for (key, tier), block in zip(hits, blocks, strict=True):
            self.held[tier].move_to_end(key)
            self.ops.append(Op("load", key, block, tier))
            self.counts[f"{tier}_hits"] += 1
        self.unpin()

    def unpin(self) -> None:
        """No admission pending: what the pins held above capacity goes now."""
        self.pinned = set()
        for tier in TIERS:
            self._shrink(tier)

    def take_ops(self) -> list[Op]:
        ops, self.ops = self.ops, []
        return ops

    def check(self) -> None:
        """The invariants: no tier above its capacity, no block in both tiers."""
        for tier in TIERS:
            if len(self.held[tier]) > self.capacity[tier] + len(self.pinned):
                raise AssertionError(f"the {tier} tier holds {len(self.held[tier])} blocks, above its "
                                     f"{self.capacity[tier]}")
        both = set(self.held["cpu"]) & set(self.held["disk"])
        if both:
            raise AssertionError(f"blocks {sorted(both)[:3]} are in both tiers")
