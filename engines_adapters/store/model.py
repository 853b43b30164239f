"""A Mooncake-style KV store, modelled: pure, synchronous, clock injected (every call takes ``now``).

Shared by the ``conductor sim-store`` service (real time, scaled), the engines' store connector in
the virtual-time simulator, and tests. What it models, after the Mooncake master and its Transfer
Engine (see docs/store.md for sources):

* store **nodes**, each with DRAM (and optionally SSD) capacity; an object is placed on
  ``replicas`` distinct nodes (the least used first: deterministic where the master picks at
  random); a put makes the object visible only when its transfer ends (the master's PutEnd);
* **leases**: ``get`` (and ``exists``, as the real client's ``is_exist``) leases the object for
  ``lease_ttl_s``; a leased object is never evicted (``OBJECT_HAS_LEASE``);
* **eviction** as the master does it: when a node's DRAM use passes ``high_watermark`` (0.90) the
  least recently used unleased objects are evicted until ``eviction_ratio`` (0.05) of its
  capacity is freed, and a put that finds no room evicts what it needs; with an SSD tier an
  evicted object moves to the node's SSD (``offload_on_evict``) and is evicted from there in turn;
* **bandwidth**: each node's link moves bytes at ``node_bytes_per_s`` for all transfers together
  (a fluid FIFO pipe: concurrent transfers share it), one transfer moves at most
  ``transfer_bytes_per_s``, and each operation pays ``op_latency_s`` first; SSD replicas are read
  at ``ssd_bytes_per_s``.

Keys are any hashable (engine key strings in the service, index hashes in the simulator).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

GIB = 1 << 30

#: Mooncake error codes (mooncake-store/include/types.h) the model answers with.
OBJECT_NOT_FOUND, OBJECT_ALREADY_EXISTS, OBJECT_HAS_LEASE = -704, -705, -706
NO_AVAILABLE_HANDLE = -200
ERROR_NAMES = {OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND", OBJECT_ALREADY_EXISTS: "OBJECT_ALREADY_EXISTS",
               OBJECT_HAS_LEASE: "OBJECT_HAS_LEASE", NO_AVAILABLE_HANDLE: "NO_AVAILABLE_HANDLE"}

MEDIUM_CPU, MEDIUM_DISK = "cpu", "disk"  # the master's KV-event ``medium`` values

# Public Transfer Engine figures (Mooncake README, "Performance"): 40 GB moved at up to 87 GB/s over
# 4 x 200 Gbps RoCE, "about 2.4x faster than the TCP protocol" -> about 36 GB/s over TCP on the same
# NICs. One transfer is capped at one NIC's share (87 / 4).
RDMA_NODE_BYTES_PER_S = 87e9
TCP_NODE_BYTES_PER_S = 87e9 / 2.4
RDMA_TRANSFER_BYTES_PER_S = 87e9 / 4


@dataclass(frozen=True, slots=True)
class StoreSpec:
    """A store cluster's shape and speeds (defaults: one node, RDMA figures, master defaults)."""

    nodes: int = 1
    dram_bytes: int = 64 * GIB  # per node
    ssd_bytes: int = 0  # per node (0: no SSD tier)
    replicas: int = 1
    node_bytes_per_s: float = RDMA_NODE_BYTES_PER_S
    transfer_bytes_per_s: float = RDMA_TRANSFER_BYTES_PER_S
    ssd_bytes_per_s: float = 6e9  # a PCIe 4.0 NVMe drive's sequential read, order of magnitude
    op_latency_s: float = 1e-4  # master RPC + transfer set-up per operation
    lease_ttl_s: float = 10.0  # mooncake_master --default_kv_lease_ttl=10000 (ms)
    high_watermark: float = 0.90  # --eviction_high_watermark_ratio
    eviction_ratio: float = 0.05  # --eviction_ratio

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.replicas < 1 or self.replicas > self.nodes:
            raise ValueError(f"need 1 <= replicas <= nodes, got replicas={self.replicas} nodes={self.nodes}")
        if self.dram_bytes <= 0 or self.ssd_bytes < 0:
            raise ValueError("dram_bytes must be positive and ssd_bytes >= 0")
        for name in ("node_bytes_per_s", "transfer_bytes_per_s", "ssd_bytes_per_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.op_latency_s < 0 or self.lease_ttl_s < 0:
            raise ValueError("op_latency_s and lease_ttl_s must be >= 0")
        if not (0 < self.high_watermark <= 1 and 0 < self.eviction_ratio <= 1):
            raise ValueError("high_watermark and eviction_ratio must be in (0, 1]")

    @classmethod
    def tcp(cls, **kw: object) -> "StoreSpec":
        """The Transfer Engine over TCP (what the non-CUDA pip package runs on this machine)."""
        return cls(node_bytes_per_s=TCP_NODE_BYTES_PER_S, transfer_bytes_per_s=TCP_NODE_BYTES_PER_S / 4,
                   **kw)  # type: ignore[arg-type]

    @property
    def capacity_bytes(self) -> int:
        return self.nodes * self.dram_bytes


class StoreError(Exception):
    """An operation the store refuses (too large, no room); ``code`` is Mooncake's error code."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code

    @property
    def name(self) -> str:
        return ERROR_NAMES.get(self.code, str(self.code))


@dataclass(slots=True)
class _Obj:
    size: int
    nodes: tuple[int, ...]
    medium: str  # cpu (DRAM) or disk (SSD)
    ready_at: float
    lease_until: float = 0.0


@dataclass(slots=True)
class PutResult:
    stored: list[Hashable] = field(default_factory=list)  # new objects (visible at done_at)
    existing: int = 0  # keys already stored (skipped, as HiCache does after batch_is_exist)
    failed: dict[Hashable, str] = field(default_factory=dict)
    done_at: float = 0.0


@dataclass(slots=True)
class GetResult:
    found: int = 0  # leading keys found (the first miss stops, as a prefix load does)
    bytes: int = 0
    done_at: float = 0.0


@dataclass(slots=True)
class Replica:
    node: int
    medium: str
    size: int


class StoreModel:
    """The store's objects, capacity, leases, eviction and links; see the module docstring."""

    def __init__(self, spec: StoreSpec | None = None, *, events: bool = False):
        self.spec = spec = spec if spec is not None else StoreSpec()
        self._objs: OrderedDict[Hashable, _Obj] = OrderedDict()  # LRU order: oldest use first
        # each node's DRAM objects in the same LRU order: an eviction on one node scans its own
        # objects, not every node's (the global scan went quadratic once a node's old objects
        # were gone and the least used node kept being picked)
        self._lru: list[OrderedDict[Hashable, None]] = [OrderedDict() for _ in range(spec.nodes)]
        self._used = [0] * spec.nodes  # DRAM bytes per node
        self._ssd_used = [0] * spec.nodes
        self._link_free = [0.0] * spec.nodes  # when each node's link has moved what it was given
        self.events: list[tuple[str, Hashable, str]] | None = [] if events else None  # (stored|removed, key, medium)
        self.counters: dict[str, int] = dict.fromkeys((
            "put_start_requests_total", "put_start_failures_total", "put_end_requests_total",
            "get_replica_list_requests_total", "exist_key_requests_total", "batch_exist_key_requests_total",
            "batch_exist_key_items_total", "remove_requests_total", "evicted_key_count", "evicted_size_bytes",
            "attempted_evictions_total", "successful_evictions_total", "get_hits_total", "get_misses_total"), 0)

    # --- reporting --------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._objs)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._objs

    def used_bytes(self, node: int | None = None) -> int:
        return sum(self._used) if node is None else self._used[node]

    def ssd_used_bytes(self) -> int:
        return sum(self._ssd_used)

    def keys(self) -> list[Hashable]:
        return list(self._objs)

    # --- writes -----------------------------------------------------------------------------
    def put(self, keys: Sequence[Hashable], sizes: Sequence[int], now: float) -> PutResult:
        """Store objects (skipping existing keys); refused ones are in ``failed`` with the reason.

        One transfer for the batch: it lands on each replica's node link; the objects become
        visible at ``done_at``."""
        if len(keys) != len(sizes):
            raise ValueError("keys and sizes differ in length")
        spec, out = self.spec, PutResult(done_at=now)
        per_node: dict[int, int] = {}
        total = 0
        full_at: int | None = None  # the smallest size no node could make room for in this batch
        exhausted: set[int] = set()  # nodes with nothing left to evict during this batch
        for key, size in zip(keys, sizes, strict=True):
            self.counters["put_start_requests_total"] += 1
            if key in self._objs:
                out.existing += 1
                continue
            if not isinstance(size, int) or size <= 0:
                out.failed[key] = f"object size must be a positive integer, got {size!r}"
                self.counters["put_start_failures_total"] += 1
                continue
            if size > spec.dram_bytes:
                out.failed[key] = (f"object of {size} bytes is larger than a store node's "
                                   f"{spec.dram_bytes} bytes of memory")
                self.counters["put_start_failures_total"] += 1
                continue
            # nothing becomes evictable during one batch: once a size found no room, a larger
            # one cannot either (without this, each such key rescans every object on every node)
            nodes = None if full_at is not None and size >= full_at else self._place(size, now, exhausted)
            if nodes is None:
                full_at = size if full_at is None else min(full_at, size)
                out.failed[key] = "store full: no node has room and every object is leased"
                self.counters["put_start_failures_total"] += 1
                continue
            for n in nodes:
                self._used[n] += size
                per_node[n] = per_node.get(n, 0) + size
            total += size
            # not visible nor evictable until its transfer ends (the master's PutEnd): a batch
            # larger than the free room must not evict its own earlier objects
            self._objs[key] = _Obj(size, nodes, MEDIUM_CPU, ready_at=float("inf"))
            for n in nodes:
                self._lru[n][key] = None
            out.stored.append(key)
        if total:
            out.done_at = self._transfer(per_node, total, now, spec.transfer_bytes_per_s)
            for key in out.stored:
                self._objs[key].ready_at = out.done_at
                self.counters["put_end_requests_total"] += 1
                if self.events is not None:
                    self.events.append(("stored", key, MEDIUM_CPU))
            for n in per_node:
                self._watermark(n, now)
        return out

    def remove(self, key: Hashable, now: float, force: bool = False) -> int:
        """0, or OBJECT_NOT_FOUND / OBJECT_HAS_LEASE (as the client's ``remove``)."""
        self.counters["remove_requests_total"] += 1
        o = self._objs.get(key)
        if o is None:
            return OBJECT_NOT_FOUND
        if not force and o.lease_until > now:
            return OBJECT_HAS_LEASE
        self._drop(key, o)
        return 0

    # --- reads ------------------------------------------------------------------------------
    def exists(self, keys: Sequence[Hashable], now: float, lease: bool = True) -> list[bool]:
        """Per key: stored and visible (its put has ended). Leases what it finds, as ``is_exist``."""
        c = self.counters
        c["batch_exist_key_requests_total"] += 1
        c["batch_exist_key_items_total"] += len(keys)
        out = []
        ttl = now + self.spec.lease_ttl_s
        for k in keys:
            o = self._objs.get(k)
            ok = o is not None and o.ready_at <= now
            if ok and lease:
                o.lease_until = max(o.lease_until, ttl)  # type: ignore[union-attr]
            out.append(ok)
        return out

    def prefix(self, keys: Sequence[Hashable], now: float) -> int:
        """Leading keys visible now, without leasing (a router's look, like /batch_query_keys)."""
        objs = self._objs
        n = 0
        for k in keys:
            o = objs.get(k)
            if o is None or o.ready_at > now:
                break
            n += 1
        return n

    def query(self, key: Hashable, now: float) -> list[Replica] | None:
        """Replicas of a visible object (no lease, no LRU touch); None when absent."""
        o = self._objs.get(key)
        if o is None or o.ready_at > now:
            return None
        return [Replica(n, o.medium, o.size) for n in o.nodes]

    def get(self, keys: Sequence[Hashable], now: float) -> GetResult:
        """Read the leading visible keys (the first miss stops): lease them, touch them in the LRU,
        and model the transfer; a get of nothing costs nothing."""
        self.counters["get_replica_list_requests_total"] += 1
        out = GetResult(done_at=now)
        per_node: dict[int, int] = {}
        ssd = 0
        ttl = now + self.spec.lease_ttl_s
        for k in keys:
            o = self._objs.get(k)
            if o is None or o.ready_at > now:
                break
            o.lease_until = max(o.lease_until, ttl)
            self._objs.move_to_end(k)
            if o.medium == MEDIUM_CPU:
                for m in o.nodes:
                    self._lru[m].move_to_end(k)
            n = min(o.nodes, key=lambda x: self._link_free[x])  # the least busy replica
            per_node[n] = per_node.get(n, 0) + o.size
            out.bytes += o.size
            if o.medium == MEDIUM_DISK:
                ssd += o.size
            out.found += 1
        self.counters["get_hits_total"] += out.found
        self.counters["get_misses_total"] += 1 if out.found < len(keys) else 0
        if out.bytes:
            cap = self.spec.transfer_bytes_per_s
            out.done_at = self._transfer(per_node, out.bytes, now, cap)
            if ssd:  # SSD replicas are read first at the drive's speed
                out.done_at = max(out.done_at, now + self.spec.op_latency_s + ssd / self.spec.ssd_bytes_per_s)
        return out

    # --- internals --------------------------------------------------------------------------
    def _transfer(self, per_node: dict[int, int], total: int, now: float, cap: float) -> float:
        """When a transfer of ``per_node`` bytes ends: its own rate cap, and each node's shared link."""
        spec = self.spec
        start = now + spec.op_latency_s
        done = start + total / cap
        for n, b in per_node.items():
            free = max(self._link_free[n], start) + b / spec.node_bytes_per_s
            self._link_free[n] = free
            done = max(done, free)
        return done

    def _place(self, size: int, now: float, exhausted: set[int]) -> tuple[int, ...] | None:
        """``replicas`` distinct nodes with room for ``size`` (evicting there if needed).
        ``exhausted``: nodes where an eviction of this batch found nothing more to free (nothing
        becomes evictable during one batch, so they are not rescanned)."""
        spec = self.spec
        order = sorted(range(spec.nodes), key=lambda n: self._used[n])
        chosen: list[int] = []
        for n in order:
            if self._used[n] + size > spec.dram_bytes and n not in exhausted:
                need = self._used[n] + size - spec.dram_bytes
                if self._evict(n, need, now) < need:
                    exhausted.add(n)
            if self._used[n] + size <= spec.dram_bytes:
                chosen.append(n)
                if len(chosen) == spec.replicas:
                    return tuple(chosen)
        return None

    def _watermark(self, node: int, now: float) -> None:
        spec = self.spec
        if self._used[node] > spec.high_watermark * spec.dram_bytes:
            target = self._used[node] - spec.high_watermark * spec.dram_bytes
            self._evict(node, max(target, spec.eviction_ratio * spec.dram_bytes), now)

    def _evict(self, node: int, nbytes: float, now: float) -> int:
        """Free at least ``nbytes`` of DRAM on ``node``: least recently used unleased objects first.
        Returns the bytes freed there (less than asked: nothing else is evictable now)."""
        c = self.counters
        c["attempted_evictions_total"] += 1
        freed = 0
        victims = []
        objs = self._objs
        for k in self._lru[node]:
            if freed >= nbytes:
                break
            o = objs[k]
            if o.lease_until <= now and o.ready_at <= now:
                victims.append((k, o))
                freed += o.size
        for k, o in victims:
            c["evicted_key_count"] += 1
            c["evicted_size_bytes"] += o.size
            if self.spec.ssd_bytes and self._to_ssd(k, o, now):
                continue
            self._drop(k, o)
        if victims:
            c["successful_evictions_total"] += 1
        return freed

    def _to_ssd(self, key: Hashable, o: _Obj, now: float) -> bool:
        """Offload an evicted object to its first node's SSD, evicting older SSD objects for room."""
        spec, n = self.spec, o.nodes[0]
        if o.size > spec.ssd_bytes:
            return False
        if self._ssd_used[n] + o.size > spec.ssd_bytes:
            for k2, o2 in list(self._objs.items()):
                if self._ssd_used[n] + o.size <= spec.ssd_bytes:
                    break
                if o2.medium == MEDIUM_DISK and o2.nodes[0] == n and o2.lease_until <= now:
                    self._drop(k2, o2)
        if self._ssd_used[n] + o.size > spec.ssd_bytes:
            return False
        for m in o.nodes:
            self._used[m] -= o.size
        self._ssd_used[n] += o.size
        for m in o.nodes:
            del self._lru[m][key]
        o.nodes, o.medium = (n,), MEDIUM_DISK
        if self.events is not None:
            self.events.append(("removed", key, MEDIUM_CPU))
            self.events.append(("stored", key, MEDIUM_DISK))
        return True

    def _drop(self, key: Hashable, o: _Obj) -> None:
        del self._objs[key]
        if o.medium == MEDIUM_CPU:
            for n in o.nodes:
                self._used[n] -= o.size
                del self._lru[n][key]
        else:
            self._ssd_used[o.nodes[0]] -= o.size
        if self.events is not None:
            self.events.append(("removed", key, o.medium))

    def metrics(self) -> dict[str, float]:
        """The master's metric names (``master_`` prefix added by the exposition)."""
        out: dict[str, float] = {f"{k}": v for k, v in self.counters.items()}
        out.update(key_count=len(self._objs), allocated_bytes=sum(self._used),
                   total_capacity_bytes=self.spec.capacity_bytes, nof_allocated_bytes=sum(self._ssd_used),
                   total_file_capacity_bytes=self.spec.nodes * self.spec.ssd_bytes)
        return out
