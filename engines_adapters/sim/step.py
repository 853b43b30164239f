"""One step of the simulated engine (engines_adapters/sim/model.py): schedule a batch like vLLM
v1, model its duration, and report what it produced.

Scheduling per step (vLLM v1 with chunked prefill): decodes first (one token each), then the
partial prefills already running, then waiting requests in FIFO order, until the token budget or
the sequence cap is used. A running request that needs a block when none is free preempts
(recompute) the newest running prefill, else the newest not-yet-scheduled decode, else itself.
A waiting request that does not fit blocks the queue (no preemption for admissions, as vLLM).

Functions of the :class:`~engines_adapters.sim.model.EngineModel` whose queues, blocks and
counters they update; ``EngineModel.step`` calls :func:`run_step`.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .kv_loads import LOOKUP_BLOCKED, LOOKUP_LOADING, lookup, run_timers, write_through
from .records import Finished, FirstToken, StepResult
from .sequence import DONE, HELD, RUNNING, WAITING, Seq

if TYPE_CHECKING:
    from .model import EngineModel


def run_step(e: EngineModel, now: float) -> StepResult:
    """Schedule and 'run' one batch of ``e`` starting at ``now``; see the module docstring."""
    res = StepResult(start=now)
    e._now = now
    if e._loading or e._held_order:
        run_timers(e, now, res)
    kv = e.kv
    bs = e.block_size
    budget = e.max_num_batched_tokens
    corpus = e._corpus
    clen = len(corpus)
    emitted = res.emitted
    done: list[Seq] = []
    to_decode: list[Seq] = []
    first: list[Seq] = []
    decode_kv = 0

    # 1. decodes: one token each
    dec = e._decoding
    i = 0
    while i < len(dec) and budget > 0:
        s = dec[i]
        c = s.computed
        if c >= s.cap:
            if kv.free_plain:
                kv.free_plain -= 1
            elif not _reserve(e, 1, s, dec, i, res):
                continue  # s preempted itself; dec[i] is now the next sequence
            s.n_alloc += 1
            s.cap += bs
        c += 1
        s.computed = c
        decode_kv += c
        if c % bs == 0:
            e._commit(s, c // bs)
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
    pre = e._prefilling
    j = 0
    while j < len(pre) and budget > 0:
        s = pre[j]
        c0 = s.computed
        n = min(s.num_tokens - c0, budget)
        if not _chunk(e, s, n, pre, j, res):
            continue
        budget -= n
        prefill_tokens += n
        prefill_ctx += n * c0 + n * (n + 1) / 2.0
        if s.computed == s.num_tokens:
            sampled += 1
            _sample(e, s, emitted, done, to_decode, first)
        j += 1
    if not res.preempted:
        waiting = e._waiting
        gave_back = False
        while waiting and budget > 0 and len(pre) + len(dec) < e.max_num_seqs:
            s = waiting[0]
            if not s.looked_up:
                got = lookup(e, s, now)
                if got == LOOKUP_LOADING:
                    continue
                if got == LOOKUP_BLOCKED:
                    break
            c0 = s.computed
            n = min(s.num_tokens - c0, budget)
            need = -(-(c0 + n) // bs) - s.n_alloc
            if need > 0 and not kv.alloc(need):
                if not s.loaded:
                    e._free(s)  # give its prefix hits back (vLLM does too); it looks up again
                if not gave_back and not (pre or dec or e._loading):
                    # nothing running will free memory, and waiting requests behind the head
                    # may hold loaded KV: drop it all (it stays cached) and try the head again
                    for w in waiting:
                        e._free(w)
                    gave_back = True
                    continue
                break
            waiting.popleft()
            if not s.loaded:
                e.prefix_queries += s.num_tokens
                e.prefix_hits += s.lookup_hits
                if s.cached_tokens < 0:
                    s.cached_tokens = s.lookup_hits
            s.n_alloc += max(0, need)
            s.cap = s.n_alloc * bs
            s.computed = c0 + n
            if (c0 + n) // bs > s.nb:
                e._commit(s, (c0 + n) // bs)
            s.state = RUNNING
            if s.scheduled is None:
                s.scheduled = now
            pre.append(s)
            budget -= n
            prefill_tokens += n
            prefill_ctx += n * c0 + n * (n + 1) / 2.0
            if s.computed == s.num_tokens:
                sampled += 1
                _sample(e, s, emitted, done, to_decode, first)

    # duration and bookkeeping
    tokens = prefill_tokens + n_decode
    dur = e.timer.duration(tokens, sampled + n_decode, prefill_ctx, decode_kv, prefill_tokens)
    if dur and e.noise:
        dur *= math.exp(e._rng.gauss(0.0, e.noise))
    res.duration = dur
    res.prefill_tokens = prefill_tokens
    res.decode_seqs = n_decode
    end = now + dur
    if first and (e.store_writes or e.store is not None and not e.write_back):
        write_through(e, first, end, res)  # (live write-back: the driver only remembers the keys)
    if e._evicted:
        res.store_evicted, e._evicted = e._evicted, []
    for s in first:
        s.first_token = end
        res.first_tokens.append(FirstToken(s.rid, s.arrival, s.scheduled if s.scheduled is not None else now,
                                           end, s.transfer_s, max(0, s.cached_tokens)))
    if done:
        for s in done:
            _finish(e, s, end, res)
        e._decoding = [s for s in e._decoding if s.state == RUNNING]
    if to_decode or done or pre:
        e._prefilling = [s for s in pre if s.state == RUNNING and not s.decoding]
        e._decoding.extend(s for s in to_decode if s.state == RUNNING)
    if kv.events is not None:
        res.events = kv.events
        kv.events = []
    return res


def _sample(e: EngineModel, s: Seq, emitted, done, to_decode, first) -> None:
    k = s.num_out
    emitted.append((s.rid, e._corpus[(s.out_off + k) % len(e._corpus)]))
    s.num_out = k + 1
    if k == 0:
        first.append(s)
    s.decoding = True
    if s.hold_kv or s.num_out >= s.target:
        done.append(s)
    else:
        to_decode.append(s)


def _finish(e: EngineModel, s: Seq, end: float, res: StepResult) -> None:
    if s.state != RUNNING:
        return
    reason = "length" if s.num_out >= s.max_tokens or s.hold_kv else "stop"
    res.finished.append(Finished(
        s.rid, reason, s.P, s.num_out, max(0, s.cached_tokens), s.arrival,
        s.scheduled if s.scheduled is not None else s.arrival,
        s.first_token if s.first_token is not None else end, end, s.transfer_s, s.preemptions, s.hold_kv,
        s.store_loaded * e.block_size))
    if s.hold_kv:
        s.state = HELD
        s.hold_expires = end + e.kv_hold_timeout
        e._held[s.rid] = s
        e._held_order.append((s.hold_expires, s.rid))
    else:
        s.state = DONE
        del e._seqs[s.rid]
        e._free(s)


def _chunk(e: EngineModel, s: Seq, n: int, pre: list[Seq], j: int, res: StepResult) -> bool:
    """Schedule ``n`` prefill tokens of running sequence ``pre[j]``; False if it was preempted."""
    bs = e.block_size
    c1 = s.computed + n
    need = -(-c1 // bs) - s.n_alloc
    if need > 0:
        if not _reserve(e, need, s, pre, j, res):
            return False
        s.n_alloc += need
        s.cap = s.n_alloc * bs
    s.computed = c1
    if c1 // bs > s.nb:
        e._commit(s, c1 // bs)
    return True


def _reserve(e: EngineModel, n: int, s: Seq, lst: list[Seq], idx: int, res: StepResult) -> bool:
    """Allocate ``n`` blocks for ``s`` (= lst[idx]), preempting newer work; False if ``s``
    itself had to be preempted."""
    kv = e.kv
    while not kv.alloc(n):
        pre, dec = e._prefilling, e._decoding
        if pre and not (lst is pre and len(pre) - 1 <= idx):
            victim = pre[-1]
        elif lst is dec and len(dec) - 1 > idx:
            victim = dec[-1]
        else:
            victim = s
        _preempt(e, victim, res)
        if victim is s:
            return False
    return True


def _preempt(e: EngineModel, s: Seq, res: StepResult) -> None:
    (e._decoding if s in e._decoding else e._prefilling).remove(s)
    e._free(s)
    s.state = WAITING
    s.preemptions += 1
    e.num_preemptions += 1
    e._waiting.appendleft(s)
    res.preempted.append(s.rid)
