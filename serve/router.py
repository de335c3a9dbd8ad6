"""Routing requests across data-parallel replicas, each its own group of TP ranks with its own KV pool
(docs/kv_tiers.md, "Routing"). Host only, no torch.

    round_robin   replica i mod N
    cache_aware   SGLang's policy (its router's CacheAwarePolicy): the router keeps, per replica, an approximate
                  record of the prefixes it sent there (the full blocks' chained hashes, least recently used forgotten
                  beyond `max_tree_blocks`), not the replica's true cache, so it costs the replicas nothing;
                    1. load imbalanced (max − min > balance_abs_threshold and max > balance_rel_threshold · min):
                       the least loaded replica
                    2. else, the longest match / the prompt's blocks > cache_threshold: the replica with that match
                    3. else: the replica whose record is smallest (the most room for a new prefix)
                  ties go to the lower load, then the lower index

Defaults are SGLang's (cache_threshold 0.5, balance_abs_threshold 32, balance_rel_threshold 1.0001). Loads are the
caller's: a replica's unfinished requests.
"""

from __future__ import annotations

from collections import OrderedDict

from serve.block_manager import ROOT, block_hash

POLICIES = ("cache_aware", "round_robin")


def prefix_keys(tokens: list[int], block_size: int) -> list[int]:
    """The chained hashes of the prompt's full blocks (serve/block_manager.py's names)."""
    keys, previous = [], ROOT
    for i in range(len(tokens) // block_size):
        previous = block_hash(previous, tuple(tokens[i * block_size:(i + 1) * block_size]))
        keys.append(previous)
    return keys


class Router:
    def __init__(self, replicas: int, policy: str, block_size: int, cache_threshold: float = 0.5,
                 balance_abs_threshold: int = 32, balance_rel_threshold: float = 1.0001,
                 max_tree_blocks: int = 1 << 20):
        if policy not in POLICIES:
            raise ValueError(f"router policy={policy!r}: choose {' or '.join(POLICIES)}")
        if replicas < 1:
            raise ValueError(f"data_parallel_size={replicas} must be at least 1")
        self.replicas, self.policy, self.block_size = replicas, policy, block_size
        self.cache_threshold, self.balance_abs, self.balance_rel = \
            cache_threshold, balance_abs_threshold, balance_rel_threshold
        self.max_tree_blocks = max_tree_blocks
        self.trees = [OrderedDict() for _ in range(replicas)]  # per replica: block hash -> None, LRU first
        self.next = 0
        self.decisions = {"imbalanced": 0, "cache": 0, "smallest": 0, "round_robin": 0}

    def route(self, tokens: list[int], loads: list[int], alive: list[bool] | None = None) -> int:
        """The replica for a prompt (among those `alive`, default all); its prefix is recorded there."""
        live = [i for i in range(self.replicas) if alive is None or alive[i]]
        if self.policy == "round_robin":
            while self.next not in live:
                self.next = (self.next + 1) % self.replicas
            pick, self.next = self.next, (self.next + 1) % self.replicas
            self.decisions["round_robin"] += 1
            return pick
        keys = prefix_keys(tokens, self.block_size)
        lo, hi = min(loads[i] for i in live), max(loads[i] for i in live)
        order = sorted(live, key=lambda i: (loads[i], i))
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            pick, why = order[0], "imbalanced"
        else:
            matches = {i: self.match(i, keys) for i in live}
            best = max(order, key=lambda i: matches[i])  # max keeps the first of equals: the lower load
            if keys and matches[best] / len(keys) > self.cache_threshold:
                pick, why = best, "cache"
            else:
                pick, why = min(order, key=lambda i: len(self.trees[i])), "smallest"
        self.decisions[why] += 1
        self.record(pick, keys)
        return pick

    def match(self, replica: int, keys: list[int]) -> int:
        """How many leading blocks of the prompt the replica's record holds."""
        tree = self.trees[replica]
        return next((i for i, k in enumerate(keys) if k not in tree), len(keys))

    def record(self, replica: int, keys: list[int]) -> None:
        tree = self.trees[replica]
        for k in keys:
            tree[k] = None
            tree.move_to_end(k)
        while len(tree) > self.max_tree_blocks:
            tree.popitem(last=False)

    def forget(self, replica: int) -> None:
        """A replica that died: its record goes (nothing routes there by prefix again until it is refilled)."""
        self.trees[replica].clear()
