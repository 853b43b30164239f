"""Decision latency the store tier adds (events mode): one lookup per request against a store
holding ~100k blocks, as the gateway's proxy runs it (``StoreTier.lookup``).

Workload: conversations whose turns extend the previous turn's prompt (the Mooncake
conversation shape); every turn's blocks are in the store (its prefill wrote them through) and
the gateway has seen the earlier turns (its digest memo is warm up to them). Three cases are
timed separately: a follow-up turn (resident prefix, memo warm except the new blocks), a new
conversation whose prompt the store lacks (a miss at the first block), and a resident prefix the
gateway has never seen (memo cold: every resident block is hashed once, the worst case).

Usage: .venv/bin/python bench/store_lookup.py [--blocks 100000] [--requests 2000]
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engines_adapters.store.keys import KeyBook  # noqa: E402
from gateway.config import StoreConfig  # noqa: E402
from gateway.store_tier import StoreTier  # noqa: E402
from scheduler.hashing import block_hashes  # noqa: E402

BS = 16
MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=100_000, help="blocks resident in the store")
    ap.add_argument("--requests", type=int, default=2000, help="timed lookups per case")
    ap.add_argument("--turn-tokens", type=int, default=1024, help="new tokens per conversation turn")
    a = ap.parse_args()
    rng = random.Random(0)
    tier = StoreTier(StoreConfig(url="http://127.0.0.1:1", kv_events="tcp://127.0.0.1:1", model=MODEL), BS, MODEL)
    tier.stale = False  # no store process: the resident set is filled here as the events would
    store_book = KeyBook(tier.recipe)  # the engines' side: what they wrote

    convs: list[list[int]] = []  # each conversation's prompt so far
    t = time.perf_counter()
    while len(tier.resident) < a.blocks:  # turn by turn: the gateway looks it up, then the engine writes it
        if not convs or rng.random() < 0.3:
            convs.append([])
            c = convs[-1]
        else:
            c = rng.choice(convs)
        c += [rng.randrange(1000, 30000) for _ in range(a.turn_tokens)]
        h = block_hashes(c, BS)
        await tier.lookup(c, h, len(h))
        await asyncio.sleep(0)
        tier.resident.update(store_book.digests(c, h))
    print(f"store: {len(tier.resident):,} resident blocks, {len(convs):,} conversations "
          f"(built in {time.perf_counter() - t:.1f} s)")

    sizes: list[int] = []

    async def timed(make) -> list[float]:
        out = []
        sizes.clear()
        for _ in range(a.requests):
            tokens = make()
            hashes = block_hashes(tokens, BS)
            usable = min(len(hashes), (len(tokens) - 1) // BS)
            t0 = time.perf_counter()
            await tier.lookup(tokens, hashes, usable)
            out.append(time.perf_counter() - t0)
            sizes.append(usable)
            await asyncio.sleep(0)  # the deferred memo warm-up runs between requests, as in the gateway
        return out

    def follow_up() -> list[int]:
        c = rng.choice(convs)
        return c + [rng.randrange(1000, 30000) for _ in range(a.turn_tokens)]

    def novel() -> list[int]:
        return [rng.randrange(1000, 30000) for _ in range(rng.choice((1, 2, 4)) * a.turn_tokens)]

    def unseen_prefix() -> list[int]:
        tier.book._memo.clear()  # the gateway restarted, say: nothing remembered
        tier._held_idx.clear()
        tier._idx_of.clear()
        return rng.choice(convs)[:] + [1, 2, 3]

    import gc
    gc.collect()
    gc.freeze()  # as the gateway does after start-up
    for name, make in (("follow-up turn (memo warm)", follow_up), ("new prompt (first block misses)", novel),
                       ("resident prefix never seen (memo cold)", unseen_prefix)):
        xs = await timed(make)
        slowest = sorted(range(len(xs)), key=xs.__getitem__)[-len(xs) // 100:]
        print(f"{name:<40} p50 {pct(xs, 0.5):.3f} ms  p99 {pct(xs, 0.99):.3f} ms  "
              f"mean {statistics.mean(xs) * 1e3:.3f} ms  ({len(xs)} lookups; prompt blocks p50 "
              f"{sorted(sizes)[len(sizes) // 2]}, max {max(sizes)}; the slowest 1% average "
              f"{statistics.mean(sizes[i] for i in slowest):.0f} blocks)")
    print("target: <= 0.2 ms p99 added per decision (events path, 100k blocks); machine shared by other jobs")


if __name__ == "__main__":
    asyncio.run(main())
