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
from collections.abc import Iterator
from typing import Any

from engines_adapters.tokenizer import ByteTokenizer
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
    cap = max(1, capacity_tokens // block_size)
    lru: OrderedDict[int, None] = OrderedDict()
    seen: set[int] = set()
    total = hit_lru = hit_inf = 0
    for n_tokens, hashes in prompt_blocks(workload, block_size, endpoint, salt):
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
    return {"capacity_tokens": capacity_tokens, "block_size": block_size,
            "lru_hit_ratio": hit_lru / total if total else None,
            "infinite_hit_ratio": hit_inf / total if total else None}
