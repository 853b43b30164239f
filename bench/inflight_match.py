"""The in-flight prefix registry's lookup against how many registrations share a prompt's first
block (scheduler/inflight.py). A conversation trace puts hundreds of requests in flight behind one
system prompt; a lookup that asked each of them grew with their number (~0.4 ms at the simulated
8P+8D conversation point), one that probes a count of block hashes per instance should not.

Registers N requests of ``--blocks`` blocks sharing their first block over ``--instances`` instances,
then times ``match`` for a prompt sharing half of one of them, and ``add`` + ``drop`` of one more.
Prints one JSON line per N with microseconds per call (``perf_counter_ns``; figures from a shared
machine: read the ratio of the largest N to the smallest, measured in the same run).

Run: ``.venv/bin/python bench/inflight_match.py [--blocks 40] [--instances 8] [--calls 2000]``
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler.inflight import InflightPrefixes  # noqa: E402


def world(n: int, blocks: int, instances: int) -> InflightPrefixes:
    reg = InflightPrefixes()
    for k in range(n):
        reg.add(f"r{k}", f"p{k % instances}", [1, *(10_000 * (k + 1) + j for j in range(blocks - 1))])
    return reg


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    t = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - t) / calls / 1000


def measure(n: int, a: argparse.Namespace) -> dict[str, float]:
    """Microseconds per ``match`` and per ``add`` + ``drop`` with ``n`` registrations in flight."""
    reg = world(n, a.blocks, a.instances)
    k = n // 2  # a prompt sharing the first half of registration k's blocks, then its own
    prompt = [1, *(10_000 * (k + 1) + j for j in range(a.blocks // 2)), *range(-a.blocks // 2, 0)]
    assert max(reg.match(prompt, len(prompt)).values()) == a.blocks // 2 + 1
    hashes = [1, *range(-a.blocks + 1, 0)]
    return {"match_us": per_call_us(lambda: reg.match(prompt, len(prompt)), a.calls),
            "add_drop_us": per_call_us(lambda: (reg.add("x", "p0", hashes), reg.drop("x")), a.calls)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=40)
    p.add_argument("--instances", type=int, default=8)
    p.add_argument("--calls", type=int, default=2000)
    a = p.parse_args()
    out = {n: measure(n, a) for n in (10, 100, 1000)}
    for n, m in out.items():
        print(json.dumps({"registrations_sharing_first_block": n, **{k: round(v, 2) for k, v in m.items()}}))
    print(json.dumps({"match_us_1000_over_10": round(out[1000]["match_us"] / out[10]["match_us"], 2)}))


if __name__ == "__main__":
    main()
