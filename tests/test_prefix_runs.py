"""Held prefixes (scheduler/prefix_runs.py): a prefix-closed set of chained hashes answers a
prompt's held prefix by bisection, and a removal takes the blocks after it with it."""
from __future__ import annotations

import random

from scheduler.hashing import block_hashes
from scheduler.prefix_runs import HeldPrefixes

BS = 4


def chain(n: int, seed: int = 0) -> list[int]:
    return block_hashes([seed * 1000 + i for i in range(n * BS)], BS)


def test_runs_are_found_by_bisection_and_a_removal_drops_its_subtree():
    s = HeldPrefixes()
    turn1, turn2 = chain(10), chain(25)  # turn 2 extends turn 1
    assert s.known(turn2, 25) == 0
    assert s.add_run(turn1, 0, 10) == 10
    assert s.known(turn2, 25) == 10 and s.known(turn2, 6) == 6 and s.known(chain(25, seed=1), 25) == 0
    assert s.add_run(turn2, 10, 25) == 25 and s.known(turn2, 25) == 25
    branch = block_hashes([i for i in range(6 * BS)] + [7] * (4 * BS), BS)  # shares 6 blocks, then forks
    assert branch[:6] == turn1[:6] and s.add_run(branch, 6, 10) == 10
    assert s.remove(turn1[7]) == 25 - 7  # block 7 and everything after it in turn 2; the fork stays
    assert s.known(turn2, 25) == 7 and s.known(branch, 10) == 10
    assert s.remove(turn1[3]) == 4 + 4  # blocks 3..6 of the shared part and the fork's 4
    assert s.known(branch, 10) == 3 and len(s) == 3
    assert s.add_run(turn2, 5, 9) == 5  # onto a non-member parent: refused (the set stays prefix-closed)


def test_bisection_agrees_with_a_walk_on_random_histories():
    rng = random.Random(7)
    chains = [chain(40, seed=k) for k in range(6)]
    s = HeldPrefixes()
    held: set[int] = set()
    for _ in range(400):
        c = rng.choice(chains)
        if rng.random() < 0.6:
            k = s.known(c, 40)
            end = rng.randrange(k, 41)
            s.add_run(c, k, end)
            held.update(c[:end])
        else:
            h = c[rng.randrange(40)]
            s.remove(h)
            held.discard(h)
        for c2 in chains:
            walk = 0
            while walk < 40 and c2[walk] in held:
                walk += 1
            assert s.known(c2, 40) <= walk  # never claims a block that is not held
            assert all(h in held for h in c2[:s.known(c2, 40)])
