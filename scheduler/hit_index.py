"""The hit map: which instance holds which prefix block, per tier, fed by KV cache events.

Layout (chosen for memory and lookup speed in pure Python):

* one dict per tier (device, host memory, shared store) mapping an *index* block hash to a
  bitmask of instance slots: a million blocks cost one dict entry each, not one per holder;
* per instance, a dict from the engine's own block hash to our index hash, because KV events
  name blocks by the engine's hash (removals carry nothing else) while requests are matched by
  ours. Stored blocks are re-hashed from the ``token_ids`` the event carries with
  :func:`scheduler.hashing.block_hashes`, so the index never depends on an engine's hash seed
  or algorithm and equals what the gateway computes for the same tokens.

Decisions of this module (documented in docs/scheduler.md):

* a BlockStored whose ``parent_block_hash`` is not None and unknown to that instance is
  inconsistent (we cannot name its prefix): it is ignored and the call returns False;
* the event's ``block_size`` must equal the index's, and ``token_ids`` must hold exactly
  ``len(block_hashes) * block_size`` tokens; otherwise the event is ignored (False);
* a BlockRemoved naming blocks the instance is not known to hold removes the ones it does hold
  and returns False (the gateway may rebuild that instance from replay);
* AllBlocksCleared clears the instance's device and host tiers; blocks it wrote to the shared
  store stay (the store was not flushed), on ``drop_instance`` (before a replay) too;
  ``unregister`` clears every tier;
* each instance holds at most ``max_blocks`` blocks over all tiers; a BlockStored that would
  exceed it is refused (False, counted in ``overflows``): memory stays bounded even when removal
  events are lost, at the price of under-reporting hits until a rebuild;
* a chain's namespace (the request's ``cache_salt`` and LoRA adapter, read from the event's
  ``extra_keys`` and ``lora_name``) is folded into its root with
  :func:`scheduler.hashing.namespace_parent`, exactly as the gateway hashes a request: two tenants'
  copies of the same tokens are two entries, and a salted request never matches an unsalted one;
  blocks with extra keys the gateway cannot know (multimodal ids) get keys no text request has;
* ``group_idx`` (hybrid models: one KV-cache group per attention type): an instance holds a block
  while any of its groups does; a removal in one group leaves the others' copy indexed. Group
  bookkeeping starts the first time an instance names a group other than 0 (single-group engines
  pay nothing).
"""
from __future__ import annotations

import sys
from itertools import repeat
from typing import Any

from scheduler.hashing import block_hashes as index_block_hashes, event_chain_keys, keyed_block_hashes
from scheduler.hit_match import Match, held_prefixes, longest_prefixes
from scheduler.hit_tiers import DEV, HOST, MEDIUM_TIERS, STORE, STORE_MEDIA, TIER_NAMES, tier_of
from scheduler.prefix_runs import HeldPrefixes

# the lookups live in hit_match.py, the tiers in hit_tiers.py; callers import these from here
__all__ = ["DEFAULT_MAX_BLOCKS", "MEDIUM_TIERS", "STORE_MEDIA", "TIER_NAMES", "HitIndex", "Match", "tier_of"]

#: Default bound on blocks per instance (all tiers) when the caller gives none.
DEFAULT_MAX_BLOCKS = 1 << 20

_MAX_GROUPS = 64  # KV-cache groups an event may name (hybrid models have a handful)
_INT_BYTES = sys.getsizeof(1 << 63)  # a 64-bit hash as a Python int


