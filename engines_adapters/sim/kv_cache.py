"""The simulated engine's KV block pool: prefix cache with LRU eviction and an optional host tier.

Accounting is by counts, not block ids: a block is either *plain* (free, no content), *private*
to one sequence (its partial tail; counted only in that sequence's ``n_alloc``), or *cached*: a
full block named by its chained hash, shared by reference count, and evictable (in the LRU) when
no sequence references it. A sequence's full blocks are always cached ones: when a sequence
fills a block whose hash is already cached it switches to the cached block and returns its own.
A sequence's full blocks are the first ``n`` of its hash chain, so the pool names blocks by hash
only: ``cached`` maps a hash to its reference count (no per-block object), and a sequence keeps
just how many of its hashes it holds.

The LRU of unreferenced blocks is a list in release order with lazy deletion: a block that drops
to no references gets the next *stamp* (its position in the list), stored negated as its count
(so a count <= 0 means "evictable, released at stamp -count"); re-referencing it just overwrites
the count, and eviction walks the list from the head skipping entries whose stamp is stale. The
order is exactly an ordered dict's (oldest release first), without a node per block.

Usage follows vLLM: ``1 - (plain + evictable) / capacity``.

Host tier (capacity in blocks, 0 = off): a block evicted from the GPU is offloaded to host memory
(its own LRU); a prefix that continues in the host tier can be loaded back at the host bandwidth.

KV events (vLLM wire structs) are appended to ``events`` when it is a list. A block's event id
(``vh``) is its hash, unless the pool keeps per-block metadata (``meta``: vLLM sha256 ids, or
the parent and tokens an offload event repeats), which the engine fills in for the blocks it
stores.
"""
from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

from ..kv_wire import MEDIUM_CPU, MEDIUM_GPU, AllBlocksCleared, BlockHash, BlockRemoved, BlockStored


class Block:
    """Event metadata of one cached block: ``vh``/``vdigest``: vLLM ids; parent id, tokens, and
    the extra keys and adapter its hash folded in (repeated when the block is offloaded)."""

    __slots__ = ("vh", "vdigest", "parent_vh", "tokens", "keys", "lora")

    def __init__(self, vh: BlockHash, vdigest: bytes | None, parent_vh: BlockHash | None,
                 tokens: tuple[int, ...] | None, keys: tuple[str, ...] | None = None, lora: str | None = None):
        self.vh = vh
        self.vdigest = vdigest
        self.parent_vh = parent_vh
        self.tokens = tokens
        self.keys = keys
        self.lora = lora


def lora_int_id(lora_name: str | None) -> int | None:
    """The ``lora_id`` an event carries: vLLM numbers adapters as it loads them (1, 2, ...), an
    order the sim does not have; a stable positive id from the name stands in (the index reads
    ``lora_name``, as vLLM's docs ask, not this deprecated field)."""
    return None if lora_name is None else 1 + zlib.crc32(lora_name.encode("utf-8", "surrogatepass")) % (2**31 - 1)


