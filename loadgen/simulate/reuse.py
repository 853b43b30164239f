"""The trace's prefix reuse bound for a cluster's cache capacity: what a policy could at best reuse.

One global LRU cache of the cluster's total prefill KV capacity, fed every prompt in arrival
order, counting the contiguous cached prefix of each (complete blocks, never the block holding
the prompt's last token, as engines do). A placement policy spreads prompts over per-instance
caches and pays for replicas, so it reaches at most about this; the infinite-cache figure is the
trace's own reuse. Hit ratios are cached prompt tokens over prompt tokens, the figure the
engines report.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Iterator
from dataclasses import replace
from typing import Any

from engines_adapters.tokenizer import ByteTokenizer
from predictors.telemetry import RequestRecord
from scheduler.hashing import block_hashes

from ..prompts import ChatFraming, PromptSynth
from ..workload import Workload
from .run import prompt_tokens


def prompt_blocks(workload: Workload, block_size: int, endpoint: str = "chat",
                  salt: str = "sim") -> Iterator[tuple[int, list[int]]]:
    """(prompt tokens, chained block hashes) of each request in order, as the simulated engines
    see them (``salt``: the simulator's, ``sim-<seed>``)."""
    synth, framing, tok = PromptSynth(workload.block_tokens, salt), ChatFraming.of(), ByteTokenizer()
    for req in workload.requests:
        tokens = prompt_tokens(req, synth, framing, endpoint, tok)
        yield len(tokens), block_hashes(tokens, block_size)


def reuse_bound(workload: Workload, block_size: int, capacity_tokens: int, endpoint: str = "chat",
                salt: str = "sim") -> dict[str, Any]:
    total, hit_lru, hit_inf = _replay(prompt_blocks(workload, block_size, endpoint, salt), block_size, capacity_tokens)
    return {"capacity_tokens": capacity_tokens, "block_size": block_size,
            "lru_hit_ratio": hit_lru / total if total else None,
            "infinite_hit_ratio": hit_inf / total if total else None}


def served_bound(workload: Workload, served: Collection[int], block_size: int, capacity_tokens: int,
                 endpoint: str = "chat", salt: str = "sim") -> tuple[int, int]:
    """(prompt tokens, LRU-cached prompt tokens) of the global LRU fed only the ``served`` requests
    (by index): what a policy that completed just those could at best have reused. Under overload no
    policy prefills the whole trace, and a refused request leaves nothing behind for its followers,
    so the trace's bound overstates what the requests a policy served offered it."""
    keep = set(served)
    sub = replace(workload, requests=[r for r in workload.requests if r.index in keep])
    total, hit_lru, _ = _replay(prompt_blocks(sub, block_size, endpoint, salt), block_size, capacity_tokens)
    return total, hit_lru


def completed(records: Iterable[RequestRecord]) -> set[int]:
    """The trace indices of the requests a simulated run completed (the set its hit ratio is over)."""
    return {int(r.extra["trace_index"]) for r in records if r.status == "ok" and "trace_index" in r.extra}


def _replay(prompts: Iterable[tuple[int, list[int]]], block_size: int, capacity_tokens: int) -> tuple[int, int, int]:
    """(prompt tokens, LRU hit tokens, unbounded hit tokens) of the prompts fed in order."""
    cap = max(1, capacity_tokens // block_size)
    lru: OrderedDict[int, None] = OrderedDict()
    seen: set[int] = set()
    total = hit_lru = hit_inf = 0
    for n_tokens, hashes in prompts:
        usable = min(len(hashes), (n_tokens - 1) // block_size)
        total += n_tokens
        k = 0
        while k < usable and hashes[k] in lru:
            k += 1
        hit_lru += k * block_size
        j = 0
        while j < usable and hashes[j] in seen:
            j += 1
        hit_inf += j * block_size
        for h in hashes:  # the prompt's blocks are now the most recently used
            lru[h] = None
            lru.move_to_end(h)
            seen.add(h)
        while len(lru) > cap:
            lru.popitem(last=False)
    return total, hit_lru, hit_inf
