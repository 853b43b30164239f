"""Candidates and their TTFT/TBT terms: the raw facts every policy reads, and the cost model.

TTFT on a prefill candidate = transfer + queue + prefill (+ the prefill->decode shipment, added
once the decode instance is known). The queue term belongs to the candidate (its ledger load);
the *cache-side* terms (what is reused, what is moved, what is recomputed) depend only on the
candidate's prefix facts and its predictor group (instances the predictors answer alike for,
e.g. one hardware profile), so :class:`TermBook` computes them once per distinct situation and
shares them: with 64 candidates most have the same (no) prefix and cost one lookup.

A candidate's engine-default way (``local``): reuse its own prefix, load the host-tier part of
it, fetch beyond it from the shared store when the store holds more (an engine with a store
connector does that by itself), prefill the rest. Algorithm 1 may instead recompute beyond the
local prefix (the engine default) or pull the best holder's prefix (``pull``).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Hashable

from predictors.base import DecodeState, Predictors, PrefillState
from predictors.telemetry import SLO
from predictors.types import Tier
from scheduler.types import Instance, RequestFacts

if TYPE_CHECKING:
    from scheduler.hit_index import Match


@dataclass(slots=True)
class Terms:
    """Cache-side terms of one way to serve the request on a prefill instance (no queue)."""

    hit_tokens: int = 0  # prefix tokens not recomputed
    local_hit_tokens: int = 0  # of those, on the instance already (device or host)
    transfer_tokens: int = 0  # of those, pulled from another holder or the store
    transfer_from: str | None = None
    transfer_s: float = 0.0  # host-tier load + pull from a holder or the store
    prefill_s: float = 0.0
    host_tokens: int = 0  # of the local hit, loaded from the instance's host tier first

    @property
    def cache_s(self) -> float:
        return self.transfer_s + self.prefill_s


@dataclass(slots=True)
class PrefillCandidate:
    id: str
    role: str
    device_blocks: int  # contiguous prefix on its device
    local_blocks: int  # contiguous prefix on its device or host memory
    state: PrefillState
    queue_s: float
    active: int = 0  # requests in flight on it (queued prefills; for "both", decodes too)
    group: Hashable = None  # predictor group (equal groups predict alike)
    local: Terms = None  # type: ignore[assignment]  # the engine-default way (no peer pull); set by TermBook

    def ttft(self, t: Terms) -> float:
        """TTFT at this instance served the ``t`` way (before any prefill->decode shipment)."""
        return t.transfer_s + self.queue_s + t.prefill_s


@dataclass(slots=True)
class DecodeCandidate:
    id: str
    role: str
    state: DecodeState
    tbt_s: float
    kv_wait_s: float = 0.0  # from now until it has room for this request's KV (0: room now)

    def first_token_s(self, ready_s: float, ship_s: float) -> float:
        """From now to this request's first token here, when its KV is ready to ship at ``ready_s``
        (from now) and takes ``ship_s``: wait for room, ship, one decode step."""
        wait = self.kv_wait_s
        return (wait if wait > ready_s else ready_s) + ship_s + self.tbt_s  # max(): no builtin call per candidate


class TermBook:
    """Memoised cache-side terms for one request: one computation per distinct situation."""

    __slots__ = ("prompt", "bs", "store_blocks", "pred", "_memo")

    def __init__(self, prompt_tokens: int, block_size: int, store_blocks: int, predictors: Predictors):
        self.prompt, self.bs, self.store_blocks, self.pred = prompt_tokens, block_size, store_blocks, predictors
        self._memo: dict[tuple[Hashable, ...], Terms] = {}

    def _host_load_s(self, c: PrefillCandidate) -> float:
        host = (c.local_blocks - c.device_blocks) * self.bs
        return self.pred.transfer.transfer_time(host, Tier.HOST, c.id) if host > 0 else 0.0

    def local(self, c: PrefillCandidate) -> Terms:
        """Engine default: own prefix (host part loaded), plus the store's beyond it if longer."""
        key = ("local", c.group, c.device_blocks, c.local_blocks)
        t = self._memo.get(key)
        if t is None:
            local = c.local_blocks * self.bs
            transfer_s = self._host_load_s(c)
            hit, moved, source = local, 0, None
            if self.store_blocks > c.local_blocks:
                moved = (self.store_blocks - c.local_blocks) * self.bs
                transfer_s += self.pred.transfer.transfer_time(moved, Tier.STORE, c.id)
                hit, source = self.store_blocks * self.bs, Tier.STORE
            t = self._memo[key] = Terms(hit, local, moved, source, transfer_s,
                                        self.pred.prefill.prefill_time(c.id, self.prompt, hit),
                                        (c.local_blocks - c.device_blocks) * self.bs)
        return t

    def pull(self, c: PrefillCandidate, holder: str, holder_blocks: int) -> Terms:
        """Algorithm 1's pull branch: bring the holder's prefix beyond the local one, then prefill."""
        key = ("pull", c.group, c.device_blocks, c.local_blocks, holder, holder_blocks)
        t = self._memo.get(key)
        if t is None:
            local = c.local_blocks * self.bs
            pulled = (holder_blocks - c.local_blocks) * self.bs
            hit = holder_blocks * self.bs
            transfer_s = self._host_load_s(c) + self.pred.transfer.transfer_time(pulled, holder, c.id)
            t = self._memo[key] = Terms(hit, local, pulled, holder, transfer_s,
                                        self.pred.prefill.prefill_time(c.id, self.prompt, hit),
                                        (c.local_blocks - c.device_blocks) * self.bs)
        return t


