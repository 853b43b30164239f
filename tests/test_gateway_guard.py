"""The gateway's reservation guard: whatever way the handler leaves, the request is finished
exactly once and the scheduler's ledger ends empty."""
from __future__ import annotations

import asyncio

import pytest

from gateway.proxy import ClientGone, ReservationGuard, stream_outcome
from gateway.streaming import StreamTally
from predictors.telemetry import RequestRecord
from scheduler import Instance, RequestFacts, Scheduler
from scheduler.hashing import block_hashes
from scheduler.lifecycle import RequestLifecycle
from tests.sched_helpers import Clock, toks


def placed() -> tuple[RequestLifecycle, list[RequestRecord]]:
    clock = Clock(1.0)
    sched = Scheduler([Instance("p0", "prefill"), Instance("d0", "decode")], block_size=16, clock=clock)
    seen: list[RequestRecord] = []
    lc = RequestLifecycle(sched, RequestRecord("r1", 1.0), clock, observers=[seen.append])
    lc.decide(RequestFacts("r1", 100, block_hashes(toks(1, 100), 16), 4))
    assert "r1" in sched.ledger
    return lc, seen


@pytest.mark.parametrize("exc, status, http", [(asyncio.CancelledError, "aborted", 499), (ClientGone, "aborted", 499),
                                               (KeyError, "error", 500)])
def test_an_exception_finishes_the_request(exc, status, http):
    lc, seen = placed()
    with pytest.raises(exc):
        with ReservationGuard(lc):
            lc.prefill_started()
            raise exc()
    assert (lc.record.status, lc.record.http_status) == (status, http)
    assert lc.scheduler.ledger.is_idle() and seen == [lc.record]


def test_a_return_that_forgot_to_finish_is_an_error_not_a_leak():
    lc, seen = placed()
    with ReservationGuard(lc):
        pass
    assert lc.record.status == "error" and lc.record.error == "unfinished" and lc.scheduler.ledger.is_idle()


def test_a_finished_request_is_left_alone():
    lc, seen = placed()
    with pytest.raises(RuntimeError):
        with ReservationGuard(lc):
            lc.finish("ok", 200)
            raise RuntimeError("after the end")
    assert lc.record.status == "ok" and len(seen) == 1


def test_a_handed_off_stream_finishes_it_later():
    lc, seen = placed()
    with ReservationGuard(lc) as guard:
        guard.hand_off(object())
    assert not seen and "r1" in lc.scheduler.ledger
    tally = StreamTally()
    tally.token_times[:] = [2.0, 2.5]
    tally.usage = {"completion_tokens": 2}
    lc.finish(*stream_outcome(tally), usage=tally.usage, token_times=tally.token_times)
    assert lc.record.status == "ok" and lc.record.first_token_s == 2.0 and lc.scheduler.ledger.is_idle()


def test_stream_outcomes():
    t = StreamTally()
    assert stream_outcome(t) == ("ok", 200, None)
    t.error = "upstream timeout mid-stream"
    assert stream_outcome(t)[:2] == ("timeout", 200)
    t.error = "engine failed mid-stream: ClientPayloadError"
    assert stream_outcome(t)[:2] == ("error", 200)
    t.disconnected = True
    assert stream_outcome(t) == ("aborted", 499, None)
