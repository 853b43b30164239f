"""The simulated engine model: a pure, synchronous step machine that schedules like vLLM v1.

No I/O, no clock of its own: the driver passes ``now`` (modelled seconds) to :meth:`step`, which
schedules one batch, returns its modelled duration and what it produced, and expects the next
call at ``now + duration`` or later. The HTTP server drives it in (scaled) real time; the
discrete-event simulator drives it in virtual time. See docs/sim_engine.md for the API contract.

The step (vLLM v1's scheduling with chunked prefill, preemption by recompute) is in step.py; the
KV loads before a prefill (remote pull, host tier, shared store) and the store's write-through in
kv_loads.py; the BlockStored events and their block names in block_events.py; a request's state
inside the engine in sequence.py. This module holds the engine's settings and state, the request
API (add, abort, held KV), load facts, and the block bookkeeping the others share.

Per-step CPU stays small: O(1) work per running sequence, a block is allocated or hashed only
when a sequence crosses a block boundary, and output tokens are read from a shared corpus.
"""
from __future__ import annotations

import itertools
import math
import os
import random
from collections import deque
from typing import TYPE_CHECKING

from predictors.types import ROLES
from scheduler.hashing import (
    block_hashes,
    namespace_parent,
    vllm_hash_fn,
    vllm_none_hash,
    vllm_seed_text,
)

from ..kv_wire import MEDIUM_STORE
from ..sglang_wire import (
    MEDIUM_HOST as SGLANG_MEDIUM_HOST,
    MEDIUM_STORE as SGLANG_MEDIUM_STORE,
)
from .block_events import event_extra_keys, event_ids, stored
from .kv_cache import KVCache
from .profiles import Profile
from .records import EngineStats, Finished, FirstToken, HeldKV, SimRequest, StepResult
from .sequence import DONE, HELD, LOADING, RUNNING, WAITING, Seq
from .step import run_step
from .text import OutputSampler
from .timing import StepTimer

if TYPE_CHECKING:
    from ..store.connector import StoreConnector

__all__ = ["ROLES", "EngineModel", "EngineStats", "Finished", "FirstToken", "HeldKV", "SimRequest", "StepResult"]


