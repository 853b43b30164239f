"""The stages of one decision, in order over one :class:`DecisionContext`; the scheduler facade
(scheduler/scheduler.py) runs them for ``decide`` and ``evaluate``.

validate -> eligible candidates (healthy, not excluded, context long enough) -> cache facts
(every instance's longest prefix, and the store's, from the prefix index) -> terms (each prefill
candidate's transfer, queue and prefill; each decode candidate's TBT) -> choice (the policy picks
the prefill instance, then the decode instance; a ``both`` instance decodes its own request) ->
admission (TTFT with the prefill->decode KV shipment, and TBT, against the SLO) -> commit
(reserve in the ledger, keep the explanation). A stage refuses by raising :class:`Refused`.
Each stage is a function of the Scheduler it decides for (its settings, ledger, index, predictors,
policy), so the facade keeps only membership and the request's calls.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

import xxhash

from predictors.base import DecodeState, PrefillState
from predictors.telemetry import SLO
from predictors.types import Role, Tier
from scheduler import admission
from scheduler.cost import DecisionContext, DecodeCandidate, PrefillCandidate, TermBook, best_holder
from scheduler.explain import bare_record, decision_record, request_labels
from scheduler.frame import LoadFrame
from scheduler.ledger import Reservation
from scheduler.policies import PrefillChoice
from scheduler.types import BAD_REQUEST, UNAVAILABLE, Instance, Placement, Rejection, RequestFacts
from scheduler.validation import check_facts

if TYPE_CHECKING:
    from scheduler.scheduler import Scheduler


def decide(sched: Scheduler, facts: Any, exclude: frozenset[str], commit: bool,
           avoid: frozenset[str] = frozenset(), frame: LoadFrame | None = None) -> Placement | Rejection:
    """The stages in order; a stage that refuses raises :class:`Refused`."""
    now = sched.clock() if frame is None else frame.now
    try:
        _validate(sched, facts, now, commit)
        made = frame.chosen(facts, exclude, avoid) if commit and frame is not None else None
        if made is None:
            ctx = DecisionContext(facts, now, sched.block_size, sched.predictors, _rng_for(sched, facts.request_id))
            ctx.slo = admission.resolve_slo(sched.slo, facts.slo)
            ctx.admit_fraction = sched._headroom(facts)
            _eligible(sched, ctx, exclude)
            _cache_facts(sched, ctx, frame)
            _terms(sched, ctx, avoid, frame)
            choice = _choose(sched, ctx)
            if frame is not None and not commit:
                frame.keep_choice(facts, exclude, avoid, ctx, choice)
        else:  # the evaluation just made of these facts through this frame: its choice, admitted anew
            ctx, choice = made
        if sched.overload is not None:
            _overload(sched, ctx, choice, commit)
        _admit(sched, ctx, choice, commit)
    except Refused as r:
        return sched._refuse(facts, r.status, r.reason, r.message, now, commit, r.record, r.retry_after_s)
    return _commit(sched, ctx, choice, commit)


# --- stage 0: the request is well formed and new -------------------------------------
def _validate(sched: Scheduler, facts: Any, now: float, commit: bool) -> None:
    bad = check_facts(facts, sched.block_size)
    if bad is not None:
        raise Refused(BAD_REQUEST, bad[0], bad[1])
    if commit and facts.request_id in sched.ledger:
        raise Refused(BAD_REQUEST, "duplicate_request_id",
                      f"request {facts.request_id!r} already holds a reservation")


# --- stage 1: eligible candidates (healthy, not excluded, long enough a context) --------
def _eligible(sched: Scheduler, ctx: DecisionContext, exclude: frozenset[str]) -> None:
    facts = ctx.facts
    pools = sched._pools(exclude)
    model = getattr(facts, "model", None)
    if model is not None and sched._models:
        pools = sched._for_model(pools, model)
    if not pools.prefill:
        raise Refused(UNAVAILABLE, "no_healthy_prefill", "no healthy prefill instance")
    need = facts.prompt_tokens + facts.max_tokens
    if need > pools.prefill_max_len:
        raise Refused(BAD_REQUEST, "prompt_too_long",
                      f"{facts.prompt_tokens} prompt + {facts.max_tokens} output tokens exceed the "
                      f"{pools.prefill_max_len}-token context")
    decode_pool = pools.decode
    if need > pools.decode_min_len:
        decode_pool = [i for i in decode_pool if sched._max_len[i.id] >= need]
    prefill_pool = pools.prefill
    if pools.mixed:  # a prefill-only instance needs a decode instance of its protocol
        protos = {i.protocol for i in decode_pool}
        prefill_pool = [i for i in prefill_pool if i.role == Role.BOTH or i.protocol in protos]
    if need > pools.prefill_min_len or (not decode_pool and pools.prefill_only):
        prefill_pool = [i for i in prefill_pool
                        if sched._max_len[i.id] >= need and (i.role == Role.BOTH or decode_pool)]
    if not prefill_pool:
        raise Refused(UNAVAILABLE, "no_healthy_decode", "no healthy decode instance for a prefill-only instance")
    ctx.prefill_pool, ctx.decode_pool = prefill_pool, decode_pool


# --- stage 2: cache facts (longest prefix per instance and in the store) ---------------
def _cache_facts(sched: Scheduler, ctx: DecisionContext, frame: LoadFrame | None = None) -> None:
    facts = ctx.facts
    # never the last prompt token's block (the engine recomputes that token for its logits)
    usable = min(len(facts.block_hashes), (facts.prompt_tokens - 1) // sched.block_size)
    raw = getattr(facts, "store_blocks", None)
    told = raw if isinstance(raw, int) and not isinstance(raw, bool) else None
    walk, version = told is None, getattr(sched.index, "version", None)
    match = None if frame is None else frame.match(facts.request_id, version, facts.block_hashes, usable, walk)
    if match is None:
        try:  # a store answer from the store itself makes the index's store walk redundant
            match = sched.index.match(facts.block_hashes, usable, store=walk)
        except TypeError:
            raise Refused(BAD_REQUEST, "bad_block_hashes", "block hashes must be integers") from None
        if frame is not None:
            frame.keep_match(facts.request_id, version, facts.block_hashes, usable, walk, match)
    ctx.match = match
    ctx.store_blocks = ctx.match.store
    if told is not None and told > ctx.store_blocks:
        ctx.store_blocks = min(told, usable)
    ctx.usable_blocks = usable
    if sched._inflight:
        sched.inflight.expire(ctx.now)
        ctx.pending = sched.inflight.match(facts.block_hashes, usable)


# --- stage 3: every candidate's predicted terms ------------------------------------------
def _terms(sched: Scheduler, ctx: DecisionContext, avoid: frozenset[str] = frozenset(),
           frame: LoadFrame | None = None) -> None:
    pred, ledger, now, match = sched.predictors, sched.ledger, ctx.now, ctx.match
    assert match is not None, "the cache-facts stage runs first"
    book = ctx.terms = TermBook(ctx.facts.prompt_tokens, sched.block_size, ctx.store_blocks, pred)
    sched.store_traffic.advance(now)  # O(1) amortised: what the store term and the record read
    queue_time, group = pred.queue.queue_time, sched._group if pred.groups is None else pred.groups
    dev, loc = match.device, match.local
    prefill, pool = ctx.prefill, ctx.prefill_pool
    if frame is None:
        states, actives = ledger.prefill_views([i.id for i in pool], now)
        queues: Iterable[float] = map(queue_time, states)  # lazily: asked in the order it always was
    else:
        states, actives, queues = prefill_views(sched, pool, now, frame)
    for i, state, active, queue_s in zip(pool, states, actives, queues, strict=True):
        iid = i.id
        c = PrefillCandidate(iid, i.role, dev.get(iid, 0), loc.get(iid, 0), state, queue_s, active, group[iid])
        c.local = book.local(c)
        prefill.append(c)
    if frame is None:
        ctx.decode_load = ledger.decode_load(len(ctx.decode_pool), now)
    else:  # sampled at this instant once: a second call then returns the same and changes nothing
        n = len(ctx.decode_pool)
        load = frame.decode_load.get(n)
        if load is None:
            load = frame.decode_load[n] = ledger.decode_load(n, now)
        ctx.decode_load = load
    if pred.decode_load is not None:  # the cluster's decode load, before any TBT is asked
        pred.decode_load(ctx.decode_load)
    ctx.decode = decode_candidates(sched, ctx.decode_pool, ctx.facts, now, None, frame)
    ctx.holder, ctx.holder_blocks = best_holder(prefill, ctx.store_blocks)
    if avoid:  # not a destination, still a holder to pull from
        prefill[:] = [c for c in prefill if c.id not in avoid]
        if not prefill:
            raise Refused(UNAVAILABLE, "no_healthy_prefill", "every healthy prefill instance is avoided")


# --- stage 4: the policy's choice of prefill, then decode ----------------------------
def _choose(sched: Scheduler, ctx: DecisionContext) -> Choice:
    pc = sched.policy.choose_prefill(ctx)
    p, terms = pc.candidate, pc.terms
    ctx.prefill_ready_s = p.ttft(terms)
    prefill_done_at = ctx.now + ctx.prefill_ready_s
    if sched.early_rejection:  # decode load predicted when this prefill finishes (Mooncake §7.4)
        ctx.decode = decode_candidates(sched, ctx.decode_pool, ctx.facts, ctx.now, prefill_done_at)
    if p.role != Role.BOTH and sched._pools(frozenset()).mixed:  # never mix protocols
        proto = sched._instances[p.id].protocol
        ctx.decode = [d for d in ctx.decode if sched._instances[d.id].protocol == proto]
    _kv_waits(sched, ctx, prefill_done_at)
    if p.role != Role.BOTH:
        dc = sched.policy.choose_decode(ctx, p)
        return Choice(pc, dc.candidate, dc.why, dc.scores, True, prefill_done_at)
    d = next((x for x in ctx.decode if x.id == p.id), None)
    if d is None:
        d = decode_candidates(sched, [sched._instances[p.id]], ctx.facts, ctx.now,
                              prefill_done_at if sched.early_rejection else None)[0]
    return Choice(pc, d, "a 'both' instance decodes what it prefilled", {}, False, prefill_done_at)


def _kv_waits(sched: Scheduler, ctx: DecisionContext, ready_at: float) -> None:
    """Each decode candidate's wait for room for this request's KV (prompt + a block), from
    when the prefill would be done (a colocated instance prefills into its own memory)."""
    need = ctx.facts.prompt_tokens + sched.block_size
    shipped = [d for d in ctx.decode if d.role != Role.BOTH]
    for d, wait in zip(shipped, sched.ledger.decode_kv_waits([d.id for d in shipped], need, ready_at, ctx.now),
                       strict=True):
        d.kv_wait_s = wait


# --- stage 4b: overload admission by cost (scheduler/overload.py) -----------------------
def _overload(sched: Scheduler, ctx: DecisionContext, ch: Choice, commit: bool) -> None:
    """Judge the request's cost against the overload threshold; ``evaluate`` does not count it
    as demand, a retry does not count it twice."""
    assert sched.overload is not None
    rows = ch.prefill.rows or {}
    cost = min(rows.get(c.id, c.local).prefill_s for c in ctx.prefill)
    slo = admission.scaled_slo(ctx.slo, ctx.admit_fraction)
    healthy = len(sched._pools(frozenset()).prefill)
    ch.cost_verdict, ch.overload = sched.overload.check(ctx.facts.request_id, cost, ctx.now, healthy, slo.ttft_s,
                                                        commit)


def _span_tbt(sched: Scheduler, d: DecodeCandidate, facts: RequestFacts) -> float:
    """The TBT a reservation's decode span is predicted with: the decode wait's replay holds
    whole contexts against the capacity, so it frees room at the right rate with the step of a
    cache holding no more than that (``kv_share`` 1), not with the true, slower step of the
    larger batch the engine fits by sharing prefix blocks (docs/predictors.md, "Shared prefixes
    on a full decode cache")."""
    if d.state.kv_share >= 1.0:
        return d.tbt_s
    return sched.predictors.tbt.tbt(d.state._replace(kv_share=1.0), facts.prompt_tokens, facts.max_tokens)


# --- stage 5: admission against the SLO ----------------------------------------------
def _admit(sched: Scheduler, ctx: DecisionContext, ch: Choice, commit: bool = True) -> None:
    """Fill in the pair's TTFT, SLO and record; a violated SLO refuses (raises ``Refused``)."""
    facts, p, d = ctx.facts, ch.prefill.candidate, ch.decode
    ready = ctx.prefill_ready_s
    if d.id != p.id:  # a separate decode instance: room for the KV, the shipment, then its first step
        ch.kv_s = sched.predictors.transfer.transfer_time(facts.prompt_tokens, p.id, d.id)
        ch.first_step_s = d.tbt_s
        ch.decode_wait_s = max(0.0, d.kv_wait_s - ready)
    ch.ttft = ready + ch.decode_wait_s + ch.kv_s + ch.first_step_s
    ch.slo = ctx.slo
    slo = admission.scaled_slo(ctx.slo, ctx.admit_fraction)  # a priority class's share of the SLO
    floor = None  # the best TTFT any candidate could give once its queue drains
    if slo.ttft_s is not None and ch.ttft > slo.ttft_s:
        rows = ch.prefill.rows or {}
        floor = min(c.ttft(rows.get(c.id, c.local)) - c.queue_s for c in ctx.prefill) + ch.kv_s + ch.first_step_s
    ttft_verdict = admission.check_ttft(ch.ttft, p.queue_s, slo.ttft_s, floor)
    departures, at = [], ctx.now
    late = sched.late_rejection and d.id != p.id  # TBT is checked after the prefill (admit_decode)
    if slo.tbt_s is not None and d.tbt_s > slo.tbt_s and not late:
        departures = sched.ledger.decode_departures(d.id)
        if sched.early_rejection:  # d.state is the load at prefill_done_at: count from there
            at = ch.prefill_done_at
            departures = [r for r in departures if r.decode_start_s <= at < r.decode_end_s]
    tbt_verdict = None if late else admission.check_tbt(d.tbt_s, slo.tbt_s, d.state, departures,
                                                        facts.prompt_tokens, facts.max_tokens, sched.predictors, at)
    ch.violations = [v for v in (ttft_verdict, tbt_verdict, ch.cost_verdict) if v is not None]
    record = decision_record(ctx, ch, sched.policy_name, sched.policy.score_name, sched.admission,
                             sched.early_rejection, commit)
    verdict = ttft_verdict or tbt_verdict or ch.cost_verdict
    if verdict is not None and sched.admission:
        raise Refused(verdict.status, verdict.reason, verdict.message, record, verdict.retry_after_s)
    ch.record = record


# --- stage 5, late (``late_rejection``): the decode instance's TBT once the prefill is done -----
def admit_decode(sched: Scheduler, facts: RequestFacts, decode: str) -> Rejection | None:
    """``Scheduler.admit_decode``: the TBT check ``late_rejection`` leaves until the prefill is done."""
    slo = admission.scaled_slo(admission.resolve_slo(sched.slo, facts.slo), sched._headroom(facts))
    if not sched.late_rejection or slo.tbt_s is None or facts.request_id not in sched.ledger:
        return None
    now = sched.clock()
    decoding = [x for x in sched.ledger.decode_departures(decode)
                if not x.prefill_pending and x.request_id != facts.request_id]
    state = DecodeState(decode, len(decoding), sum(x.kv_tokens for x in decoding),
                        sched.ledger.decode_state(decode, now).kv_share)
    tbt = sched.predictors.tbt.tbt(state, facts.prompt_tokens, facts.max_tokens)
    v = admission.check_tbt(tbt, slo.tbt_s, state, decoding, facts.prompt_tokens, facts.max_tokens,
                            sched.predictors, now)
    if v is None:
        return None
    sched._count(v.reason)
    record = bare_record(facts.request_id, sched.policy_name, now, v.reason, v.message)
    record.update(request_labels(facts, sched._headroom(facts)), stage="decode")
    return Rejection(facts.request_id, v.status, v.reason, v.message, v.retry_after_s, record)


# --- stage 6: reserve in the ledger and keep the explanation --------------------------
def _commit(sched: Scheduler, ctx: DecisionContext, ch: Choice, commit: bool) -> Placement:
    facts, p, d, terms = ctx.facts, ch.prefill.candidate, ch.decode, ch.prefill.terms
    rid, now = facts.request_id, ctx.now
    now_state = sched.ledger.decode_state(d.id, now) if sched.early_rejection else d.state
    placement = Placement(
        request_id=rid, prefill=p.id, decode=d.id, hit_tokens=terms.hit_tokens,
        local_hit_tokens=terms.local_hit_tokens, transfer_tokens=terms.transfer_tokens,
        transfer_from=terms.transfer_from, queue_s=p.queue_s, prefill_s=terms.prefill_s,
        transfer_s=terms.transfer_s, ttft_s=ch.ttft, tbt_s=d.tbt_s, queue_tokens=p.state.queued_tokens,
        queue_requests=p.state.queued_requests, decode_running=now_state.running,
        decode_kv_tokens=now_state.kv_tokens, decode_cluster_running=ctx.decode_load,
        decode_kv_share=now_state.kv_share,
        explanation=ch.record, kv_transfer_s=ch.kv_s,
        decode_first_step_s=ch.first_step_s, decode_wait_s=ch.decode_wait_s,
        policy=sched.policy_name, host_tokens=terms.host_tokens)
    traffic = sched.store_traffic
    placement.store_write_recent_bytes, placement.store_busy_s = traffic.recent_bytes, traffic.busy_s
    placement.store_loads_inflight = traffic.loads
    if commit:
        decode_start = now + ch.ttft
        need = facts.prompt_tokens + facts.max_tokens
        sched.policy.placed(ctx, p.id, d.id, ch.chose_decode)  # first: if it raises, nothing is held
        sched.ledger.reserve(Reservation(rid, p.id, d.id, facts.prompt_tokens - terms.hit_tokens, terms.prefill_s,
                                         need, now, decode_start,
                                         decode_start + max(1, facts.max_tokens) * _span_tbt(sched, d, facts),
                                         output_tokens=max(1, facts.max_tokens),
                                         ready_s=ch.prefill_done_at), now)
        if sched._inflight:
            sched.inflight.add(rid, p.id, facts.block_hashes[:ctx.usable_blocks])
        # what its prefill will write through to the store: the prompt's whole blocks the store lacks
        new_blocks = facts.prompt_tokens // ctx.block_size - ctx.store_blocks
        dep = sched._deployment.get(p.id)
        traffic.placed(rid, now, new_blocks * ctx.block_size * dep.model.kv_bytes_per_token
                       if new_blocks > 0 and dep is not None else 0, terms.transfer_from == Tier.STORE,
                       terms.transfer_s + p.queue_s + terms.prefill_s, terms.prefill_s,
                       facts.prompt_tokens - terms.hit_tokens)
        sched.counts["placed"] += 1
        sched.decisions.append(ch.record)
    return placement


def decode_candidates(sched: Scheduler, pool: list[Instance], facts: RequestFacts, now: float,
                      at: float | None, frame: LoadFrame | None = None) -> list[DecodeCandidate]:
    """Decode candidates with their TBT once this request joins: now, or predicted at ``at``.
    A TBT predictor with ``tbt_many`` answers them all in one call (the learned one)."""
    ledger, tbt = sched.ledger, sched.predictors.tbt
    prompt, max_tokens = facts.prompt_tokens, facts.max_tokens
    if at is None and frame is not None:
        key = tuple(i.id for i in pool)
        states = frame.decode.get(key)
        if states is None:
            states = frame.decode[key] = ledger.decode_states(key, now)
    else:
        states = ledger.decode_states([i.id for i in pool], now) if at is None else [
            ledger.decode_state_at(i.id, at, now) for i in pool]
    many = getattr(tbt, "tbt_many", None)
    tbts = many(states, prompt, max_tokens) if many is not None else [tbt.tbt(s, prompt, max_tokens)
                                                                      for s in states]
    return [DecodeCandidate(i.id, i.role, s, t) for i, s, t in zip(pool, states, tbts, strict=True)]


def prefill_views(sched: Scheduler, pool: list[Instance], now: float, frame: LoadFrame
                  ) -> tuple[list[PrefillState], list[int], list[float]]:
    """The ledger's prefill views of ``pool`` and their predicted queues, once per frame."""
    key = tuple(i.id for i in pool)
    got = frame.prefill.get(key)
    if got is None:
        states, actives = sched.ledger.prefill_views(key, now)
        got = frame.prefill[key] = (states, actives, list(map(sched.predictors.queue.queue_time, states)))
    else:
        frame.hits += 1
    return got


def _rng_for(sched: Scheduler, request_id: str) -> random.Random:
    """Randomness per request, reproducible from (seed, request id) whatever came before."""
    return random.Random(xxhash.xxh3_64_intdigest(request_id.encode("utf-8", "surrogatepass"),
                                                  sched.seed & 0xFFFF_FFFF_FFFF_FFFF))


class Refused(Exception):
    """A stage's refusal: carried to ``Scheduler._refuse`` (with the record when candidates were weighed)."""

    def __init__(self, status: int, reason: str, message: str, record: dict[str, Any] | None = None,
                 retry_after_s: float | None = None):
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message
        self.record, self.retry_after_s = record, retry_after_s


@dataclass(slots=True)
class Choice:
    """The policy's pair and what admission adds to it (TTFT with the KV shipment, verdicts)."""

    prefill: PrefillChoice
    decode: DecodeCandidate
    decode_why: str
    decode_scores: dict[str, float]
    chose_decode: bool  # False when a "both" instance decodes its own request
    prefill_done_at: float
    kv_s: float = 0.0
    first_step_s: float = 0.0
    decode_wait_s: float = 0.0
    ttft: float = 0.0
    slo: SLO = field(default_factory=SLO)
    violations: list[admission.Verdict] = field(default_factory=list)
    record: dict[str, Any] = field(default_factory=dict)
    cost_verdict: admission.Verdict | None = None  # overload admission by cost (when on)
    overload: dict[str, Any] | None = None  # its figures for the decision record
