"""KV a simulated engine loads before computing, and the store's write-through: a pull of the
prompt's KV from the remote prefill instance (one NIC, FIFO), prefix blocks from the host tier (its
link, FIFO) and from the shared store (as the store connector, or the driver's lookup, modelled
it), and the timers that finish those loads. Functions of the
:class:`~engines_adapters.sim.model.EngineModel` whose queues and counters they update; its step
calls them.
"""
from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from .records import StepResult
from .sequence import LOAD_HOST, LOAD_REMOTE, LOADING, WAITING, Seq

if TYPE_CHECKING:
    from .model import EngineModel

#: what :func:`lookup` found for the waiting head
LOOKUP_READY, LOOKUP_LOADING, LOOKUP_BLOCKED = range(3)


def lookup(e: EngineModel, s: Seq, now: float) -> int:
    """Prefix-cache lookup for the waiting head: it is ready to compute (LOOKUP_READY), left for a
    KV load (LOOKUP_LOADING), or cannot get blocks for its load (LOOKUP_BLOCKED)."""
    kv = e.kv
    bs = e.block_size
    limit = (s.num_tokens - 1) // bs
    if len(s.hashes) < limit:
        limit = len(s.hashes)
    g = kv.acquire_prefix(s.hashes, limit)  # the hits are referenced at once (both paths keep them)
    remote = s.remote_kv and not s.remote_done
    # a remote pull brings everything beyond the device hits: host copies are not used (nor counted)
    hh = kv.match_host(s.hashes, g, limit) if kv.host_capacity and not remote else 0
    sb, store_ready = (0, now) if remote else store_lookup(e, s, g + hh, limit, now)
    if remote or hh or sb:
        need = (-(-s.P // bs) - g) if remote else hh + sb
        if not kv.alloc(need):
            kv.release(s.hashes, g, 0)
            return LOOKUP_BLOCKED
        e._waiting.popleft()
        s.nb = g
        s.n_alloc = g + need
        s.cap = s.n_alloc * bs
        s.computed = g * bs
        s.looked_up = True
        s.state = LOADING
        if remote:
            nbytes = (s.P - g * bs) * e._kv_bytes
            start = max(now, e._net_free_at)
            e._net_free_at = start + nbytes / e.net_bytes_per_s
            ready = e._net_free_at + e.transfer_latency_s
            s.load_kind = LOAD_REMOTE
        else:  # the host-tier part at host bandwidth, the store part as the store modelled it
            ready = store_ready
            if hh:
                start = max(now, e._host_free_at)
                e._host_free_at = start + hh * bs * e._kv_bytes / e.host_bytes_per_s
                ready = max(ready, e._host_free_at)
            s.load_kind = LOAD_HOST
        s.load_hits = (g, hh + sb)
        s.load_start = now
        e.prefix_queries += s.num_tokens
        e.prefix_hits += (g + hh + sb) * bs
        e.host_hits += hh * bs
        if sb:
            s.store_loaded += sb
            e.store_hits += sb * bs
            e.store_loads += 1
            e.store_load_s += store_ready - now
        if s.scheduled is None:
            s.scheduled = now
        heapq.heappush(e._loading, (ready, next(e._tie), s))
        return LOOKUP_LOADING
    s.nb = g
    s.n_alloc = g
    s.cap = g * bs
    s.computed = g * bs
    s.looked_up = True
    s.lookup_hits = g * bs
    return LOOKUP_READY


def store_lookup(e: EngineModel, s: Seq, start: int, limit: int, now: float) -> tuple[int, float]:
    """Blocks beyond ``start`` to load from the shared store, and when the load ends."""
    if start >= limit:
        return 0, now
    if e.store is not None:
        return e.store.lookup(s.hashes, start, limit, now)
    have = min(s.store_blocks, limit)
    if have <= start or s.store_fetched <= 0:
        return 0, now
    sb = have - start  # the engine's own prefix may have grown since the store was asked
    return sb, now + s.store_load_s * min(1.0, sb / s.store_fetched)


def write_through(e: EngineModel, first: list[Seq], end: float, res: StepResult) -> None:
    """Prompts just prefilled here go to the store (not a pulled one: its prefill side writes)."""
    bs = e.block_size
    for s in first:
        n = s.P // bs
        if s.remote_kv or n == 0:
            continue
        if e.store is not None:  # keyed by the namespaced chain: tenants never share
            e.store.write(s.hashes, n, end)
        else:  # the live connector folds the namespace into its keys as the engine's recipe does
            res.store_writes.append((s.rid, s.prompt[:n * bs], s.hashes[:n], s.salt, s.lora))


def run_timers(e: EngineModel, now: float, res: StepResult) -> None:
    loaded: list[Seq] = []
    while e._loading and e._loading[0][0] <= now:
        ready, _, s = heapq.heappop(e._loading)
        if s.state != LOADING:
            continue  # aborted while loading
        g, hh = s.load_hits
        if s.load_kind == LOAD_REMOTE:
            s.remote_done = True
            s.computed = s.P - 1
            res.kv_loaded.append(s.rid)
        else:
            for h in s.hashes[g:g + hh]:
                if h in e.kv.host:
                    e.kv.host.move_to_end(h)
            s.computed = (g + hh) * e.block_size
        if s.cached_tokens < 0:
            s.cached_tokens = s.computed
        s.transfer_s += ready - s.load_start
        e._commit(s, s.computed // e.block_size)
        s.state = WAITING
        s.loaded = True
        loaded.append(s)
    if loaded:
        e._waiting.extendleft(reversed(loaded))
    order = e._held_order
    while order and order[0][0] <= now:
        t, rid = order.popleft()
        held = e._held.get(rid)
        if held is not None and held.hold_expires == t:
            e.release_kv(rid)
            res.expired.append(rid)
