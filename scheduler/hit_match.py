"""The hit map's lookups (scheduler/hit_index.py): the longest prefix of a request's blocks each
instance holds, per tier, and the shared store's, over the index's tables as they are.

Functions of the tables (one dict per tier from index hash to a bitmask of instance slots, the
slots' ids, the mask of registered slots, the store tier's linked runs), so the walk reads no
other state; :class:`~scheduler.hit_index.HitIndex` ``match`` and ``match_held`` call them.
"""
from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import accumulate, repeat
from operator import and_, neg, or_

from scheduler.prefix_runs import HeldPrefixes

#: The index's tier tables (device, host, store): index block hash -> mask of holder slots.
Tiers = tuple[dict[int, int], dict[int, int], dict[int, int]]

_FIRST_CHUNK = 16  # blocks looked up before the first check that anyone still matches


@dataclass(slots=True)
class Match:
    """Longest contiguous prefix per instance, in blocks, stopping at the first miss.

    ``device``: on the instance's device; ``local``: on its device or host memory (so
    ``local >= device``); ``store``: in the shared store. Instances with no hit are absent.
    """

    device: dict[str, int] = field(default_factory=dict)
    local: dict[str, int] = field(default_factory=dict)
    store: int = 0


def longest_prefixes(tiers: Tiers, registered: int, ids: list[str | None], store_runs: HeldPrefixes,
                      hashes: list[int], limit: int | None = None, store: bool = True) -> Match:
    """Longest contiguous prefix (in blocks) per instance and in the store, first miss stops.

    ``store=False``: leave the store tier alone (``Match.store`` 0): the caller knows the
    store's answer from the store itself (the gateway's live store tier), which the engines'
    store-medium events only echo.

    ``limit`` caps the blocks looked at (an engine never reuses the block holding the
    prompt's last token, so the scheduler passes ``(prompt_tokens - 1) // block_size``).
    The walk runs in C over chunks of growing size: look the chunk up in the tier dicts
    (``map``), AND the holder masks cumulatively (``accumulate``), and since a running AND
    of bitmasks never increases, find where holders drop out by bisection. A lookup into a
    1M-entry dict is a few cache misses (~0.25 us), so the second tier is looked up only
    from where the first tier's run of some live holder ends: while every live holder still
    holds the blocks in the tier looked up first (the device; the host tier once no live
    holder has a device run), their local run moves with it.
    """
    n = len(hashes) if limit is None else max(0, min(limit, len(hashes)))
    dev, host, stored = tiers
    out = Match()
    if n and (dev or host):
        ids = ids
        alive_l = alive_d = registered
        dget, hget = dev.get, host.get
        for start, end in _chunks(n):
            if not alive_l:
                break
            chunk = hashes[start:end]
            if not host:
                d = list(map(dget, chunk, repeat(0, end - start)))
                alive_l = alive_d = _scan(list(accumulate(d, and_, initial=alive_d)), start, out.device, ids)
            elif alive_l == alive_d or not alive_d:  # one tier first, the other where its run ends
                first, other = (dget, hget) if alive_d else (hget, dget)
                f = list(map(first, chunk, repeat(0, end - start)))
                acc = list(accumulate(f, and_, initial=alive_l))
                if acc[-1] != alive_l:
                    k = _first_drop(acc) - 1  # block start + k: the first some live holder lacks there
                    loc = map(or_, f[k:], map(other, chunk[k:], repeat(0, end - start - k)))
                    alive_l_next = _scan(list(accumulate(loc, and_, initial=alive_l)), start + k, out.local, ids)
                    if alive_d:
                        alive_d = _scan(acc, start, out.device, ids)
                    alive_l = alive_l_next
            else:  # some live holders on device, others only local: both tiers throughout
                d = list(map(dget, chunk, repeat(0, end - start)))
                both = map(or_, d, map(hget, chunk, repeat(0, end - start)))
                alive_l = _scan(list(accumulate(both, and_, initial=alive_l)), start, out.local, ids)
                alive_d = _scan(list(accumulate(d, and_, initial=alive_d)), start, out.device, ids)
        if alive_d:
            _record(out.device, alive_d, n, ids)
        if host:
            if alive_l:
                _record(out.local, alive_l, n, ids)
        else:
            out.local = dict(out.device)
    if n and store and stored:
        contains = stored.__contains__
        start = store_runs.known(hashes, n)  # linked runs by bisection, then the walk
        step = 2 if start else _FIRST_CHUNK
        while start < n:
            end = min(n, start + step)
            step *= 2
            flags = list(map(contains, hashes[start:end]))
            if not all(flags):
                start += flags.index(False)
                break
            start = end
        out.store = min(start, n)
    return out


def held_prefixes(tiers: Tiers, registered: int, ids: list[str | None], hashes: list[int],
                  limit: int | None = None) -> dict[str, int]:
    """Per instance, the longest prefix (blocks) it holds in any tier: its device, its host
    memory, or blocks its own KV events announced as written to the shared store. The
    indexer API's per-instance ``CPU`` answer (a Mooncake store is pooled host DRAM); the
    scheduler uses :func:`longest_prefixes`, where the store is everyone's."""
    n = len(hashes) if limit is None else max(0, min(limit, len(hashes)))
    out: dict[str, int] = {}
    dget, hget, sget = (t.get for t in tiers)
    alive = registered
    for start, end in _chunks(n):
        if not alive:
            break
        chunk = hashes[start:end]
        local = map(or_, map(dget, chunk, repeat(0)), map(hget, chunk, repeat(0)))
        held = map(or_, local, map(sget, chunk, repeat(0)))
        alive = _scan(list(accumulate(held, and_, initial=alive)), start, out, ids)
    if alive:
        _record(out, alive, n, ids)
    return out


def _chunks(n: int) -> Iterator[tuple[int, int]]:
    """``(start, end)`` of the growing chunks a walk over ``n`` blocks takes: a miss near the
    front costs a short chunk, a long hit few round trips into C."""
    start, step = 0, _FIRST_CHUNK
    while start < n:
        end = min(n, start + step)
        yield start, end
        start, step = end, step * 2


def _first_drop(acc: list[int]) -> int:
    """The first k with ``acc[k] < acc[0]`` (``acc`` a running AND: it never increases)."""
    return bisect_right(acc, -acc[0], key=neg)


def _scan(acc: list[int], offset: int, out: dict[str, int], ids: list[str | None]) -> int:
    """Record holders whose run ends inside a chunk; return who is still alive after it.

    ``acc[k]`` is the set of holders alive after the chunk's first k blocks (a running AND, so
    it never increases as an integer): where it drops is found by bisection, not by a loop.
    """
    cur, last = acc[0], acc[-1]
    lo = 0
    while cur != last:
        k = bisect_right(acc, -cur, lo, key=neg)  # first k with acc[k] < cur
        length = offset + k - 1  # block offset + k - 1 was the first miss
        if length:
            _record(out, cur & ~acc[k], length, ids)
        cur, lo = acc[k], k
    return last


def _record(out: dict[str, int], mask: int, length: int, ids: list[str | None]) -> None:
    """Set ``out[id] = length`` for every slot in ``mask``."""
    while mask:
        low = mask & -mask
        out[ids[low.bit_length() - 1]] = length  # type: ignore[index]  # a set bit is a live slot: never None
        mask ^= low
