"""The request lifecycle against a real Scheduler and a settable clock: every path releases the
reservation exactly once and leaves the ledger empty; the record is filled on the way."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from predictors.telemetry import SLO, RequestRecord
from scheduler import Instance, Placement, Rejection, RequestFacts, Scheduler
from scheduler.hashing import block_hashes
from scheduler.lifecycle import LifecycleError, Phase, RequestLifecycle
from tests.sched_helpers import Clock, toks

BS = 16


def cluster(clock: Clock, *, both: bool = False, slo: SLO = SLO()) -> Scheduler:
    insts = [Instance("b0", "both")] if both else [Instance("p0", "prefill"), Instance("p1", "prefill"),
                                                   Instance("d0", "decode"), Instance("d1", "decode")]
    return Scheduler(insts, policy="round_robin", slo=slo, block_size=BS, clock=clock)


def facts(rid: str = "r1", n: int = 200, max_tokens: int = 8) -> RequestFacts:
    return RequestFacts(rid, n, block_hashes(toks(1, n), BS), max_tokens)


class Spy:
    """An observer that keeps every record it was given."""

    def __init__(self) -> None:
        self.seen: list[RequestRecord] = []

    def __call__(self, rec: RequestRecord) -> None:
        self.seen.append(rec)


class CountingScheduler(Scheduler):
    """A real scheduler that counts the releases that actually returned something."""

    releases = 0

    def release(self, request_id: str) -> bool:
        freed = super().release(request_id)
        self.releases += freed
        return freed


def make(clock: Clock | None = None, both: bool = False, slo: SLO = SLO()):
    clock = clock or Clock(100.0)
    insts = [Instance("b0", "both")] if both else [Instance("p0", "prefill"), Instance("p1", "prefill"),
                                                   Instance("d0", "decode"), Instance("d1", "decode")]
    sched = CountingScheduler(insts, policy="round_robin", slo=slo, block_size=BS, clock=clock)
    spy = Spy()
    rec = RequestRecord("r1", arrival_s=clock())
    return RequestLifecycle(sched, rec, clock, observers=[spy]), sched, clock, spy


def test_disaggregated_success_fills_the_record_and_releases_once():
    lc, sched, clock, spy = make()
    clock.t = 100.5
    d = lc.decide(facts())
    assert isinstance(d, Placement) and lc.phase is Phase.PLACED and "r1" in sched.ledger
    rec = lc.record
    assert rec.decided_s == 100.5 and rec.prefill_instance == d.prefill and rec.decode_instance == d.decode
    assert rec.policy == "round_robin" and rec.predicted_ttft_s == d.ttft_s and rec.predicted_tbt_s == d.tbt_s
    assert rec.hit_tokens == d.hit_tokens and rec.queue_tokens == d.queue_tokens
    # the rest of the TTFT and the pair's public deployments: a learned predictor's features
    assert (rec.predicted_kv_transfer_s, rec.predicted_first_step_s, rec.predicted_decode_wait_s) == (
        d.kv_transfer_s, d.decode_first_step_s, d.decode_wait_s) and d.kv_transfer_s > 0
    assert rec.prefill_deployment == rec.decode_deployment == "llama3-8b-h200"
    clock.t = 101.0
    lc.prefill_started()
    clock.t = 102.0
    lc.prefill_finished(cached_tokens=32)
    assert lc.phase is Phase.HANDED_OVER
    assert not sched.ledger.get("r1").prefill_pending  # the prefill instance's queue no longer holds it
    assert (rec.prefill_start_s, rec.prefill_end_s, rec.decode_start_s, rec.cached_tokens) == (101.0, 102.0, 102.0, 32)
    lc.token(102.5)
    assert lc.phase is Phase.STREAMING
    clock.t = 102.6
    lc.token()
    clock.t = 103.0
    assert lc.finish("ok", 200, usage={"completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 999}})
    assert lc.phase is Phase.FINISHED and lc.done
    assert rec.first_token_s == 102.5 and rec.token_times == [102.5, 102.6] and rec.end_s == 103.0
    assert rec.output_tokens == 5 and rec.cached_tokens == 32  # the prefill side's report wins
    assert (rec.status, rec.http_status, rec.error) == ("ok", 200, None)
    assert rec.ttft_s == pytest.approx(2.5)
    assert sched.releases == 1 and sched.ledger.is_idle() and spy.seen == [rec]


def test_colocated_is_the_degenerate_pair():
    lc, sched, clock, spy = make(both=True)
    d = lc.decide(facts())
    assert d.prefill == d.decode == "b0"
    clock.t = 100.2
    lc.handed_over()
    with pytest.raises(LifecycleError):
        lc.prefill_started()
    clock.t = 101.0
    # the forwarder counted the tokens itself; usage carries the engine's own prefix hit
    lc.finish("ok", 200, usage={"prompt_tokens_details": {"cached_tokens": 16}}, token_times=[100.5, 100.7, 100.9])
    rec = lc.record
    assert rec.prefill_start_s is None and rec.decode_start_s == 100.2
    assert rec.first_token_s == 100.5 and rec.output_tokens == 3 and rec.cached_tokens == 16
    assert sched.releases == 1 and sched.ledger.is_idle() and len(spy.seen) == 1


def test_rejection_is_terminal_holds_nothing_and_is_observed():
    lc, sched, clock, spy = make(slo=SLO(ttft_s=1e-9))
    d = lc.decide(facts())
    assert isinstance(d, Rejection) and d.status == 429
    assert lc.phase is Phase.REJECTED and lc.done
    rec = lc.record
    assert (rec.status, rec.http_status, rec.error, rec.reject_reason) == ("rejected", 429, d.reason, d.reason)
    assert rec.end_s == clock() and rec.prefill_instance is None
    assert "r1" not in sched.ledger and sched.ledger.is_idle() and sched.releases == 0
    assert not lc.finish("aborted", 499)  # ignored: the rejection already finished it
    assert rec.status == "rejected" and spy.seen == [rec]
    with pytest.raises(LifecycleError):
        lc.decide(facts())


def test_unplaceable_request_is_an_error_not_a_rejection():
    clock = Clock()
    sched = Scheduler([Instance("p0", "prefill", healthy=False), Instance("d0", "decode")], block_size=BS, clock=clock)
    lc = RequestLifecycle(sched, RequestRecord("r1", 0.0), clock)
    d = lc.decide(facts())
    assert isinstance(d, Rejection) and d.status == 503
    assert (lc.record.status, lc.record.http_status) == ("error", 503) and lc.phase is Phase.REJECTED


@pytest.mark.parametrize("stage", ["placed", "prefilling", "handed_over"])
def test_retry_releases_and_decides_again_avoiding_the_failed_engine(stage):
    lc, sched, clock, spy = make()
    first = lc.decide(facts())
    if stage != "placed":
        lc.prefill_started()
    if stage == "handed_over":
        lc.prefill_finished(8)
    failed = first.decode if stage == "handed_over" else first.prefill
    lc.retry(failed)
    assert lc.phase is Phase.ARRIVED and "r1" not in sched.ledger and sched.releases == 1
    rec = lc.record
    assert rec.prefill_start_s is None and rec.cached_tokens is None  # the failed attempt's outcome is gone
    second = lc.decide()
    assert isinstance(second, Placement) and failed not in (second.prefill, second.decode)
    assert rec.prefill_instance == second.prefill and lc.attempts == 2
    lc.prefill_started()
    lc.prefill_finished(None)
    lc.finish("error", 503, error="upstream_unavailable")
    assert sched.releases == 2 and sched.ledger.is_idle() and spy.seen == [rec]


def test_retry_after_the_first_token_is_refused():
    lc, sched, _, spy = make(both=True)
    lc.decide(facts())
    lc.handed_over()
    lc.token()
    with pytest.raises(LifecycleError):
        lc.retry("b0")
    assert "r1" in sched.ledger  # the refused retry held on to the reservation
    lc.finish("error", 200, error="engine failed mid-stream")
    assert sched.ledger.is_idle() and len(spy.seen) == 1


def test_retry_that_finds_nothing_else_is_rejected_and_holds_nothing():
    clock = Clock()
    sched = Scheduler([Instance("p0", "prefill"), Instance("d0", "decode")], block_size=BS, clock=clock)
    lc = RequestLifecycle(sched, RequestRecord("r1", 0.0), clock)
    lc.decide(facts())
    lc.retry("p0")
    d = lc.decide()
    assert isinstance(d, Rejection) and d.reason == "no_healthy_prefill"
    assert lc.record.status == "error" and sched.ledger.is_idle()


@pytest.mark.parametrize("stage", ["arrived", "placed", "prefilling", "handed_over", "streaming"])
def test_finish_from_any_live_state_releases_exactly_once(stage):
    lc, sched, clock, spy = make()
    steps = ["placed", "prefilling", "handed_over", "streaming"]
    actions = [lambda: lc.decide(facts()), lc.prefill_started, lambda: lc.prefill_finished(0), lc.token]
    for act in actions[: steps.index(stage) + 1 if stage in steps else 0]:
        act()
    assert lc.phase.value == stage
    assert lc.finish("aborted", 499)
    assert not lc.finish("ok", 200)  # idempotent: the first outcome stands
    assert lc.record.status == "aborted" and lc.record.http_status == 499
    assert sched.releases == (0 if stage == "arrived" else 1)
    assert sched.ledger.is_idle() and len(spy.seen) == 1


def test_illegal_transitions_raise():
    lc, _, _, _ = make()
    for bad in (lc.prefill_started, lambda: lc.prefill_finished(0), lc.handed_over, lc.token):
        with pytest.raises(LifecycleError):
            bad()
    with pytest.raises(LifecycleError):
        lc.decide()  # the first decide needs the facts
    lc.decide(facts())
    with pytest.raises(LifecycleError):
        lc.decide(facts())
    with pytest.raises(LifecycleError):
        lc.prefill_finished(0)  # no prefill_started
    lc.finish("ok", 200)
    for bad in (lc.prefill_started, lc.handed_over, lc.token, lambda: lc.retry("p0")):
        with pytest.raises(LifecycleError):
            bad()


def test_observers_each_called_once_even_when_one_fails():
    clock = Clock()
    sched = cluster(clock)
    calls: list[str] = []

    def broken(rec):
        calls.append("broken")
        raise RuntimeError("disk full")

    def finishes_again(rec):
        calls.append("again")
        assert not lc.finish("error", 500)  # re-entrant finish is a no-op

    lc = RequestLifecycle(sched, RequestRecord("r1", 0.0), clock,
                          observers=[broken, finishes_again, lambda r: calls.append(r.status)])
    lc.decide(facts())
    assert lc.finish("ok", 200)
    assert calls == ["broken", "again", "ok"] and sched.ledger.is_idle()


def test_released_elsewhere_is_still_finished_once():
    """A reservation already released by someone else (an admin drain) is not released twice."""
    lc, sched, _, spy = make()
    lc.decide(facts())
    sched.release("r1")
    assert lc.finish("ok", 200) and sched.releases == 1 and len(spy.seen) == 1


# --- property: any sequence of calls, legal or not --------------------------------------

OPS = ("decide", "prefill_started", "prefill_finished", "handed_over", "token", "retry", "finish")


@settings(max_examples=200, deadline=None)
@given(st.booleans(), st.lists(st.sampled_from(OPS), max_size=14), st.integers(0, 3))
def test_any_call_sequence_keeps_the_books(both, ops, slo_bits):
    slo = SLO(ttft_s=1e-9) if slo_bits == 0 else SLO()
    lc, sched, clock, spy = make(both=both, slo=slo)
    placements = 0
    for op in ops:
        clock.t += 0.01
        before = lc.phase
        try:
            if op == "decide":
                d = lc.decide(facts())
                placements += isinstance(d, Placement)
            elif op == "prefill_finished":
                lc.prefill_finished(4)
            elif op == "retry":
                lc.retry(lc.placement.prefill if lc.placement else None)
            elif op == "finish":
                lc.finish("ok", 200)
            else:
                getattr(lc, op)()
        except LifecycleError:
            assert lc.phase is before  # a refused transition changes nothing
        held = "r1" in sched.ledger
        assert held == (lc.phase in (Phase.PLACED, Phase.PREFILLING, Phase.HANDED_OVER, Phase.STREAMING))
        assert sched.releases <= placements
    lc.finish("aborted", 499)
    assert lc.done and sched.ledger.is_idle()
    assert sched.releases == placements  # every reservation released exactly once
    assert spy.seen == [lc.record]
    rec = lc.record
    assert rec.status in ("ok", "aborted", "rejected", "error") and rec.end_s is not None
    if rec.first_token_s is not None:
        assert rec.token_times[0] == rec.first_token_s
