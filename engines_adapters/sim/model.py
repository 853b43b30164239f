"""The simulated engine model: a pure, synchronous step machine that schedules like vLLM v1.

No I/O, no clock of its own: the driver passes ``now`` (modelled seconds) to :meth:`step`, which
schedules one batch, returns its modelled duration and what it produced, and expects the next
call at ``now + duration`` or later. The HTTP server drives it in (scaled) real time; the
discrete-event simulator drives it in virtual time. See docs/sim_engine.md for the API contract.

Scheduling per step (vLLM v1 with chunked prefill): decodes first (one token each), then the
partial prefills already running, then waiting requests in FIFO order, until the token budget or
the sequence cap is used. A running request that needs a block when none is free preempts
(recompute) the newest running prefill, else the newest not-yet-scheduled decode, else itself.
A waiting request that does not fit blocks the queue (no preemption for admissions, as vLLM).

Per-step CPU stays small: O(1) work per running sequence, a block is allocated or hashed only
when a sequence crosses a block boundary, and output tokens are read from a shared corpus.
"""
from __future__ import annotations

import heapq
import itertools
import math
import os
import random
from collections import deque
from typing import TYPE_CHECKING

from predictors.types import ROLES
from scheduler.hashing import (
    block_hashes,
    digest_to_int,
    namespace_parent,
    vllm_block_digests,
    vllm_extra_keys,
    vllm_hash_fn,
    vllm_none_hash,
    vllm_seed_text,
)

from ..kv_wire import MEDIUM_GPU, MEDIUM_STORE, BlockStored
from ..sglang_wire import (
    MEDIUM_HOST as SGLANG_MEDIUM_HOST,
    MEDIUM_STORE as SGLANG_MEDIUM_STORE,
    digest_to_event_id,
    page_digests,
    salt_seed,
)
from .kv_cache import Block, KVCache, lora_int_id
from .profiles import Profile
from .records import EngineStats, Finished, FirstToken, HeldKV, SimRequest, StepResult
from .text import OutputSampler
from .timing import StepTimer

if TYPE_CHECKING:
    from ..store.connector import StoreConnector

__all__ = ["ROLES", "EngineModel", "EngineStats", "Finished", "FirstToken", "HeldKV", "SimRequest", "StepResult"]

# request states
WAITING, RUNNING, LOADING, HELD, DONE = range(5)
_REMOTE, _HOST = 0, 1
_READY, _LOADING, _BLOCKED = range(3)