class EngineModel:
    def __init__(self, profile: Profile, role: str = "both", *, block_size: int = 16,
                 max_num_batched_tokens: int = 8192, max_num_seqs: int = 256,
                 kv_capacity_tokens: int | None = None, host_tier_tokens: int = 0, seed: int = 0,
                 noise: float = 0.02, kv_events: bool = False, event_hashes: str = "vllm",
                 kv_hold_timeout: float = 30.0,
                 net_bytes_per_s: float | None = None, transfer_latency_s: float | None = None,
                 host_bytes_per_s: float | None = None, median_output: int = 128,
                 max_model_len: int | None = None, hash_algo: str = "sha256", int_block_hashes: bool = True,
                 store: StoreConnector | None = None, store_writes: bool = False,
                 store_policy: str = "write_through"):
        """``store``: a store connector the engine calls itself (the simulator); ``store_writes``:
        report prefills in ``StepResult.store_writes`` for a driver that writes to the store (the
        live engine, which loads what ``SimRequest.store_blocks`` says); ``store_policy``:
        ``write_through`` (after each prefill, HiCache's default) or ``write_back`` (blocks go to
        the store when the device evicts them: an in-process connector is called, a live driver
        gets them in ``StepResult.store_evicted``)."""
        if store_policy not in ("write_through", "write_back"):
            raise ValueError(f"store_policy must be write_through or write_back, got {store_policy!r}")
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if block_size <= 0 or max_num_seqs <= 0 or max_num_batched_tokens <= 0:
            raise ValueError("block_size, max_num_seqs and max_num_batched_tokens must be positive")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (as vLLM requires)")
        if noise < 0 or kv_hold_timeout <= 0:
            raise ValueError("noise must be >= 0 and kv_hold_timeout > 0")
        self.profile = profile
        self.role = role
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len or profile.max_model_len
        cap_tokens = profile.kv_capacity_tokens if kv_capacity_tokens is None else kv_capacity_tokens
        host_blocks = host_tier_tokens // block_size
        # per-block event metadata only where a hash is not the event id or an offload repeats it
        self.kv = KVCache(cap_tokens // block_size, block_size, host_blocks, kv_events,
                          meta=event_hashes != "index" or host_blocks > 0, merge_removals=event_hashes == "index")
        # a sequence longer than the whole cache could never finish (vLLM refuses such a
        # max_model_len at start-up): clamp, so the API answers 400 instead of a hang
        self.max_model_len = min(self.max_model_len, self.kv.capacity * block_size)
        self.timer = StepTimer(profile)
        eff = profile.efficiency
        # a gap profile's noisier GPU adds its own sigma (noise 0 still turns all noise off)
        self.noise = math.hypot(noise, eff.get("extra_noise", 0.0)) if noise else 0.0
        self.kv_hold_timeout = kv_hold_timeout
        # a gap profile's congested network: KV transfers get a fraction of the NIC
        self.net_bytes_per_s = (net_bytes_per_s or profile.net_bytes_per_s) * eff.get("net_efficiency", 1.0)
        self.transfer_latency_s = (profile.efficiency.get("transfer_latency_ms", 1.0) * 1e-3
                                   if transfer_latency_s is None else transfer_latency_s)
        self.host_bytes_per_s = host_bytes_per_s or profile.host_bytes_per_s
        self._kv_bytes = profile.kv_bytes_per_token
        self._rng = random.Random(seed)
        self.sampler = OutputSampler(seed, median_output)
        self._corpus = self.sampler.corpus
        if event_hashes not in ("vllm", "index", "sglang"):
            raise ValueError(f"event_hashes must be 'vllm', 'sglang' or 'index', got {event_hashes!r}")
        # "sglang": SGLang's page ids (SHA-256 chain, signed int64) and its host medium name
        self._sglang_ids = event_hashes == "sglang"
        if self._sglang_ids:
            self.kv.host_medium = SGLANG_MEDIUM_HOST
        self.store_medium = SGLANG_MEDIUM_STORE if self._sglang_ids else MEDIUM_STORE  # store-resident blocks
        # "vllm": events name blocks by vLLM's sha256 ids, as on the wire; "index": by the chained
        # xxhash the engine already keys its cache by, removals merged (the simulator's choice: a
        # subscriber re-hashes the events' token ids either way, sha256 per block dominates its run
        # time, and one BlockRemoved per block would add a tenth to it)
        self._index_ids = event_hashes == "index"
        # vLLM's --prefix-caching-hash-algo, and VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES (False: events
        # carry the raw digests); unset PYTHONHASHSEED with an xxhash algo: a random seed, as vLLM
        self.hash_algo = hash_algo
        self._int_ids = int_block_hashes
        try:
            seed_text = vllm_seed_text(hash_algo)
        except ValueError:
            vllm_hash_fn(hash_algo)  # an unknown algo is an error; a missing seed is vLLM's random one
            seed_text = os.urandom(32).hex()
        self._none_digest = vllm_none_hash(seed_text, hash_algo) if kv_events and event_hashes == "vllm" else None
        self._waiting: deque[Seq] = deque()
        self._prefilling: list[Seq] = []
        self._decoding: list[Seq] = []
        self._loading: list[tuple[float, int, Seq]] = []
        self._held: dict[str, Seq] = {}
        self._held_order: deque[tuple[float, str]] = deque()
        self._seqs: dict[str, Seq] = {}
        self._tie = itertools.count()
        self._net_free_at = 0.0
        self._host_free_at = 0.0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.host_hits = 0
        self.num_preemptions = 0
        self.store = store
        self.store_writes = store_writes
        self.write_back = store_policy == "write_back" and (store is not None or store_writes)
        self._now = 0.0  # the current step's start (evictions during it are written back then)
        self._evicted: list[tuple] = []  # live write-back: blocks evicted during this step
        if self.write_back:
            self.kv.on_evict = self._written_back if store is not None else self._evicted_live
        self.store_hits = 0
        self.store_loads = 0
        self.store_load_s = 0.0

    # --- requests ---------------------------------------------------------------------------
    def add_request(self, req: SimRequest, now: float) -> None:
        """Queue a request that arrived at ``now``. Raises ValueError if it can never run."""
        rid = req.request_id
        if rid in self._seqs:
            raise ValueError(f"request id {rid!r} is already in use")
        P = len(req.prompt)
        if P == 0:
            raise ValueError("the prompt is empty")
        if req.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if P + 1 > self.max_model_len:
            raise ValueError(f"prompt of {P} tokens exceeds the maximum model length {self.max_model_len}")
        if req.hold_kv and self.role == "decode":
            raise ValueError("a decode instance cannot serve the prefill side of a disaggregated request")
        if req.remote_kv and self.role == "prefill":
            raise ValueError("a prefill instance cannot pull KV for the decode side of a disaggregated request")
        bs = self.block_size
        if -(-(P + 1) // bs) > self.kv.capacity:
            raise ValueError(f"prompt of {P} tokens needs more KV blocks than the cache holds "
                             f"({self.kv.capacity} blocks of {bs})")
        off, natural = self.sampler.draw(rid)
        target = 1 if req.hold_kv else min(req.max_tokens, req.output_len if req.output_len is not None else natural)
        if -(-(P + target) // bs) > self.kv.capacity:
            raise ValueError(f"prompt of {P} tokens plus {target} output tokens needs more KV blocks than the "
                             f"cache holds ({self.kv.capacity} blocks of {bs})")
        hashes = (block_hashes(req.prompt, bs, parent=namespace_parent(req.cache_salt, req.lora_name))
                  if req.block_hashes is None else list(req.block_hashes))
        s = Seq(req, now, hashes, off, max(1, target))
        self._seqs[rid] = s
        self._waiting.append(s)

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is and free its KV (client gone)."""
        s = self._seqs.pop(request_id, None)
        if s is None:
            return False
        if s.state == WAITING:
            self._waiting.remove(s)
        elif s.state == RUNNING:
            (self._decoding if s in self._decoding else self._prefilling).remove(s)
        elif s.state == HELD:
            del self._held[request_id]
        self._free(s)
        s.state = DONE
        return True

    def has_request(self, request_id: str) -> bool:
        """Whether the id is live (queued, running, loading KV or holding KV)."""
        return request_id in self._seqs

    def held_kv(self, request_id: str) -> HeldKV | None:
        """The KV a finished prefill holds for a decode instance, if still held."""
        s = self._held.get(request_id)
        if s is None:
            return None
        return HeldKV(request_id, s.P, s.n_alloc, self.block_size, s.hold_expires)

    def release_kv(self, request_id: str) -> bool:
        """The decode side has the KV: free the held blocks (they stay in the prefix cache)."""
        s = self._held.pop(request_id, None)
        if s is None:
            return False
        del self._seqs[request_id]
        self._free(s)
        s.state = DONE
        return True

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block and emit AllBlocksCleared; refused (False) while any request
        holds KV, since a subscriber would then forget blocks that are still there."""
        kv = self.kv
        if self._seqs or kv.num_free() != kv.capacity:
            return False
        kv.clear()
        return True

    # --- load facts -------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self._waiting or self._prefilling or self._decoding)

    def next_timer(self) -> float | None:
        """Earliest modelled time a KV load completes or held KV expires (None if neither)."""
        t = self._loading[0][0] if self._loading else None
        if self._held_order:
            h = self._held_order[0][0]
            t = h if t is None or h < t else t
        return t

    def stats(self) -> EngineStats:
        queued = sum(s.num_tokens - s.computed for s in self._waiting)
        queued += sum(s.num_tokens - s.computed for s in self._prefilling)
        kv = self.kv
        loading = sum(1 for e in self._loading if e[2].state == LOADING)
        return EngineStats(
            running=len(self._prefilling) + len(self._decoding),
            waiting=len(self._waiting) + loading, loading=loading, held=len(self._held),
            kv_usage=kv.usage(), kv_capacity_blocks=kv.capacity, kv_free_blocks=kv.num_free(),
            queued_prefill_tokens=queued, prefix_queries=self.prefix_queries, prefix_hits=self.prefix_hits,
            host_hits=self.host_hits, preemptions=self.num_preemptions, host_blocks=len(kv.host),
            store_hits=self.store_hits, store_loads=self.store_loads, store_load_s=self.store_load_s)

    # --- the step ---------------------------------------------------------------------------
    def step(self, now: float) -> StepResult:
        """Schedule and 'run' one batch starting at ``now`` (engines_adapters/sim/step.py)."""
        return run_step(self, now)

    # --- internals --------------------------------------------------------------------------
    def _free(self, s: Seq) -> None:
        self.kv.release(s.hashes, s.nb, s.n_alloc - s.nb)
        s.nb = 0
        s.n_alloc = 0
        s.cap = 0
        s.computed = 0
        s.looked_up = False
        s.decoding = False
        s.loaded = False

    def _written_back(self, hashes: list[int]) -> None:
        assert self.store is not None
        self.store.write_blocks(hashes, self._now)

    def _evicted_live(self, hashes: list[int]) -> None:
        """Live write-back: each evicted block with its event ids (its metadata is still here)."""
        meta = self.kv.meta
        for h in hashes:
            m = meta.get(h) if meta is not None else None
            self._evicted.append((h, None, None, None, None) if m is None else (h, m.vh, m.parent_vh, m.keys, m.lora))

    def _tokens(self, s: Seq, a: int, b: int) -> list[int]:
        """Token ids at positions ``a..b`` of a sequence (prompt, then output)."""
        P = s.P
        if b <= P:
            return s.prompt[a:b]
        out = s.prompt[a:P] if a < P else []
        out += self.sampler.tokens(s.out_off, max(a, P) - P, b - P)
        return out

    def _commit(self, s: Seq, upto: int) -> None:
        """Cache the sequence's full blocks ``s.nb..upto`` (content now computed)."""
        kv = self.kv
        bs = self.block_size
        hashes = s.hashes
        first = s.nb
        for bi in range(max(first, len(hashes)), upto):  # output blocks: extend the chain
            parent = hashes[bi - 1] if bi else s.root
            hashes.append(block_hashes(self._tokens(s, bi * bs, (bi + 1) * bs), bs, parent)[0])
        if upto <= first:
            return
        new = kv.commit_many(hashes, first, upto)
        s.nb = upto
        if new and kv.events is not None:
            stored(self, s, new)

    def event_extra_keys(self, a: int, b: int, lora: str | None, salt: str | None) -> list:
        """The ``extra_keys`` of a BlockStored for blocks ``a..b`` (block_events.py)."""
        return event_extra_keys(self, a, b, lora, salt)

    def event_ids(self, tokens: list[int], hashes: list[int], salt: str | None, lora: str | None) -> list:
        """The KV-event ids of a request's first full blocks, from its tokens (block_events.py)."""
        return event_ids(self, tokens, hashes, salt, lora)
