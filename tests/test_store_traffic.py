"""The store's write-through traffic as the gateway keeps it (predictors/store_traffic.py): a
window of recent writes and the links' busy time, both driven by an injected clock, filled into
the decision's record by the scheduler and read by the learned store term."""
from __future__ import annotations

import pytest

from predictors.store_traffic import CHUNK_TOKENS, StoreTraffic
from predictors.telemetry import RequestRecord
from scheduler import Instance, RequestFacts, Scheduler
from scheduler.hashing import block_hashes
from scheduler.lifecycle import RequestLifecycle
from tests.sched_helpers import Clock, toks

BS = 16


def test_recent_writes_expire_after_the_window_on_the_injected_clock():
    s = StoreTraffic(window_s=0.5)
    s.placed("a", 0.0, 1000, False, 1.0, 1.0, 100)
    s.placed("b", 0.0, 300, False, 1.0, 1.0, 100)
    s.advance(0.5)
    assert s.recent_bytes == 0  # placed, not written yet
    s.done("a", 1.0)  # its prefill ended: written through at 1.0
    s.done("b", 1.2)
    s.advance(1.2)
    assert s.recent_bytes == 1300
    s.advance(1.49)
    assert s.recent_bytes == 1300
    s.advance(1.5)  # a's write is exactly one window old: gone
    assert s.recent_bytes == 300
    s.advance(1.7)
    assert s.recent_bytes == 0
    s.done("b", 2.0)  # twice: nothing more
    s.advance(2.0)
    assert s.recent_bytes == 0


def test_a_released_prefill_writes_nothing_and_a_retry_counts_once():
    s = StoreTraffic()
    s.placed("a", 0.0, 500, True, 1.0, 1.0, 100)
    s.placed("a", 0.1, 500, True, 1.0, 1.0, 100)  # the same request placed again (a retry)
    assert s.loads == 1 and len(s) == 1
    s.done("a", None)
    s.advance(0.2)
    assert s.recent_bytes == 0 and s.loads == 0 and s.busy_s == 0.0 and len(s) == 0


def test_busy_is_the_latest_end_of_the_prefills_whose_last_chunk_runs():
    s = StoreTraffic()
    # a: 2 chunks of prefill in 1.0 s ending at 1.0: its last chunk (half) starts at 0.5
    s.placed("a", 0.0, 10, False, 1.0, 1.0, 2 * CHUNK_TOKENS)
    # b: one chunk, 0.3 s of prefill after 0.5 s of queue: last chunk 0.5 .. 0.8
    s.placed("b", 0.0, 10, False, 0.8, 0.3, 100)
    s.advance(0.4)
    assert s.busy_s == 0.0  # nobody's last chunk has started: no put holds a link
    s.advance(0.6)
    assert s.busy_s == pytest.approx(0.4)  # a ends at 1.0 (b at 0.8)
    s.done("a", 0.7)  # a ended early: only b is left
    s.advance(0.7)
    assert s.busy_s == pytest.approx(0.1)
    s.advance(0.9)  # b is past its predicted end (late, not yet done): not counted
    assert s.busy_s == 0.0
    with pytest.raises(ValueError):
        StoreTraffic(window_s=0)


def _facts(rid: str, seed: int, n: int) -> RequestFacts:
    return RequestFacts(rid, n, block_hashes(toks(seed, n), BS), 8)


def test_the_scheduler_fills_the_record_with_the_store_traffic_at_decision():
    clock = Clock()
    sched = Scheduler([Instance("p0", "prefill"), Instance("p1", "prefill"), Instance("d0", "decode")],
                      policy="round_robin", block_size=BS, clock=clock)
    first = RequestLifecycle(sched, RequestRecord("a", 0.0, prompt_tokens=4000), clock)
    p = first.decide(_facts("a", 1, 4000))
    assert p.store_busy_s == 0.0 and p.store_loads_inflight == 0
    assert len(sched.store_traffic) == 1
    first.prefill_started()
    end = p.queue_s + p.transfer_s + p.prefill_s  # predicted: a's single chunk runs from the start
    clock.t = end / 2
    second = RequestLifecycle(sched, RequestRecord("b", clock.t, prompt_tokens=300), clock)
    second.decide(_facts("b", 2, 300))
    assert second.record.store_busy_s == pytest.approx(end / 2)
    assert second.record.store_write_recent_bytes == 0
    clock.t = end
    first.prefill_finished()  # a's prompt is written through now: 4000 // 16 whole blocks
    kv = sched._deployment["p0"].model.kv_bytes_per_token
    third = RequestLifecycle(sched, RequestRecord("c", clock.t, prompt_tokens=300), clock)
    third.decide(_facts("c", 3, 300))
    assert third.record.store_write_recent_bytes == 4000 // BS * BS * kv
    for lc in (first, second, third):
        lc.finish("aborted")
    assert len(sched.store_traffic) == 0
