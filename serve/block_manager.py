"""KV memory as pages: a pool of `num_blocks` blocks of `block_size` token positions, on the host only.

    request r's block table   [7, 2, 9]         logical block i -> physical block table[i]
    token position t          block table[t // block_size], slot t % block_size
    slot mapping of t         table[t // block_size] * block_size + t % block_size   (a row of the pool's flat view)

Every rank makes the same decisions (the scheduler calls this with the same requests in the same order), so
every rank's tables are the same; each rank's pool tensor (serve/kv_cache.py) holds only its own K,V heads.

Prefix caching (docs/serving.md, "Paged KV cache"): a block full of computed tokens is named by a chained hash,
hash((previous block's hash, its token ids)), entered in `cached`, and shared (reference counts) by a new request
whose prompt starts with the same full blocks. A freed block keeps its name until it is taken for new tokens.
No torch here, and no collectives.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from serve.config import EngineConfig
from tp.partition import ceil_div


ROOT = 0  # the chain's start: the "previous hash" of a request's first block
EVICTED = -1  # a block table's entry for a block given back by KV eviction (serve/eviction.py): nothing reads it


@dataclass
class Block:
    id: int
    ref_count: int = 0
    hash: int | None = None  # set once full of computed tokens (prefix caching), kept after it is freed
    parent: int = ROOT  # the previous block's hash when this one was named
    token_ids: tuple[int, ...] = ()  # with `parent`, what the hash names: both checked on a hit (a collision misses)


def block_hash(previous: int, token_ids: tuple[int, ...]) -> int:
    """A full block's name: its tokens and, through `previous`, every token before it. A tuple of ints hashes the
    same in every process (PYTHONHASHSEED randomizes str and bytes only), so every rank computes the same number."""
    return hash((previous, token_ids))


def slot_mapping(table, block_size: int, start: int, end: int) -> list[int]:
    """Where positions [start, end) of a request with block table `table` lie in the pool's flat view."""
    return [table[t // block_size] * block_size + t % block_size for t in range(start, end)]


def slots_of(c, start: int, end: int, block_size: int) -> list[int]:
    """The slot mapping of positions [start, end) of a scheduled request (serve/plan.py), off the block table the
    plan carries."""
    return slot_mapping(c.blocks, block_size, start, end)


@dataclass
class KVCacheManager:
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = EngineConfig.enable_prefix_caching
    blocks: list[Block] = field(init=False)
    free: OrderedDict = field(init=False)  # block id -> None, least recently freed first
    cached: dict[int, dict[int, None]] = field(init=False)  # hash -> the blocks carrying it, oldest name first
    tables: dict[int, list[int]] = field(init=False)  # request -> its block table
    hashed: dict[int, int] = field(init=False)  # request -> how many of its leading blocks carry a hash
    chain: dict[int, int] = field(init=False)  # request -> the hash of its last named block (ROOT: none yet)
    evicted: int = field(init=False, default=0)  # blocks given back by KV eviction, all requests
    # told of each named block taken for new tokens while its K,V are still in the pool (a KV connector's
    # block_leaving: serve/kv_connector/); only when no other block carries its name
    on_leave: object = field(init=False, default=None, repr=False)

    def __post_init__(self):
        if self.block_size < 1:
            raise ValueError(f"block_size={self.block_size} must be at least 1")
        if self.num_blocks < 1:
            raise ValueError(f"num_gpu_blocks_override={self.num_blocks} must be at least 1")
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        self.free = OrderedDict((i, None) for i in range(self.num_blocks))
        self.cached, self.tables, self.hashed, self.chain = {}, {}, {}, {}

    # ---- what the scheduler asks -----------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_for(self, tokens: int) -> int:
        return ceil_div(tokens, self.block_size)

    def match_prefix(self, tokens: list[int]) -> list[int]:
        """The longest run of cached full blocks that starts `tokens`, leaving at least its last token to compute
        (a request needs a row to sample from)."""
        if not self.enable_prefix_caching:
            return []
        out, previous, bs = [], ROOT, self.block_size
        for i in range((len(tokens) - 1) // bs):
            ids = tuple(tokens[i * bs:(i + 1) * bs])
            h = block_hash(previous, ids)
            copies = [b for b in self.cached.get(h, ()) if self.blocks[b].token_ids == ids
                      and self.blocks[b].parent == previous]  # a collision of hashes misses
            b = min(copies, key=lambda b: self.blocks[b].ref_count == 0, default=None)  # a held copy costs nothing
            if b is None:
                break
            out.append(b)
            previous = h
        return out

    def admit_cost(self, tokens: list[int], most_rows: int, cached: bool = True) -> tuple[list[int], int]:
        """(cached prefix blocks, free blocks needed) for a request not yet holding blocks: its prefix hit (none when
        not `cached`) plus its next chunk of at most `most_rows` rows. Reviving a freed cached block takes it off the
        free queue too."""
        hit = self.match_prefix(tokens) if cached else []
        return hit, self.admit_need(tokens, most_rows, hit)

    def admit_need(self, tokens: list[int], most_rows: int, hit: list[int], external: int = 0) -> int:
        """Free blocks needed to admit with prefix hit `hit` and `external` more tokens a KV connector supplies
        (fresh blocks, filled by the connector), plus the next chunk of at most `most_rows` rows."""
        start = len(hit) * self.block_size + external
        rows = min(most_rows, len(tokens) - start)
        return self.blocks_for(start + rows) - len(hit) + sum(self.blocks[b].ref_count == 0 for b in hit)

    def admit(self, request: int, hit: list[int]) -> None:
        """Start a block table for `request` with the shared prefix blocks `hit` (from admit_cost)."""
        if request in self.tables:
            raise ValueError(f"request {request} already holds blocks")
        for b in hit:
            self._take(b)
        self.tables[request] = list(hit)
        self.hashed[request] = len(hit)
        self.chain[request] = self.blocks[hit[-1]].hash if hit else ROOT

    def rows_that_fit(self, request: int, start: int, rows: int) -> int:
        """How many of positions [start, start + rows) the request's table can hold, growing by free blocks."""
        room = (len(self.tables[request]) + len(self.free)) * self.block_size - start
        return max(0, min(rows, room))

    def grow(self, request: int, end: int) -> None:
        """Append free blocks until the table covers positions [0, end) (the caller checked rows_that_fit)."""
        table = self.tables[request]
        while len(table) * self.block_size < end:
            b = next(iter(self.free))  # least recently freed
            old = self.blocks[b]
            if old.hash is not None:  # overwritten: the prefix it held is gone, unless another block holds it too
                copies = self.cached[old.hash]
                del copies[b]
                if not copies:
                    del self.cached[old.hash]
                    if self.on_leave is not None:
                        self.on_leave(old.hash, old.parent, old.token_ids, b)
            old.hash, old.parent, old.token_ids = None, ROOT, ()
            self._take(b)
            table.append(b)

    def shrink(self, request: int, end: int) -> None:
        """Give back the table's blocks past those covering positions [0, end) (speculative decoding's rejected rows:
        never named, so they go to the front of the free queue)."""
        table = self.tables[request]
        while len(table) > self.blocks_for(end):
            b = table.pop()
            block = self.blocks[b]
            assert block.hash is None or block.ref_count > 1, f"block {b} is named but holds uncomputed positions"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[b] = None
                self.free.move_to_end(b, last=False)
        if self.hashed[request] > len(table):
            self.hashed[request] = len(table)
            self.chain[request] = self.blocks[table[-1]].hash if table else ROOT

    def evict(self, request: int, logical: range) -> int:
        """KV eviction (serve/eviction.py): the request gives back its blocks at table positions `logical` that it
        still holds; their entries become EVICTED. A block shared with other requests (a prefix) stays theirs: only
        this request's count drops. A named block goes to the back of the free queue, as release() puts it, so the
        prefix cache keeps it longest. Returns how many entries were given back."""
        table, n = self.tables[request], 0
        for i in logical:
            b = table[i]
            if b == EVICTED:
                continue
            table[i] = EVICTED
            block = self.blocks[b]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[b] = None
                if block.hash is None:
                    self.free.move_to_end(b, last=False)
            n += 1
        self.evicted += n
        return n

    def commit(self, request: int, tokens: list[int], computed: int) -> None:
        """Name every block now full of computed tokens (prefix caching), so later requests can share it."""
        if not self.enable_prefix_caching:
            return
        table, bs = self.tables[request], self.block_size
        i = self.hashed[request]
        previous = self.chain[request]
        while (i + 1) * bs <= computed and table[i] != EVICTED:  # an evicted block was named before it went, or
            block = self.blocks[table[i]]                        # never is (nor anything after it)
            if block.hash is None:  # a shared block already carries its name
                block.token_ids, block.parent = tuple(tokens[i * bs:(i + 1) * bs]), previous
                block.hash = block_hash(previous, block.token_ids)
                self.cached.setdefault(block.hash, {})[block.id] = None
            previous = block.hash
            i += 1
        self.hashed[request], self.chain[request] = i, previous

    def release(self, request: int) -> None:
        """The request finished or was preempted: its blocks' counts drop and blocks at 0 join the free queue. Named
        blocks go to the back, the table's tail first (a prefix's first blocks are the likeliest to be shared
        again, so they are taken last); unnamed ones, which nobody can hit, to the front (taken first)."""
        for b in reversed(self.tables.pop(request)):
            if b == EVICTED:
                continue
            block = self.blocks[b]
            block.ref_count -= 1
            if block.ref_count < 0:
                raise AssertionError(f"block {b} freed more often than taken")
            if block.ref_count == 0:
                self.free[b] = None
                if block.hash is None:
                    self.free.move_to_end(b, last=False)
        del self.hashed[request], self.chain[request]

    def slots(self, request: int, start: int, end: int) -> list[int]:
        """The slot mapping of positions [start, end): where each position's K,V lie in the pool's flat view."""
        return slot_mapping(self.tables[request], self.block_size, start, end)

    def check(self) -> None:
        """The invariants: counts never below 0, a block is free iff nobody holds it, counts = table entries; `cached`
        names exactly the blocks that carry a hash, each under the hash of its (parent, tokens), and a table's named
        blocks form one chain from ROOT."""
        held = [0] * self.num_blocks
        for table in self.tables.values():
            for b in table:
                if b != EVICTED:
                    held[b] += 1
        for block in self.blocks:
            if block.ref_count != held[block.id] or (block.ref_count == 0) != (block.id in self.free):
                raise AssertionError(f"block {block.id}: count {block.ref_count}, held by {held[block.id]} tables, "
                                     f"{'free' if block.id in self.free else 'not free'}")
        named = {b: h for h, copies in self.cached.items() for b in copies}
        if sum(map(len, self.cached.values())) != len(named) or any(not c for c in self.cached.values()):
            raise AssertionError("a block is listed twice in `cached`, or a hash with no block")
        for block in self.blocks:
            if named.get(block.id) != block.hash:
                raise AssertionError(f"block {block.id} carries hash {block.hash} but `cached` lists it under "
                                     f"{named.get(block.id)}")
            if block.hash is not None and (len(block.token_ids) != self.block_size
                                           or block_hash(block.parent, block.token_ids) != block.hash):
                raise AssertionError(f"block {block.id}: its hash does not name its (parent, tokens)")
        for request, table in self.tables.items():
            previous = ROOT
            for b in table[:self.hashed[request]]:
                if b == EVICTED:  # evicted after it was named: the chain goes on from the next block's parent
                    previous = None
                    continue
                if self.blocks[b].hash is None or previous not in (None, self.blocks[b].parent):
                    raise AssertionError(f"request {request}: block {b} breaks its table's chain of names")
                previous = self.blocks[b].hash
            if self.hashed[request] and previous is not None and previous != self.chain[request]:
                raise AssertionError(f"request {request}: its chain ends at {self.chain[request]}, its last named "
                                     f"block carries {previous}")

    def _take(self, b: int) -> None:
        if self.blocks[b].ref_count == 0:
            del self.free[b]
        self.blocks[b].ref_count += 1