@dataclass(slots=True)
class DecisionContext:
    """The blackboard one decision's stages fill in order; policies read it, never write it.

    Stages (scheduler.stages): eligible candidates (``prefill_pool``/``decode_pool``) ->
    cache facts (``match``, ``store_blocks``, best holder) -> terms (``prefill`` and ``decode``
    candidates with their predicted terms) -> choice (the policy) -> admission -> commit.
    """

    facts: RequestFacts
    now: float
    block_size: int
    predictors: Predictors
    rng: random.Random
    prefill_pool: list[Instance] = field(default_factory=list)  # eligible instances
    decode_pool: list[Instance] = field(default_factory=list)
    match: Match | None = None  # set by the cache-facts stage
    store_blocks: int = 0
    prefill: list[PrefillCandidate] = field(default_factory=list)
    decode: list[DecodeCandidate] = field(default_factory=list)
    terms: TermBook | None = None  # set by the terms stage, before any policy runs
    holder: str | None = None  # best holder: the longest prefix any candidate (or the store) can give
    holder_blocks: int = 0
    slo: SLO = field(default_factory=SLO)  # the request's SLO (configured, tightened by the request)
    admit_fraction: float = 1.0  # of the SLO, up to which admission admits (the priority class's headroom)
    prefill_ready_s: float = 0.0  # from now until the chosen prefill is done (set after the prefill choice)
    usable_blocks: int = 0  # complete prompt blocks an engine can reuse (all but the last token's)
    pending: dict[str, int] = field(default_factory=dict)  # in-flight prefix per prefill instance (blocks)
    decode_load: float = 0.0  # the ledger's reservations per eligible decode instance (a TBT feature)

    @property
    def prompt_tokens(self) -> int:
        return self.facts.prompt_tokens


def best_holder(candidates: list[PrefillCandidate], store_blocks: int) -> tuple[str | None, int]:
    """The longest prefix anywhere a prefill instance can pull from: a prefill instance or the store.

    Ties go to an instance (its copy is on a device) and then to the first in candidate order.
    """
    holder, blocks = None, 0
    for c in candidates:
        if c.local_blocks > blocks:
            holder, blocks = c.id, c.local_blocks
    if store_blocks > blocks:
        holder, blocks = Tier.STORE, store_blocks
    return holder, blocks
