"""Held prefixes: a prefix-closed set of chained block hashes, so the longest held prefix of a
prompt is found by bisection (about log2(blocks) set probes) instead of one probe per block.

Why: a probe into a set of ~100k resident blocks costs two cache misses (the table slot, then the
stored hash object), about 0.1-0.3 microseconds; prompts run to thousands of blocks, and every
turn of a conversation repeats the previous prompt. Block hashes are chained (hash i names blocks
0..i), so if the set holds a hash only while every block before it in its chain is held too,
membership along a prompt is true up to some block and false after it: a monotone predicate.
That invariant is kept where it is cheap, off the decision path: a run is added only onto a
member parent, and removing a block removes its members' subtree (each member knows its
children). Pure and synchronous.
"""
from __future__ import annotations


class HeldPrefixes:
    def __init__(self) -> None:
        self._kids: dict[int, list[int] | None] = {}  # member -> its member children (None: none yet)
        self.bisections = 0  # lookups answered by bisection beyond the first block

    def __len__(self) -> int:
        return len(self._kids)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._kids

    def add_run(self, hashes: list[int], start: int, end: int) -> int:
        """Add ``hashes[start:end]``, every block before ``start`` being a member already (a run
        from the root when ``start`` is 0). Stops at a non-member parent; returns the new end."""
        kids = self._kids
        if start > 0 and hashes[start - 1] not in kids:
            return start
        for i in range(start, end):
            h = hashes[i]
            if h in kids:
                continue
            kids[h] = None
            if i:
                p = hashes[i - 1]
                lst = kids[p]
                if lst is None:
                    kids[p] = [h]
                else:
                    lst.append(h)
        return end

    def add_child(self, parent: int | None, block_hash: int) -> bool:
        """Add one block whose parent (None: the root) is a member; False if it is not."""
        kids = self._kids
        if block_hash in kids:
            return True
        if parent is None:
            kids[block_hash] = None
            return True
        lst = kids.get(parent, False)
        if lst is False:
            return False
        kids[block_hash] = None
        if lst is None:
            kids[parent] = [block_hash]
        else:
            lst.append(block_hash)  # type: ignore[union-attr]
        return True

    def remove(self, block_hash: int) -> int:
        """A block left: it and every member descending from it leave; returns how many."""
        kids = self._kids
        stack, n = [block_hash], 0
        while stack:
            x = stack.pop()
            if x in kids:
                ch = kids.pop(x)
                n += 1
                if ch:
                    stack.extend(ch)
        return n

    def known(self, hashes: list[int], limit: int) -> int:
        """Leading blocks (of the first ``limit``) that are members, by bisection."""
        kids = self._kids
        if limit <= 0 or hashes[0] not in kids:
            return 0
        hi = min(limit, len(hashes)) - 1
        if hashes[hi] in kids:
            return hi + 1
        lo = 0  # members: lo; not: hi
        self.bisections += 1
        while hi - lo > 1:
            mid = (lo + hi) >> 1
            if hashes[mid] in kids:
                lo = mid
            else:
                hi = mid
        return lo + 1

    def clear(self) -> None:
        self._kids.clear()