class HitIndex:
    """Per-instance, per-tier prefix block index, fed by KV events; pure and synchronous."""

    def __init__(self, block_size: int, max_blocks: int = DEFAULT_MAX_BLOCKS, trust_event_hashes: bool = False):
        """``trust_event_hashes``: events name blocks by this index's own chained hash already (the
        simulator's engines do), so their token ids need not be hashed again, and no engine-hash
        mapping is kept (it would be the identity: an instance knows a block while a tier holds
        it). Live engines name blocks by their own recipe and seed: never set it for them."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.trust_event_hashes = trust_event_hashes
        self.default_max_blocks = max_blocks
        self._tiers: tuple[dict[int, int], dict[int, int], dict[int, int]] = ({}, {}, {})
        self._slot: dict[str, int] = {}
        self._ids: list[str | None] = []
        self._bits: list[int] = []  # interned 1 << slot
        self._free: list[int] = []
        self._all = 0  # mask of registered slots
        self._engine: dict[str, dict[int, int]] = {}  # instance -> engine hash -> index hash
        self._counts: dict[str, list[int]] = {}  # instance -> blocks per tier
        self._cap: dict[str, int] = {}
        self._groups: dict[str, dict[tuple[int, int], int]] = {}  # instance -> (tier, engine hash) -> group mask
        self._multi = 0  # entries held by two or more instances (their masks are distinct int objects)
        # the store tier's blocks whose whole chain before them is in the store tier too: a
        # prompt's store prefix is then found by bisection, not one probe per block
        self._store_runs = HeldPrefixes()
        self.overflows = 0  # BlockStored events refused by the per-instance bound
        # bumped by every call that may change what ``match`` answers: an answer computed at one
        # version holds while the version is unchanged (the wait room's frames, scheduler/frame.py)
        self.version = 0

    # --- registration -------------------------------------------------------------------
    def register(self, instance_id: str, max_blocks: int | None = None) -> bool:
        """Give an instance a slot; False if it already has one."""
        self.version += 1
        if instance_id in self._slot:
            return False
        if self._free:
            slot = self._free.pop()
        else:
            slot = len(self._ids)
            self._ids.append(None)
            self._bits.append(1 << slot)
        self._ids[slot] = instance_id
        self._slot[instance_id] = slot
        self._all |= self._bits[slot]
        self._engine[instance_id] = {}
        self._counts[instance_id] = [0, 0, 0]
        self._cap[instance_id] = max_blocks if max_blocks is not None else self.default_max_blocks
        return True

    def set_max_blocks(self, instance_id: str, max_blocks: int) -> bool:
        """Change an instance's block limit (its capacity became known); False if unknown."""
        self.version += 1
        if instance_id not in self._slot:
            return False
        self._cap[instance_id] = max_blocks
        return True

    def unregister(self, instance_id: str) -> bool:
        """Forget an instance and free its slot (its blocks leave the index)."""
        self.version += 1
        if instance_id not in self._slot:
            return False
        self._clear(instance_id, tiers=(DEV, HOST, STORE))
        slot = self._slot.pop(instance_id)
        self._ids[slot] = None
        self._all &= ~self._bits[slot]
        self._free.append(slot)
        del self._engine[instance_id], self._counts[instance_id], self._cap[instance_id]
        self._groups.pop(instance_id, None)
        return True

    def __contains__(self, instance_id: str) -> bool:
        return self._slot_of(instance_id) is not None

    def _slot_of(self, instance_id: str) -> int | None:
        return self._slot.get(instance_id) if isinstance(instance_id, str) else None

    # --- KV events ----------------------------------------------------------------------
    def block_stored(self, instance_id: str, block_hashes: list[int], parent_block_hash: int | None,
                     token_ids: list[int], block_size: int, medium: str | None = "GPU", *,
                     extra_keys: list[Any] | None = None, lora_name: str | None = None,
                     group_idx: int | None = None) -> bool:
        """Record blocks an instance stored; False when ignored (see the module's rules)."""
        self.version += 1
        if group_idx is not None and not 0 <= group_idx < _MAX_GROUPS:
            return False
        groups = self._groups.get(instance_id) if self._groups and isinstance(instance_id, str) else None
        if groups is None and group_idx and self._slot_of(instance_id) is not None:
            groups = self._track_groups(instance_id)
        ok = self._stored(instance_id, block_hashes, parent_block_hash, token_ids, block_size, medium,
                          extra_keys, lora_name)
        tier = tier_of(medium)
        if ok and groups is not None and tier is not None:
            bit = 1 << (group_idx or 0)
            for eh in block_hashes:
                groups[(tier, eh)] = groups.get((tier, eh), 0) | bit
        return ok

    def _stored(self, instance_id: str, block_hashes: list[int], parent_block_hash: int | None,
                token_ids: list[int], block_size: int, medium: str | None, extra_keys: list[Any] | None,
                lora_name: str | None) -> bool:
        slot = self._slot_of(instance_id)
        tier = tier_of(medium)
        if slot is None or tier is None or block_size != self.block_size:
            return False
        try:
            n = len(block_hashes)
            if len(token_ids) != n * block_size or not all(map(isinstance, block_hashes, repeat(int))):
                return False
            emap = self._engine[instance_id]
            parent = None
            if self.trust_event_hashes:
                if parent_block_hash is not None:
                    bit = self._bits[slot]
                    if not any(t.get(parent_block_hash, 0) & bit for t in self._tiers):
                        return False
                ours = list(block_hashes)
            else:
                if parent_block_hash is not None:
                    parent = emap.get(parent_block_hash)
                    if parent is None:
                        return False
                keys = None
                if lora_name or (extra_keys and any(extra_keys)):  # a namespaced chain (salt, adapter)
                    root, keys = event_chain_keys(extra_keys, n, lora_name, parent_block_hash is None)
                    if parent_block_hash is None:
                        parent = root
                ours = (index_block_hashes(token_ids, block_size, parent=parent) if keys is None
                        else keyed_block_hashes(token_ids, block_size, parent, keys))
        except (TypeError, ValueError, OverflowError):
            return False
        counts = self._counts[instance_id]
        if sum(counts) + n > self._cap[instance_id]:
            self.overflows += 1
            return False
        bit = self._bits[slot]
        table = self._tiers[tier]
        if tier == STORE:
            self._link_store_run(parent_block_hash if self.trust_event_hashes or parent_block_hash is None
                                 else parent, ours)
        if self.trust_event_hashes:  # engine hash == index hash: no mapping to keep
            fresh = dict.fromkeys(ours, bit)
            if table.keys().isdisjoint(fresh):  # nobody holds any of them yet: one bulk insert
                table.update(fresh)
                counts[tier] += len(fresh)
                return True
            tget = table.get
            added = multi = 0
            for h in ours:
                mask = tget(h, 0)
                if not mask & bit:
                    if mask:
                        table[h] = mask | bit
                        if not mask & (mask - 1):
                            multi += 1
                    else:
                        table[h] = bit
                    added += 1
            counts[tier] += added
            self._multi += multi
            return True
        for engine_hash, h in zip(block_hashes, ours, strict=True):
            old = emap.get(engine_hash)
            if old is not None and old != h:  # the engine reused a hash for other tokens
                self._forget(instance_id, slot, engine_hash, old, tiers=(DEV, HOST, STORE))
            emap[engine_hash] = h
            mask = table.get(h, 0)
            if not mask & bit:
                if mask:
                    table[h] = mask | bit
                    if not mask & (mask - 1):
                        self._multi += 1
                else:
                    table[h] = bit
                counts[tier] += 1
        return True

    def _link_store_run(self, parent: int | None, ours: list[int]) -> None:
        runs = self._store_runs
        for h in ours:
            if not runs.add_child(parent, h):
                return  # its parent is not linked (yet): the walk in match() covers it
            parent = h

    def block_removed(self, instance_id: str, block_hashes: list[int], medium: str | None = "GPU", *,
                      group_idx: int | None = None) -> bool:
        """Record blocks an instance evicted from one tier; False if ignored or partly unknown."""
        self.version += 1
        slot = self._slot_of(instance_id)
        tier = tier_of(medium)
        if slot is None or tier is None or (group_idx is not None and not 0 <= group_idx < _MAX_GROUPS):
            return False
        groups = self._groups.get(instance_id) if self._groups else None
        if groups is not None:  # a block leaves the index only when its last group drops it
            bit = 1 << (group_idx or 0)
            gone = []
            try:
                for eh in block_hashes:
                    mask = groups.get((tier, eh))
                    if mask is None:
                        gone.append(eh)  # unknown: the removal below reports it
                    elif mask & ~bit:
                        groups[(tier, eh)] = mask & ~bit
                    else:
                        del groups[(tier, eh)]
                        gone.append(eh)
            except TypeError:  # unhashable ids
                return False
            block_hashes = gone
        emap = self._engine[instance_id]
        bit = self._bits[slot]
        bits = self._bits
        counts = self._counts[instance_id]
        table = self._tiers[tier]
        others = [t for k, t in enumerate(self._tiers) if k != tier and t]  # tiers that may still hold it
        trust = self.trust_event_hashes
        consistent = True
        removed = 0
        try:  # _forget for one tier, inlined (evictions come by the hundred thousand)
            for engine_hash in block_hashes:
                if trust:  # not held in this tier: inconsistent (below), as an unknown block is
                    h = engine_hash
                else:
                    got = emap.get(engine_hash)
                    if got is None:
                        consistent = False
                        continue
                    h = got
                mask = table.get(h, 0)
                if mask & bit:
                    removed += 1
                    rest = mask & ~bit
                    if not rest:
                        del table[h]
                        if tier == STORE:
                            self._store_runs.remove(h)
                    elif rest & (rest - 1):
                        table[h] = rest  # still two or more holders
                    else:
                        table[h] = bits[rest.bit_length() - 1]
                        self._multi -= 1
                else:
                    consistent = False
                if not trust and (not others or not any(t.get(h, 0) & bit for t in others)):
                    emap.pop(engine_hash, None)
        except TypeError:  # unhashable ids
            counts[tier] -= removed
            return False
        counts[tier] -= removed
        return consistent

    def all_cleared(self, instance_id: str) -> None:
        """The engine dropped its cache: clear its device and host tiers (the store keeps its copy)."""
        self.version += 1
        self._clear(instance_id, tiers=(DEV, HOST))

    def drop_instance(self, instance_id: str) -> None:
        """Forget what an instance holds itself (before rebuilding it from replay). What it wrote
        to the shared store stays: a restarted engine does not flush the store, and losing those
        hits until they are written again would cost every instance its store pulls."""
        self.version += 1
        self._clear(instance_id, tiers=(DEV, HOST))

    def _forget(self, instance_id: str, slot: int, engine_hash: int, h: int, tiers: tuple[int, ...]) -> bool:
        """Clear ``h`` for one instance in ``tiers``; drop the engine mapping once no tier holds it."""
        bit = self._bits[slot]
        counts = self._counts[instance_id]
        held = False
        for tier in tiers:
            table = self._tiers[tier]
            mask = table.get(h, 0)
            if mask & bit:
                held = True
                self._set_rest(table, h, mask & ~bit)
                counts[tier] -= 1
        if not any(self._tiers[t].get(h, 0) & bit for t in (DEV, HOST, STORE)):
            self._engine[instance_id].pop(engine_hash, None)
        groups = self._groups.get(instance_id)
        if groups:
            for tier in tiers:
                groups.pop((tier, engine_hash), None)
        return held

    def _track_groups(self, instance_id: str) -> dict[tuple[int, int], int]:
        """Start per-group bookkeeping for an instance: what it holds so far is group 0's."""
        bit = self._bits[self._slot[instance_id]]
        held: dict[tuple[int, int], int] = {}
        if self.trust_event_hashes:
            for tier, table in enumerate(self._tiers):
                held.update(((tier, h), 1) for h, m in table.items() if m & bit)
        else:
            for eh, h in self._engine[instance_id].items():
                held.update(((tier, eh), 1) for tier, table in enumerate(self._tiers) if table.get(h, 0) & bit)
        self._groups[instance_id] = held
        return held

    def _clear(self, instance_id: str, tiers: tuple[int, ...]) -> None:
        slot = self._slot_of(instance_id)
        if slot is None:
            return
        bit = self._bits[slot]
        keep: dict[int, int] = {}
        counts = self._counts[instance_id]
        cleared = set(tiers)
        groups = self._groups.get(instance_id)
        if groups:
            self._groups[instance_id] = {k: m for k, m in groups.items() if k[0] not in cleared}
        if self.trust_event_hashes:  # no mapping: walk the tiers (a rare event)
            for tier in tiers:
                table = self._tiers[tier]
                for h, mask in [(h, m) for h, m in table.items() if m & bit]:
                    self._set_rest(table, h, mask & ~bit)
                counts[tier] = 0
            return
        for engine_hash, h in self._engine[instance_id].items():
            for tier in tiers:
                table = self._tiers[tier]
                mask = table.get(h, 0)
                if mask & bit:
                    self._set_rest(table, h, mask & ~bit)
            if any(self._tiers[t].get(h, 0) & bit for t in (DEV, HOST, STORE) if t not in cleared):
                keep[engine_hash] = h
        for tier in tiers:
            counts[tier] = 0
        self._engine[instance_id] = keep

    def _set_rest(self, table: dict[int, int], h: int, rest: int) -> None:
        """Store what is left of a mask after one holder left (single holders share interned ints)."""
        if not rest:
            del table[h]
            if table is self._tiers[STORE]:
                self._store_runs.remove(h)
        elif rest & (rest - 1):
            table[h] = rest  # still two or more holders
        else:
            table[h] = self._bits[rest.bit_length() - 1]
            self._multi -= 1

    # --- lookups ------------------------------------------------------------------------
    def match(self, hashes: list[int], limit: int | None = None, store: bool = True) -> Match:
        """Longest contiguous prefix (in blocks) per instance and in the store, first miss stops
        (scheduler/hit_match.py ``longest_prefixes``). ``limit`` caps the blocks looked at;
        ``store=False`` leaves the store tier alone (``Match.store`` 0)."""
        return longest_prefixes(self._tiers, self._all, self._ids, self._store_runs, hashes, limit, store)

    def match_held(self, hashes: list[int], limit: int | None = None) -> dict[str, int]:
        """Per instance, the longest prefix (blocks) it holds in any tier, its own store writes
        included (scheduler/hit_match.py ``held_prefixes``): the indexer API's ``CPU`` answer."""
        return held_prefixes(self._tiers, self._all, self._ids, hashes, limit)

    # --- reporting ----------------------------------------------------------------------
    def cached_blocks(self, instance_id: str) -> dict[str, int]:
        counts = self._counts.get(instance_id, (0, 0, 0)) if isinstance(instance_id, str) else (0, 0, 0)
        return dict(zip(TIER_NAMES, counts, strict=True))

    def blocks(self) -> dict[str, int]:
        """Distinct block hashes per tier."""
        return dict(zip(TIER_NAMES, map(len, self._tiers), strict=True))

    def memory_bytes(self) -> int:
        """Bytes held (as ``sys.getsizeof`` counts them): dict tables, key ints, multi-holder masks.

        Cheap (no walk over entries), so ``snapshot()`` can report it; the benchmark checks it
        against a full object walk.
        """
        total = sum(sys.getsizeof(t) for t in self._tiers)
        total += sum(len(t) for t in self._tiers) * _INT_BYTES  # index-hash keys
        total += self._multi * _INT_BYTES  # masks of several holders (single ones are interned)
        for emap in self._engine.values():
            total += sys.getsizeof(emap) + len(emap) * _INT_BYTES  # engine-hash keys; values are the keys above
        for groups in self._groups.values():  # hybrid-model instances: a (tier, hash) tuple and a mask each
            total += sys.getsizeof(groups) + len(groups) * (sys.getsizeof((0, 0)) + _INT_BYTES)
        return total
