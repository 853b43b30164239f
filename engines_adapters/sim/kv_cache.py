"""The simulated engine's KV block pool: prefix cache with LRU eviction and an optional host tier.

Accounting is by counts, not block ids: a block is either *plain* (free, no content), *private*
to one sequence (its partial tail; counted only in that sequence's ``n_alloc``), or *cached*: a
full block named by its chained hash, shared by reference count, and evictable (in the LRU) when
no sequence references it. A sequence's full blocks are always cached ones: when a sequence
fills a block whose hash is already cached it switches to the cached block and returns its own.

Usage follows vLLM: ``1 - (plain + evictable) / capacity``.

Host tier (capacity in blocks, 0 = off): a block evicted from the GPU is offloaded to host memory
(its own LRU); a prefix that continues in the host tier can be loaded back at the host bandwidth.

KV events (vLLM wire structs) are appended to ``events`` when it is a list; the engine fills in
the vLLM hash ints (``vh``) of the blocks it stores.
"""
from __future__ import annotations

from collections import OrderedDict

from ..kv_wire import MEDIUM_CPU, MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored


class Block:
    """One full, hashed KV block. ``h``: fast index hash; ``vh``/``vdigest``: vLLM ids (events)."""

    __slots__ = ("h", "ref", "vh", "vdigest", "parent_vh", "tokens")

    def __init__(self, h: int):
        self.h = h
        self.ref = 0
        self.vh: int | None = None
        self.vdigest: bytes | None = None
        self.parent_vh: int | None = None
        self.tokens: tuple[int, ...] | None = None


class KVCache:
    def __init__(self, capacity_blocks: int, block_size: int, host_blocks: int = 0, events: bool = False):
        if capacity_blocks <= 0:
            raise ValueError(f"KV capacity must be at least one block, got {capacity_blocks}")
        self.capacity = capacity_blocks
        self.block_size = block_size
        self.free_plain = capacity_blocks
        self.cached: dict[int, Block] = {}
        self.lru: OrderedDict[int, Block] = OrderedDict()
        self.host_capacity = max(0, host_blocks)
        self.host: OrderedDict[int, Block] = OrderedDict()
        self.events: list | None = [] if events else None
        self.evictions = 0
        self.offloads = 0

    # --- capacity ---------------------------------------------------------------------------
    def num_free(self) -> int:
        return self.free_plain + len(self.lru)

    def usage(self) -> float:
        return 1.0 - self.num_free() / self.capacity

    def alloc(self, n: int) -> bool:
        """Take ``n`` blocks (plain first, then evicting the least recently used)."""
        if n > self.free_plain + len(self.lru):
            return False
        take = n if n <= self.free_plain else self.free_plain
        self.free_plain -= take
        for _ in range(n - take):
            self._evict_lru()
        return True

    def _evict_lru(self) -> None:
        h, b = self.lru.popitem(last=False)
        del self.cached[h]
        self.evictions += 1
        if self.events is not None and b.vh is not None:
            self._removed(b.vh, MEDIUM_GPU)
        if self.host_capacity:
            self._offload(b)

    def _offload(self, b: Block) -> None:
        host = self.host
        if b.h in host:
            host.move_to_end(b.h)
            return
        host[b.h] = b
        self.offloads += 1
        if self.events is not None and b.vh is not None:
            self.events.append(BlockStored(block_hashes=[b.vh], parent_block_hash=b.parent_vh,
                                           token_ids=list(b.tokens or ()), block_size=self.block_size,
                                           lora_id=None, medium=MEDIUM_CPU, lora_name=None))
        if len(host) > self.host_capacity:
            _, old = host.popitem(last=False)
            if self.events is not None and old.vh is not None:
                self._removed(old.vh, MEDIUM_CPU)

    def _removed(self, vh: int, medium: str) -> None:
        ev = self.events
        last = ev[-1] if ev else None
        if type(last) is BlockRemoved and last.medium == medium:
            last.block_hashes.append(vh)
        else:
            ev.append(BlockRemoved(block_hashes=[vh], medium=medium))

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

    def acquire(self, hashes: list[int], n: int) -> list[Block]:
        """Reference the first ``n`` cached blocks of a prefix (they leave the LRU)."""
        out = []
        cached, lru = self.cached, self.lru
        for h in hashes[:n]:
            b = cached[h]
            if b.ref == 0:
                del lru[h]
            b.ref += 1
            out.append(b)
        return out

    def commit(self, h: int) -> tuple[Block, bool]:
        """A sequence's private block just filled with content ``h``: cache it, or share the
        existing block with that content (returning the private block to the pool).
        Returns ``(block, is_new)``."""
        b = self.cached.get(h)
        if b is None:
            b = Block(h)
            b.ref = 1
            self.cached[h] = b
            return b, True
        if b.ref == 0:
            del self.lru[h]
        b.ref += 1
        self.free_plain += 1
        return b, False

    def commit_many(self, hashes: list[int], out: list[Block]) -> list[int]:
        """``commit`` for a run of filled blocks (a prefill chunk commits hundreds at once):
        appends each block to ``out``; returns the offsets of the newly cached ones."""
        cached, lru = self.cached, self.lru
        new: list[int] = []
        shared = 0
        for i, h in enumerate(hashes):
            b = cached.get(h)
            if b is None:
                b = cached[h] = Block(h)
                b.ref = 1
                new.append(i)
            else:
                if b.ref == 0:
                    del lru[h]
                b.ref += 1
                shared += 1
            out.append(b)
        self.free_plain += shared
        return new

    def release(self, blocks: list[Block], private: int) -> None:
        """Drop a sequence's references; tail blocks become the first eviction candidates."""
        lru = self.lru
        for b in reversed(blocks):
            b.ref -= 1
            if b.ref == 0:
                lru[b.h] = b
        self.free_plain += private

    def clear(self) -> None:
        """Drop every unreferenced cached block, GPU and host (vLLM's reset_prefix_cache)."""
        for h in list(self.lru):
            del self.cached[h]
        self.free_plain += len(self.lru)
        self.lru.clear()
        self.host.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())