class _Seq:
    __slots__ = ("rid", "prompt", "P", "max_tokens", "target", "hold_kv", "remote_kv", "remote_done",
                 "hashes", "nb", "n_alloc", "cap", "computed", "num_out", "out_off", "state",
                 "looked_up", "arrival", "scheduled", "first_token", "cached_tokens", "transfer_s",
                 "preemptions", "load_kind", "load_hits", "load_start", "hold_expires", "decoding", "loaded",
                 "lookup_hits", "root", "salt", "lora", "store_blocks", "store_fetched", "store_load_s",
                 "store_loaded")

    def __init__(self, req: SimRequest, now: float, hashes: list[int], out_off: int, target: int):
        self.rid = req.request_id
        self.prompt = req.prompt
        self.P = len(req.prompt)
        self.max_tokens = req.max_tokens
        self.target = target
        self.hold_kv = req.hold_kv
        self.remote_kv = req.remote_kv
        self.remote_done = False
        self.hashes = hashes
        self.nb = 0  # full blocks held: the first nb of hashes (cached, referenced)
        self.n_alloc = 0
        self.cap = 0
        self.computed = 0
        self.num_out = 0
        self.out_off = out_off
        self.state = WAITING
        self.looked_up = False
        self.arrival = now
        self.scheduled: float | None = None
        self.first_token: float | None = None
        self.cached_tokens = -1
        self.transfer_s = 0.0
        self.preemptions = 0
        self.load_kind = _REMOTE
        self.load_hits = (0, 0)
        self.load_start = 0.0
        self.hold_expires = 0.0
        self.decoding = False  # sampled at the end of its prefill: one token per step from now on
        self.loaded = False  # holds KV loaded from a remote instance or the host tier
        self.lookup_hits = 0  # prefix tokens found by the pending lookup (counted on admission)
        self.salt = req.cache_salt or None
        self.lora = req.lora_name or None
        self.root = namespace_parent(self.salt, self.lora)  # the chain's root: its prefix-cache namespace
        self.store_blocks, self.store_fetched, self.store_load_s = req.store_blocks, req.store_fetched, req.store_load_s
        self.store_loaded = 0  # blocks loaded from the shared store

    @property
    def num_tokens(self) -> int:
        return self.P + self.num_out


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
        self._waiting: deque[_Seq] = deque()
        self._prefilling: list[_Seq] = []
        self._decoding: list[_Seq] = []
        self._loading: list[tuple[float, int, _Seq]] = []
        self._held: dict[str, _Seq] = {}
        self._held_order: deque[tuple[float, str]] = deque()
        self._seqs: dict[str, _Seq] = {}
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
        s = _Seq(req, now, hashes, off, max(1, target))
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
        """Schedule and 'run' one batch starting at ``now``; see the module docstring."""
        res = StepResult(start=now)
        self._now = now
        if self._loading or self._held_order:
            self._run_timers(now, res)
        kv = self.kv
        bs = self.block_size
        budget = self.max_num_batched_tokens
        corpus = self._corpus
        clen = len(corpus)
        emitted = res.emitted
        done: list[_Seq] = []
        to_decode: list[_Seq] = []
        first: list[_Seq] = []
        decode_kv = 0

        # 1. decodes: one token each
        dec = self._decoding
        i = 0
        while i < len(dec) and budget > 0:
            s = dec[i]
            c = s.computed
            if c >= s.cap:
                if kv.free_plain:
                    kv.free_plain -= 1
                elif not self._reserve(1, s, dec, i, res):
                    continue  # s preempted itself; dec[i] is now the next sequence
                s.n_alloc += 1
                s.cap += bs
            c += 1
            s.computed = c
            decode_kv += c
            if c % bs == 0:
                self._commit(s, c // bs)
            k = s.num_out
            emitted.append((s.rid, corpus[(s.out_off + k) % clen]))
            s.num_out = k + 1
            if k + 1 >= s.target:
                done.append(s)
            budget -= 1
            i += 1
        n_decode = i

        # 2. partial prefills already running, 3. waiting requests
        prefill_tokens = 0
        prefill_ctx = 0.0
        sampled = 0
        pre = self._prefilling
        j = 0
        while j < len(pre) and budget > 0:
            s = pre[j]
            c0 = s.computed
            n = min(s.num_tokens - c0, budget)
            if not self._chunk(s, n, pre, j, res):
                continue
            budget -= n
            prefill_tokens += n
            prefill_ctx += n * c0 + n * (n + 1) / 2.0
            if s.computed == s.num_tokens:
                sampled += 1
                self._sample(s, emitted, done, to_decode, first)
            j += 1
        if not res.preempted:
            waiting = self._waiting
            gave_back = False
            while waiting and budget > 0 and len(pre) + len(dec) < self.max_num_seqs:
                s = waiting[0]
                if not s.looked_up:
                    got = self._lookup(s, now)
                    if got == _LOADING:
                        continue
                    if got == _BLOCKED:
                        break
                c0 = s.computed
                n = min(s.num_tokens - c0, budget)
                need = -(-(c0 + n) // bs) - s.n_alloc
                if need > 0 and not kv.alloc(need):
                    if not s.loaded:
                        self._free(s)  # give its prefix hits back (vLLM does too); it looks up again
                    if not gave_back and not (pre or dec or self._loading):
                        # nothing running will free memory, and waiting requests behind the head
                        # may hold loaded KV: drop it all (it stays cached) and try the head again
                        for w in waiting:
                            self._free(w)
                        gave_back = True
                        continue
                    break
                waiting.popleft()
                if not s.loaded:
                    self.prefix_queries += s.num_tokens
                    self.prefix_hits += s.lookup_hits
                    if s.cached_tokens < 0:
                        s.cached_tokens = s.lookup_hits
                s.n_alloc += max(0, need)
                s.cap = s.n_alloc * bs
                s.computed = c0 + n
                if (c0 + n) // bs > s.nb:
                    self._commit(s, (c0 + n) // bs)
                s.state = RUNNING
                if s.scheduled is None:
                    s.scheduled = now
                pre.append(s)
                budget -= n
                prefill_tokens += n
                prefill_ctx += n * c0 + n * (n + 1) / 2.0
                if s.computed == s.num_tokens:
                    sampled += 1
                    self._sample(s, emitted, done, to_decode, first)

        # duration and bookkeeping
        tokens = prefill_tokens + n_decode
        dur = self.timer.duration(tokens, sampled + n_decode, prefill_ctx, decode_kv, prefill_tokens)
        if dur and self.noise:
            dur *= math.exp(self._rng.gauss(0.0, self.noise))
        res.duration = dur
        res.prefill_tokens = prefill_tokens
        res.decode_seqs = n_decode
        end = now + dur
        if first and (self.store_writes or self.store is not None and not self.write_back):
            self._write_through(first, end, res)  # (live write-back: the driver only remembers the keys)
        if self._evicted:
            res.store_evicted, self._evicted = self._evicted, []
        for s in first:
            s.first_token = end
            res.first_tokens.append(FirstToken(s.rid, s.arrival, s.scheduled if s.scheduled is not None else now,
                                               end, s.transfer_s, max(0, s.cached_tokens)))
        if done:
            for s in done:
                self._finish(s, end, res)
            self._decoding = [s for s in self._decoding if s.state == RUNNING]
        if to_decode or done or pre:
            self._prefilling = [s for s in pre if s.state == RUNNING and not s.decoding]
            self._decoding.extend(s for s in to_decode if s.state == RUNNING)
        if kv.events is not None:
            res.events = kv.events
            kv.events = []
        return res

    # --- internals --------------------------------------------------------------------------
    def _sample(self, s: _Seq, emitted, done, to_decode, first) -> None:
        k = s.num_out
        emitted.append((s.rid, self._corpus[(s.out_off + k) % len(self._corpus)]))
        s.num_out = k + 1
        if k == 0:
            first.append(s)
        s.decoding = True
        if s.hold_kv or s.num_out >= s.target:
            done.append(s)
        else:
            to_decode.append(s)

    def _finish(self, s: _Seq, end: float, res: StepResult) -> None:
        if s.state != RUNNING:
            return
        reason = "length" if s.num_out >= s.max_tokens or s.hold_kv else "stop"
        res.finished.append(Finished(
            s.rid, reason, s.P, s.num_out, max(0, s.cached_tokens), s.arrival,
            s.scheduled if s.scheduled is not None else s.arrival,
            s.first_token if s.first_token is not None else end, end, s.transfer_s, s.preemptions, s.hold_kv,
            s.store_loaded * self.block_size))
        if s.hold_kv:
            s.state = HELD
            s.hold_expires = end + self.kv_hold_timeout
            self._held[s.rid] = s
            self._held_order.append((s.hold_expires, s.rid))
        else:
            s.state = DONE
            del self._seqs[s.rid]
            self._free(s)

    def _free(self, s: _Seq) -> None:
        self.kv.release(s.hashes, s.nb, s.n_alloc - s.nb)
        s.nb = 0
        s.n_alloc = 0
        s.cap = 0
        s.computed = 0
        s.looked_up = False
        s.decoding = False
        s.loaded = False

    def _chunk(self, s: _Seq, n: int, pre: list[_Seq], j: int, res: StepResult) -> bool:
        """Schedule ``n`` prefill tokens of running sequence ``pre[j]``; False if it was preempted."""
        bs = self.block_size
        c1 = s.computed + n
        need = -(-c1 // bs) - s.n_alloc
        if need > 0:
            if not self._reserve(need, s, pre, j, res):
                return False
            s.n_alloc += need
            s.cap = s.n_alloc * bs
        s.computed = c1
        if c1 // bs > s.nb:
            self._commit(s, c1 // bs)
        return True

    def _reserve(self, n: int, s: _Seq, lst: list[_Seq], idx: int, res: StepResult) -> bool:
        """Allocate ``n`` blocks for ``s`` (= lst[idx]), preempting newer work; False if ``s``
        itself had to be preempted."""
        kv = self.kv
        while not kv.alloc(n):
            pre, dec = self._prefilling, self._decoding
            if pre and not (lst is pre and len(pre) - 1 <= idx):
                victim = pre[-1]
            elif lst is dec and len(dec) - 1 > idx:
                victim = dec[-1]
            else:
                victim = s
            self._preempt(victim, res)
            if victim is s:
                return False
        return True

    def _preempt(self, s: _Seq, res: StepResult) -> None:
        (self._decoding if s in self._decoding else self._prefilling).remove(s)
        self._free(s)
        s.state = WAITING
        s.preemptions += 1
        self.num_preemptions += 1
        self._waiting.appendleft(s)
        res.preempted.append(s.rid)

    def _lookup(self, s: _Seq, now: float) -> int:
        """Prefix-cache lookup for the waiting head: it is ready to compute (_READY), left for a
        KV load (_LOADING), or cannot get blocks for its load (_BLOCKED)."""
        kv = self.kv
        bs = self.block_size
        limit = (s.num_tokens - 1) // bs
        if len(s.hashes) < limit:
            limit = len(s.hashes)
        g = kv.acquire_prefix(s.hashes, limit)  # the hits are referenced at once (both paths keep them)
        remote = s.remote_kv and not s.remote_done
        # a remote pull brings everything beyond the device hits: host copies are not used (nor counted)
        hh = kv.match_host(s.hashes, g, limit) if kv.host_capacity and not remote else 0
        sb, store_ready = (0, now) if remote else self._store_lookup(s, g + hh, limit, now)
        if remote or hh or sb:
            need = (-(-s.P // bs) - g) if remote else hh + sb
            if not kv.alloc(need):
                kv.release(s.hashes, g, 0)
                return _BLOCKED
            self._waiting.popleft()
            s.nb = g
            s.n_alloc = g + need
            s.cap = s.n_alloc * bs
            s.computed = g * bs
            s.looked_up = True
            s.state = LOADING
            if remote:
                nbytes = (s.P - g * bs) * self._kv_bytes
                start = max(now, self._net_free_at)
                self._net_free_at = start + nbytes / self.net_bytes_per_s
                ready = self._net_free_at + self.transfer_latency_s
                s.load_kind = _REMOTE
            else:  # the host-tier part at host bandwidth, the store part as the store modelled it
                ready = store_ready
                if hh:
                    start = max(now, self._host_free_at)
                    self._host_free_at = start + hh * bs * self._kv_bytes / self.host_bytes_per_s
                    ready = max(ready, self._host_free_at)
                s.load_kind = _HOST
            s.load_hits = (g, hh + sb)
            s.load_start = now
            self.prefix_queries += s.num_tokens
            self.prefix_hits += (g + hh + sb) * bs
            self.host_hits += hh * bs
            if sb:
                s.store_loaded += sb
                self.store_hits += sb * bs
                self.store_loads += 1
                self.store_load_s += store_ready - now
            if s.scheduled is None:
                s.scheduled = now
            heapq.heappush(self._loading, (ready, next(self._tie), s))
            return _LOADING
        s.nb = g
        s.n_alloc = g
        s.cap = g * bs
        s.computed = g * bs
        s.looked_up = True
        s.lookup_hits = g * bs
        return _READY

    def _store_lookup(self, s: _Seq, start: int, limit: int, now: float) -> tuple[int, float]:
        """Blocks beyond ``start`` to load from the shared store, and when the load ends."""
        if start >= limit:
            return 0, now
        if self.store is not None:
            return self.store.lookup(s.hashes, start, limit, now)
        have = min(s.store_blocks, limit)
        if have <= start or s.store_fetched <= 0:
            return 0, now
        sb = have - start  # the engine's own prefix may have grown since the store was asked
        return sb, now + s.store_load_s * min(1.0, sb / s.store_fetched)

    def _written_back(self, hashes: list[int]) -> None:
        assert self.store is not None
        self.store.write_blocks(hashes, self._now)

    def _evicted_live(self, hashes: list[int]) -> None:
        """Live write-back: each evicted block with its event ids (its metadata is still here)."""
        meta = self.kv.meta
        for h in hashes:
            m = meta.get(h) if meta is not None else None
            self._evicted.append((h, None, None, None, None) if m is None else (h, m.vh, m.parent_vh, m.keys, m.lora))

    def _write_through(self, first: list[_Seq], end: float, res: StepResult) -> None:
        """Prompts just prefilled here go to the store (not a pulled one: its prefill side writes)."""
        bs = self.block_size
        for s in first:
            n = s.P // bs
            if s.remote_kv or n == 0:
                continue
            if self.store is not None:  # keyed by the namespaced chain: tenants never share
                self.store.write(s.hashes, n, end)
            else:  # the live connector folds the namespace into its keys as the engine's recipe does
                res.store_writes.append((s.rid, s.prompt[:n * bs], s.hashes[:n], s.salt, s.lora))

    def _run_timers(self, now: float, res: StepResult) -> None:
        loaded: list[_Seq] = []
        while self._loading and self._loading[0][0] <= now:
            ready, _, s = heapq.heappop(self._loading)
            if s.state != LOADING:
                continue  # aborted while loading
            g, hh = s.load_hits
            if s.load_kind == _REMOTE:
                s.remote_done = True
                s.computed = s.P - 1
                res.kv_loaded.append(s.rid)
            else:
                for h in s.hashes[g:g + hh]:
                    if h in self.kv.host:
                        self.kv.host.move_to_end(h)
                s.computed = (g + hh) * self.block_size
            if s.cached_tokens < 0:
                s.cached_tokens = s.computed
            s.transfer_s += ready - s.load_start
            self._commit(s, s.computed // self.block_size)
            s.state = WAITING
            s.loaded = True
            loaded.append(s)
        if loaded:
            self._waiting.extendleft(reversed(loaded))
        order = self._held_order
        while order and order[0][0] <= now:
            t, rid = order.popleft()
            s = self._held.get(rid)
            if s is not None and s.hold_expires == t:
                self.release_kv(rid)
                res.expired.append(rid)

    def _tokens(self, s: _Seq, a: int, b: int) -> list[int]:
        """Token ids at positions ``a..b`` of a sequence (prompt, then output)."""
        P = s.P
        if b <= P:
            return s.prompt[a:b]
        out = s.prompt[a:P] if a < P else []
        out += self.sampler.tokens(s.out_off, max(a, P) - P, b - P)
        return out

    def _commit(self, s: _Seq, upto: int) -> None:
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
            self._stored(s, new)

    def event_extra_keys(self, a: int, b: int, lora: str | None, salt: str | None) -> list:
        """The ``extra_keys`` of a BlockStored for blocks ``a..b`` of a request's chain: as vLLM's
        BlockPool, one entry per block (LoRA name, salt on block 0); SGLang names the salt on
        every event of a salted chain."""
        if self._sglang_ids and salt:
            return [(salt,)] * (b - a)
        if lora or salt:
            return [vllm_extra_keys(a + off == 0, lora, salt) for off in range(b - a)]
        return [None] * (b - a)

    def event_ids(self, tokens: list[int], hashes: list[int], salt: str | None, lora: str | None) -> list:
        """The KV-event ids of a request's first ``len(tokens) // block_size`` blocks, from its
        tokens (what ``_stored`` names them, without needing them cached here)."""
        bs = self.block_size
        if self._index_ids:
            return list(hashes[:len(tokens) // bs])
        if self._sglang_ids:
            return [digest_to_event_id(d) for d in page_digests(tokens, bs, salt_seed(salt))]
        ds = vllm_block_digests(tokens, bs, parent=self._none_digest, algo=self.hash_algo, lora_name=lora,
                                cache_salt=salt, first=True)
        return [digest_to_int(d) for d in ds] if self._int_ids else ds

    def _stored(self, s: _Seq, idxs: list[int]) -> None:
        """BlockStored events for newly cached blocks (offsets ``idxs`` of the sequence's chain),
        one per contiguous run; named by vLLM sha256 ids, or by the chained hash ("index")."""
        bs = self.block_size
        kv = self.kv
        meta = kv.meta
        keep_tokens = kv.host_capacity > 0
        hashes_all = s.hashes
        events = kv.events
        assert events is not None
        lora, salt = s.lora, s.salt
        lora_id = lora_int_id(lora)
        for a, b in _runs(idxs):
            tokens = self._tokens(s, a * bs, b * bs)
            keys = self.event_extra_keys(a, b, lora, salt)
            if meta is None:  # index ids, no host tier: a block's id is its hash
                events.append(BlockStored(
                    block_hashes=hashes_all[a:b], parent_block_hash=hashes_all[a - 1] if a else None,
                    token_ids=tokens, block_size=bs, lora_id=lora_id, medium=MEDIUM_GPU, lora_name=lora,
                    extra_keys=keys, group_idx=0))
                continue
            parent = meta[hashes_all[a - 1]] if a else None
            parent_vh = parent.vh if parent else None
            hashes: list[int] = []
            if self._index_ids:
                for off in range(b - a):
                    h = hashes_all[a + off]
                    meta[h] = Block(h, None, parent_vh if off == 0 else hashes[-1],
                                    tuple(tokens[off * bs:(off + 1) * bs]) if keep_tokens else None, keys[off], lora)
                    hashes.append(h)
            else:
                if self._sglang_ids:  # a page chains from its parent page's digest (the root: none, or the salt's)
                    digests = page_digests(tokens, bs, parent.vdigest if parent else salt_seed(salt))
                else:
                    digests = vllm_block_digests(tokens, bs, parent=parent.vdigest if parent else self._none_digest,
                                                 algo=self.hash_algo, lora_name=lora, cache_salt=salt, first=a == 0)
                for off, d in enumerate(digests):
                    if self._sglang_ids:
                        vh = digest_to_event_id(d)
                    else:
                        vh = digest_to_int(d) if self._int_ids else d
                    meta[hashes_all[a + off]] = Block(vh, d, parent_vh if off == 0 else hashes[-1],
                                                      tuple(tokens[off * bs:(off + 1) * bs]) if keep_tokens else None,
                                                      keys[off], lora)
                    hashes.append(vh)
            events.append(BlockStored(
                block_hashes=hashes, parent_block_hash=parent_vh, token_ids=tokens, block_size=bs,
                lora_id=lora_id, medium=MEDIUM_GPU, lora_name=lora, extra_keys=keys, group_idx=0))


def _runs(idxs: list[int]) -> list[tuple[int, int]]:
    """Contiguous runs ``[a, b)`` of sorted offsets."""
    if idxs[-1] - idxs[0] + 1 == len(idxs):
        return [(idxs[0], idxs[-1] + 1)]
    out = []
    a = prev = idxs[0]
    for i in idxs[1:]:
        if i != prev + 1:
            out.append((a, prev + 1))
            a = i
        prev = i
    out.append((a, prev + 1))
    return out
