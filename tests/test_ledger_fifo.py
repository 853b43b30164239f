"""``decode_fifo`` (scheduler/ledger.py ``_fifo_kv_wait``): the decode wait replayed as a decode
engine admits, first come first served as KV frees (the default). The earlier sweep, kept as
``decode_fifo=off``, counts a waiter as decoding from its prefill's end and lets a new request take
room an earlier waiter will take first."""
from __future__ import annotations

import pytest

from predictors.telemetry import SLO
from scheduler import Instance, Scheduler
from scheduler.ledger import Ledger, Reservation, split_params
from tests.test_simulate import conductor


def test_the_option_parses_for_any_policy_and_is_on_by_default():
    assert split_params({"decode_fifo": "off", "work_weight": 2}) == (
        {"fifo_decode": False, "learn_kv_share": True}, {"work_weight": 2})
    assert split_params({}) == ({"fifo_decode": True, "learn_kv_share": True}, {})
    with pytest.raises(ValueError, match="decode_fifo"):
        split_params({"decode_fifo": "maybe"})
    insts = [Instance("p", "prefill"), Instance("d", "decode")]
    assert not Scheduler(insts, policy="round_robin", decode_fifo="off").ledger.fifo_decode
    assert Scheduler(insts, policy="conductor", slo=SLO(ttft_s=1.0)).ledger.fifo_decode
    assert not Ledger(fifo_decode=False).fifo_decode and Ledger().fifo_decode


def _busy(fifo: bool) -> Ledger:
    """Capacity 10,000: "a" decodes 6000 tokens from 0 to 10 s; "w" (6000 tokens, a 5 s decode)
    finished its prefill at 1 s and cannot fit until "a" ends."""
    led = Ledger(fifo_decode=fifo)
    led.add_instance("d", kv_capacity_tokens=10_000)
    led.reserve(Reservation("a", "p", "d", 0, 0.0, 6000, 0.0, 0.0, 10.0, ready_s=0.0), 0.0)
    led.reserve(Reservation("w", "p", "d", 0, 0.0, 6000, 0.0, 1.0, 6.0, ready_s=1.0), 0.0)
    return led


def test_a_new_request_waits_behind_an_earlier_waiter():
    # the engine admits "w" when "a" ends (10 s); 4000 more fit beside it then
    assert _busy(fifo=True).decode_kv_wait("d", 4000, 2.0, 0.0) == pytest.approx(10.0)
    # the shipped sweep counts "w" from its prefill's end and frees it at 6 s
    assert _busy(fifo=False).decode_kv_wait("d", 4000, 2.0, 0.0) == pytest.approx(6.0)


def test_a_request_ready_before_the_waiter_goes_first():
    # ready at 0.5 s, before "w": beside "a" there is room for 4000 at once
    assert _busy(fifo=True).decode_kv_wait("d", 4000, 0.5, 0.0) == pytest.approx(0.5)
    # 5000 do not fit beside "a": it waits for "a", ahead of "w"
    assert _busy(fifo=True).decode_kv_wait("d", 5000, 0.5, 0.0) == pytest.approx(10.0)


def test_a_waiter_decodes_from_its_admission_and_holds_half_its_output():
    led = _busy(fifo=True)
    # "w" admitted at 10 s decodes to 15 s: 9000 tokens need both gone
    assert led.decode_kv_wait("d", 9000, 2.0, 0.0) == pytest.approx(15.0)
    led.release("a", 3.0)  # "a" ended early: "w" goes at once (its prefill is done)
    assert led.decode_kv_wait("d", 4000, 3.0, 3.0) == 0.0
    # half of a reservation's output counts: 2000 of "x"'s 4000 output tokens, with 6000 held by "w"
    led.reserve(Reservation("x", "p", "d", 0, 0.0, 4000, 3.0, 3.0, 13.0, output_tokens=4000, ready_s=3.0), 3.0)
    assert led.decode_kv_wait("d", 2000, 3.0, 3.0) == pytest.approx(0.0)
    assert led.decode_kv_wait("d", 2500, 3.0, 3.0) == pytest.approx(6.0 - 3.0)  # "w" ends at 6


def test_prefill_done_makes_the_ready_time_actual():
    led = Ledger(fifo_decode=True)
    led.add_instance("d", kv_capacity_tokens=10_000)
    led.reserve(Reservation("a", "p", "d", 0, 0.0, 6000, 0.0, 0.0, 10.0, ready_s=0.0), 0.0)
    led.reserve(Reservation("w", "p", "d", 100, 1.0, 6000, 0.0, 5.0, 10.0, ready_s=4.0), 0.0)
    # predicted ready at 4 s: a request ready at 2 s goes ahead of it, beside "a"... if it fits
    assert led.decode_kv_wait("d", 4000, 2.0, 0.0) == pytest.approx(2.0)
    led.prefill_done("w", 1.5)  # its prefill ended at 1.5 s: now it is ahead
    assert led.get("w").ready_s == 1.5
    assert led.decode_kv_wait("d", 4000, 2.0, 1.5) == pytest.approx(10.0 - 1.5)


def test_conductor_simulate_takes_it_for_any_policy_and_refuses_a_bad_value(tmp_path):
    args = ["--synthetic", "--requests", "20", "--rate", "20", "--prefill", "1", "--decode", "1", "--quiet"]
    bad = conductor(*args, "--policy-param", "decode_fifo=maybe", "--out", str(tmp_path / "bad"))
    assert bad.returncode != 0 and "decode_fifo" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    ok = conductor(*args, "--policy", "lmetric", "--policy-param", "decode_fifo=off", "--out", str(tmp_path / "ok"))
    assert ok.returncode == 0, ok.stderr