class KVCache:
    slack = 4096  # consumed / stale LRU entries tolerated before the list is trimmed

    def __init__(self, capacity_blocks: int, block_size: int, host_blocks: int = 0, events: bool = False,
                 meta: bool = True, merge_removals: bool = False):
        """``meta``: keep a ``Block`` per cached block (events on; needed for vLLM ids or a host
        tier). Without it, events name a block by its hash. ``merge_removals``: consecutive
        removals in one BlockRemoved (the in-process simulator, whose events never reach a wire:
        a tenth of the objects); otherwise one per block, as vLLM sends them."""
        if capacity_blocks <= 0:
            raise ValueError(f"KV capacity must be at least one block, got {capacity_blocks}")
        self.capacity = capacity_blocks
        self.block_size = block_size
        self.free_plain = capacity_blocks
        self.cached: dict[int, int] = {}  # hash -> references; <= 0: evictable, -stamp in the LRU
        self._q: list[int] = []  # LRU entries in release order; q[i] has stamp base + i
        self._base = 1
        self._head = 0  # entries before it are consumed
        self.n_lru = 0  # evictable blocks (valid entries)
        self.host_capacity = max(0, host_blocks)
        self.host: OrderedDict[int, Block | None] = OrderedDict()
        self.events: list | None = [] if events else None
        self.meta: dict[int, Block] | None = {} if events and meta else None
        self.evictions = 0
        self.on_evict: Callable[[list[int]], None] | None = None  # evicted hashes (a store's write-back)
        self.offloads = 0
        self.merge_removals = merge_removals
        self.host_medium = MEDIUM_CPU  # the host tier's name in events (SGLang: CPU_PINNED)

    # --- capacity ---------------------------------------------------------------------------
    def num_free(self) -> int:
        return self.free_plain + self.n_lru

    def lru(self) -> Iterator[int]:
        """The evictable blocks' hashes, least recently released first."""
        cached, base = self.cached, self._base
        for i in range(self._head, len(self._q)):
            h = self._q[i]
            if cached.get(h) == -(base + i):
                yield h

    def usage(self) -> float:
        return 1.0 - self.num_free() / self.capacity

    def alloc(self, n: int) -> bool:
        """Take ``n`` blocks (plain first, then evicting the least recently used)."""
        if n > self.free_plain + self.n_lru:
            return False
        take = n if n <= self.free_plain else self.free_plain
        self.free_plain -= take
        if n > take:
            self._evict(n - take)
        return True

    def _evict(self, k: int) -> None:
        """Evict the ``k`` least recently used blocks."""
        cached, q, base = self.cached, self._q, self._base
        i = self._head
        evicted: list[int] = []
        add = evicted.append
        left = k
        while left:
            h = q[i]
            if cached.get(h) == -(base + i):
                del cached[h]
                add(h)
                left -= 1
            i += 1
        self._head = i
        self.n_lru -= k
        if i > self.slack and i > len(q) >> 1:  # drop the consumed head
            del q[:i]
            self._base = base + i
            self._head = 0
        self.evictions += k
        if self.on_evict is not None:
            self.on_evict(evicted)
        if self.host_capacity:  # per block: each removal is followed by its offload's events
            meta = self.meta
            for h in evicted:
                m = meta.pop(h) if meta is not None else None
                if self.events is not None:
                    self._removed([m.vh if m is not None else h], MEDIUM_GPU)
                self._offload(h, m)
        elif self.events is not None:
            meta = self.meta
            self._removed(evicted if meta is None else [meta.pop(h).vh for h in evicted], MEDIUM_GPU)

    def _offload(self, h: int, m: Block | None) -> None:
        host = self.host
        if h in host:
            host.move_to_end(h)
            return
        host[h] = m
        self.offloads += 1
        if self.events is not None:
            lora = m.lora if m is not None else None
            self.events.append(BlockStored(block_hashes=[m.vh if m is not None else h],
                                           parent_block_hash=m.parent_vh if m is not None else None,
                                           token_ids=list((m.tokens if m is not None else None) or ()),
                                           block_size=self.block_size, lora_id=lora_int_id(lora),
                                           medium=self.host_medium, lora_name=lora,
                                           extra_keys=[m.keys if m is not None else None], group_idx=0))
        if len(host) > self.host_capacity:
            old_h, old = host.popitem(last=False)
            if self.events is not None:
                self._removed([old.vh if old is not None else old_h], self.host_medium)

    def _removed(self, vhs: Sequence[BlockHash], medium: str) -> None:
        """One BlockRemoved per block, as vLLM's BlockPool sends them (group 0: one KV-cache group)."""
        ev = self.events
        assert ev is not None
        if not self.merge_removals:
            ev.extend([BlockRemoved(block_hashes=[vh], medium=medium, group_idx=0) for vh in vhs])
            return
        last = ev[-1] if ev else None
        if type(last) is BlockRemoved and last.medium == medium:
            last.block_hashes.extend(vhs)
        else:
            ev.append(BlockRemoved(block_hashes=list(vhs), medium=medium, group_idx=0))

    # --- prefix lookup ----------------------------------------------------------------------
    def match_gpu(self, hashes: list[int], limit: int) -> int:
        """Number of leading ``hashes`` (at most ``limit``) cached on the GPU."""
        cached = self.cached
        n = 0
        while n < limit and hashes[n] in cached:
            n += 1
        return n

    def match_host(self, hashes: list[int], start: int, limit: int) -> int:
        """Number of hashes from ``start`` (up to ``limit``) held by the host tier."""
        host = self.host
        n = start
        while n < limit and hashes[n] in host:
            n += 1
        return n - start

    def acquire_prefix(self, hashes: list[int], limit: int) -> int:
        """``match_gpu`` and ``acquire`` in one walk: reference the leading cached blocks (at most
        ``limit``) and return how many there are."""
        cached = self.cached
        get = cached.get
        left = n = 0
        for h in hashes[:limit]:
            r = get(h)
            if r is None:
                break
            if r <= 0:
                cached[h] = 1
                left += 1
            else:
                cached[h] = r + 1
            n += 1
        self.n_lru -= left
        return n

    def acquire(self, hashes: list[int], n: int) -> None:
        """Reference the first ``n`` cached blocks of a prefix (they leave the LRU)."""
        cached = self.cached
        left = 0
        for h in hashes[:n]:
            r = cached[h]
            if r <= 0:
                cached[h] = 1
                left += 1
            else:
                cached[h] = r + 1
        self.n_lru -= left

    def commit_many(self, hashes: list[int], first: int, upto: int) -> list[int]:
        """A sequence's private blocks ``first..upto`` of chain ``hashes`` just filled: cache
        each, or share the existing block with that content (returning the private block to the
        pool). Returns the offsets (into ``hashes``) of the newly cached ones."""
        cached = self.cached
        if first >= upto:
            return []
        fresh = dict.fromkeys(hashes[first:upto], 1)
        if len(fresh) == upto - first and cached.keys().isdisjoint(fresh):  # all new: the common prefill
            cached.update(fresh)
            return list(range(first, upto))
        new: list[int] = []
        shared = left = 0
        get = cached.get
        for i in range(first, upto):
            h = hashes[i]
            r = get(h)
            if r is None:
                cached[h] = 1
                new.append(i)
            else:
                if r <= 0:
                    r = 0
                    left += 1
                cached[h] = r + 1
                shared += 1
        self.free_plain += shared
        self.n_lru -= left
        return new

    def release(self, hashes: list[int], n: int, private: int) -> None:
        """Drop a sequence's references to its first ``n`` blocks; tail blocks become the first
        eviction candidates."""
        cached, q = self.cached, self._q
        add = q.append
        stamp = self._base + len(q)
        first = stamp
        for h in reversed(hashes[:n]):
            r = cached[h]
            if r > 1:
                cached[h] = r - 1
            else:
                cached[h] = -stamp
                add(h)
                stamp += 1
        self.n_lru += stamp - first
        self.free_plain += private
        if len(q) - self._head > 2 * self.n_lru + self.slack:  # mostly stale: rebuild with fresh stamps
            self._compact()

    def _compact(self) -> None:
        keep = list(self.lru())
        base = self._base + len(self._q)
        cached = self.cached
        for j, h in enumerate(keep):
            cached[h] = -(base + j)
        self._q, self._base, self._head = keep, base, 0

    def clear(self) -> None:
        """Drop every unreferenced cached block, GPU and host (vLLM's reset_prefix_cache)."""
        meta = self.meta
        for h in list(self.lru()):
            del self.cached[h]
            if meta is not None:
                del meta[h]
        self.free_plain += self.n_lru
        self.n_lru = 0
        self._base += len(self._q)
        self._q, self._head = [], 0
        self.host.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())
