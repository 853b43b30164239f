"""Per-key quotas (gateway/quotas.py): token buckets drive Retry-After; concurrency is capped."""
import math

import pytest

from gateway.quotas import Limits, Quotas, TokenBucket
from tests.sched_helpers import Clock


def test_bucket_refills_at_its_rate_up_to_its_capacity():
    b = TokenBucket(rate=2.0, capacity=4.0, now=0.0)
    assert b.wait_s(4, 0.0) == 0.0
    b.take(4, 0.0)
    assert b.wait_s(1, 0.0) == 0.5 and b.wait_s(3, 1.0) == 0.5
    assert b.wait_s(4, 100.0) == 0.0  # capped at capacity however long it waited
    assert b.wait_s(5, 100.0) == math.inf


def test_request_rate_retry_after_comes_from_the_bucket():
    clock = Clock(0.0)
    q = Quotas({"a": Limits(requests_per_minute=6, request_burst=2), "b": Limits()}, clock)
    assert q.arrive("a", "r1") is None and q.arrive("a", "r2") is None
    r = q.arrive("a", "r3")
    assert r is not None and r.limit == "requests" and r.retry_after_s == 10.0  # one request every 10 s
    clock.t = 4.0
    assert q.arrive("a", "r3").retry_after_s == pytest.approx(6.0)
    clock.t = 10.0
    assert q.arrive("a", "r3") is None
    assert all(q.arrive("b", f"x{i}") is None for i in range(100))  # unlimited keys are not tracked
    assert q.arrive("unknown", "u") is None


def test_token_rate_charges_prompt_plus_max_tokens_and_refuses_the_impossible():
    clock = Clock(0.0)
    q = Quotas({"a": Limits(tokens_per_minute=600)}, clock)  # 10 tokens a second, burst 600
    assert q.charge_tokens("a", 500) is None
    r = q.charge_tokens("a", 200)
    assert r.limit == "tokens" and r.retry_after_s == 10.0  # 100 left, 100 more at 10/s
    never = q.charge_tokens("a", 601)
    assert never.retry_after_s is None and "at once" in never.message


def test_concurrency_cap_holds_until_release_and_release_is_idempotent():
    q = Quotas({"a": Limits(max_concurrent=2)}, Clock())
    assert q.arrive("a", "r1") is None and q.arrive("a", "r2") is None
    r = q.arrive("a", "r3")
    assert r.limit == "concurrency" and q.in_flight["a"] == 2
    q.release("r1")
    q.release("r1")
    assert q.in_flight["a"] == 1 and q.arrive("a", "r3") is None
    # a refused arrival holds nothing
    clock = Clock()
    q2 = Quotas({"a": Limits(requests_per_minute=1, max_concurrent=5)}, clock)
    assert q2.arrive("a", "x") is None and q2.arrive("a", "y") is not None
    assert q2.in_flight["a"] == 1


def test_tokens_go_back_only_when_no_engine_worked_on_the_request():
    clock = Clock(0.0)
    q = Quotas({"a": Limits(tokens_per_minute=60)}, clock)  # 1 token a second, burst 60
    assert q.charge_tokens("a", 50, "r1") is None
    q.release("r1", refund=True)  # refused over the SLO, say: the tokens come back
    q.release("r1", refund=True)  # once
    assert q.charge_tokens("a", 60, "r2") is None
    q.release("r2")  # served: charged
    assert q.charge_tokens("a", 10, "r3").retry_after_s == 10.0
