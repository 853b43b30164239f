"""Deferred dispatch in the live gateway (gateway/waiting.py): the asyncio side of the wait room
in process against a real Scheduler, then `conductor serve` with ``defer=on`` on an overloaded
embedded cluster: requests wait, then are served or refused ``deadline`` with Retry-After, a
client leaving while it waits leaves nothing behind, and the wait shows in /metrics and /admin."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import aiohttp
import pytest
import requests

from predictors.telemetry import SLO, RequestRecord
from scheduler import Instance, Placement, RequestFacts, Scheduler
from scheduler.hashing import block_hashes
from scheduler.lifecycle import Phase, RequestLifecycle
from tests.sched_helpers import Clock, toks
from tests.servers import ROOT, gateway

BS = 16


# --- the asyncio side, in process ----------------------------------------------------------

def world(defer: bool = True):
    clock = Clock(0.0)
    sched = Scheduler([Instance("p0", "prefill"), Instance("d0", "decode")], policy="conductor",
                      slo=SLO(ttft_s=60.0), block_size=BS, clock=clock, defer=defer, defer_horizon_s=0.2)
    from gateway.waiting import GatewayWaitRoom

    return sched, clock, GatewayWaitRoom(sched)


def arrive(sched, clock, room, rid: str, n: int, seed: int) -> tuple[RequestLifecycle, object]:
    lc = RequestLifecycle(sched, RequestRecord(rid, clock.t), clock, observers=(room.observe,))
    return lc, room.offer(lc, RequestFacts(rid, n, block_hashes(toks(seed, n), BS), 8))


def test_a_waiting_request_is_placed_when_the_head_finishes_and_the_pump_task_wakes():
    async def go():
        sched, clock, room = world()
        room.start()
        head, d0 = arrive(sched, clock, room, "head", 16000, 1)
        lc, d1 = arrive(sched, clock, room, "short", 500, 2)
        assert isinstance(d0, Placement) and d1 is None and lc.phase is Phase.WAITING
        assert len(room) == 1 and "short" not in sched.ledger  # it holds nothing while it waits
        assert [r["request_id"] for r in room.view()["requests"]] == ["short"]
        waiter = asyncio.ensure_future(room.wait(lc))
        await asyncio.sleep(0)
        assert not waiter.done()
        clock.t = 1.0
        head.finish("ok", 200)  # its reservation released: the observer wakes the pump task
        d = await asyncio.wait_for(waiter, 30)  # (a bound against a hang, not a timing assumption)
        assert isinstance(d, Placement) and lc.phase is Phase.PLACED and "short" in sched.ledger
        assert len(room) == 0 and room.view()["requests"] == [] and room.view()["counts"]["dispatched"] == 1
        assert sched.decisions[-1]["deferred"]["waited_s"] == 1.0
        view = room.view()  # what the pumps cost the event loop, beside how many there were
        assert view["pumps"] >= 1 and view["pump_s"] > 0
        lc.finish("ok", 200)
        await room.stop()
        assert len(sched.ledger) == 0
    asyncio.run(go())


def test_cancelled_while_waiting_leaves_the_room_holding_nothing():
    async def go():
        sched, clock, room = world()
        arrive(sched, clock, room, "head", 16000, 1)
        lc, _ = arrive(sched, clock, room, "gone", 500, 2)
        waiter = asyncio.ensure_future(room.wait(lc))
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert len(room) == 0 and room.view()["counts"]["cancelled"] == 1 and room.view()["requests"] == []
        lc.finish("aborted", 499)  # what the proxy's handler does next
        assert lc.record.extra["wait_s"] == 0.0 and "gone" not in sched.ledger
        assert room.pump() == 0  # nothing left to decide
    asyncio.run(go())


def test_stop_answers_every_waiter_with_the_given_exception():
    class Stopping(Exception):
        pass

    async def go():
        sched, clock, room = world()
        room.start()
        arrive(sched, clock, room, "head", 16000, 1)
        waiting = [arrive(sched, clock, room, f"w{k}", 500 + k, 10 + k)[0] for k in range(3)]
        waiters = [asyncio.ensure_future(room.wait(lc)) for lc in waiting]
        await asyncio.sleep(0)
        await room.stop(Stopping)
        for w in waiters:
            with pytest.raises(Stopping):
                await w
        assert len(room) == 0 and all(lc.phase is Phase.WAITING for lc in waiting)
        assert room._task is None
    asyncio.run(go())


def test_a_waiter_finished_elsewhere_is_never_left_hanging():
    async def go():
        from gateway.waiting import WaitRoomClosed

        sched, clock, room = world()
        arrive(sched, clock, room, "head", 16000, 1)
        lc, _ = arrive(sched, clock, room, "w", 500, 2)
        waiter = asyncio.ensure_future(room.wait(lc))
        await asyncio.sleep(0)  # the handler awaits its decision
        lc.finish("error", 500)  # not through the room (a bug elsewhere): the next pump drops it
        room.pump()
        with pytest.raises(WaitRoomClosed):
            await waiter
        assert len(room) == 0
    asyncio.run(go())


def test_prefill_finished_wakes_the_pump():
    from gateway.waiting import DeferringLifecycle

    sched, clock, _ = world()
    woken = []
    lc = DeferringLifecycle(sched, RequestRecord("r", 0.0), clock, on_drained=lambda: woken.append(1))
    assert isinstance(lc.decide(RequestFacts("r", 500, block_hashes(toks(3, 500), BS), 8)), Placement)
    lc.prefill_started()
    assert not woken
    lc.prefill_finished(0)
    assert woken == [1] and lc.phase is Phase.HANDED_OVER


def test_off_decides_at_once_and_starts_no_task():
    async def go():
        sched, clock, room = world(defer=False)
        room.start()
        assert room._task is None and not room.enabled
        arrive(sched, clock, room, "head", 16000, 1)
        lc, d = arrive(sched, clock, room, "short", 500, 2)
        assert isinstance(d, Placement) and lc.phase is Phase.PLACED and len(room) == 0
        await room.stop()
    asyncio.run(go())


# --- `conductor serve`, end to end ---------------------------------------------------------

#: one prefill and one decode engine running 20x slower than the modelled H200s: a prompt of a
#: few thousand tokens holds the prefill queue for seconds, well past the 0.5 s horizon
CONFIG = """policy = "conductor"
health_interval_s = 0.2
[policy_params]
defer = "on"
defer_horizon_s = 0.5
[slo]
ttft_ms = 60000
tbt_ms = 600000
[embedded]
prefill = 1
decode = 1
time_scale = 20
store = false
"""

slow = pytest.mark.slow  # starts real servers or subprocesses: `make test-fast` skips these


@pytest.fixture(scope="module")
def gw():
    with gateway(CONFIG) as g:
        g["model"] = requests.get(g["url"] + "/v1/models").json()["data"][0]["id"]
        yield g


def body(model: str, chars: int, seed: int) -> dict:
    text = "".join("abcdefghij "[(seed * 31 + k * 7) % 11] for k in range(chars))
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 4}


def cluster(gw) -> dict:
    return requests.get(gw["url"] + "/admin/cluster", timeout=10).json()


def until(cond, what: str, timeout_s: float = 60.0):
    """Wait on an observable condition (a bound against a hang, not a timing assumption)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def idle(gw) -> dict:
    """The gateway once nothing waits or holds a reservation (what each test leaves behind)."""
    def check():
        view = cluster(gw)
        ok = (view["wait_room"]["waiting"] == 0 and view["totals"]["reservations"] == 0
              and all(i["active_requests"] == 0 for i in view["instances"]))
        return view if ok else None
    return until(check, "the wait room and the ledger to be idle")


def metric(gw, line_start: str) -> float:
    text = requests.get(gw["url"] + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start))


async def post(session: aiohttp.ClientSession, gw, payload: dict, headers: dict | None = None):
    async with session.post(gw["url"] + "/v1/chat/completions", json=payload, headers=headers or {}) as r:
        return r.status, r.headers.copy(), await r.json()  # (case-insensitive names)


@slow
def test_overload_waits_then_serves_or_refuses_deadline_with_retry_after(gw):
    before = cluster(gw)["wait_room"]["counts"]
    tight = {"x-slo-ttft-ms": "6000"}  # a client may tighten its SLO: 6 s, about one long prefill

    async def go():
        async with aiohttp.ClientSession() as s:
            head = asyncio.ensure_future(post(s, gw, body(gw["model"], 6000, 0), tight))
            # the head holds the one prefill queue (placed at once: the queue was empty) ...
            await asyncio.to_thread(until, lambda: cluster(gw)["totals"]["reservations"] >= 1, "the head placed")
            # ... so these wait: the long ones until even a drained queue misses their SLO, the
            # short ones until the queue is within the horizon again
            rest = asyncio.gather(*(post(s, gw, body(gw["model"], n, k + 1), tight)
                                    for k, n in enumerate((6000, 6000, 300, 400))))
            return [await head, *await rest]

    answers = asyncio.run(go())
    statuses = [a[0] for a in answers]
    assert set(statuses) <= {200, 429} and answers[0][0] == 200, statuses
    refused = [a for a in answers if a[0] == 429]
    assert any(h["x-conductor-reject-reason"] == "deadline" for _, h, _ in refused), answers
    for _, headers, err in refused:  # a proper OpenAI error, and when to come back
        assert int(headers["retry-after"]) >= 1
        assert err["error"]["type"] == "rate_limit_error"
        assert err["error"]["code"] == headers["x-conductor-reject-reason"]
        if err["error"]["code"] == "deadline":
            assert "waited" in err["error"]["message"]
    assert all(a[0] == 200 for a in answers[3:]), answers  # the short ones got their turn
    view = idle(gw)
    counts = view["wait_room"]["counts"]
    assert counts["waited"] - before["waited"] >= 4 and counts["deadline"] - before["deadline"] >= 1
    assert counts["dispatched"] - before["dispatched"] >= 2
    # the decision log says who waited and how long
    log = requests.get(gw["url"] + "/admin/decisions", params={"limit": 100}).json()["decisions"]
    deferred = [r for r in log if "deferred" in r]
    assert {r["outcome"] for r in deferred} >= {"placed", "rejected"}
    assert all(r["deferred"]["waited_s"] > 0 for r in deferred)
    assert metric(gw, "conductor_requests_waiting ") == 0
    assert metric(gw, 'conductor_wait_seconds_count{status="ok"}') >= 2
    assert metric(gw, 'conductor_wait_seconds_count{status="rejected"}') >= 1


@slow
def test_client_leaving_while_it_waits_leaves_nothing_behind(gw):
    before = cluster(gw)["wait_room"]["counts"]
    aborted = metric(gw, 'conductor_requests_total{reason="",status="aborted"}')

    async def go():
        async with aiohttp.ClientSession() as s:
            head = asyncio.ensure_future(post(s, gw, body(gw["model"], 6000, 50)))
            await asyncio.to_thread(until, lambda: cluster(gw)["totals"]["reservations"] >= 1, "the head placed")
            gone = asyncio.ensure_future(post(s, gw, body(gw["model"], 500, 51), {"x-request-id": "leaves-early"}))

            def waiting():
                return any(r["request_id"] == "leaves-early" for r in cluster(gw)["wait_room"]["requests"])
            await asyncio.to_thread(until, waiting, "the request to wait")
            gone.cancel()  # the client closes its connection while the request waits
            with pytest.raises(asyncio.CancelledError):
                await gone
            await asyncio.to_thread(until, lambda: cluster(gw)["wait_room"]["counts"]["cancelled"]
                                    > before["cancelled"], "the wait room to see the client leave")
            return await head

    status, _, _ = asyncio.run(go())
    assert status == 200
    view = idle(gw)
    assert view["wait_room"]["requests"] == []
    assert metric(gw, 'conductor_requests_total{reason="",status="aborted"}') == aborted + 1
    assert metric(gw, 'conductor_wait_seconds_count{status="aborted"}') >= 1


@pytest.mark.parametrize("params, flags, words", [
    ('defer = "maybe"', [], "defer must be true or false"),
    ('defer = "on"\ndefer_horizon_s = -1', [], "defer_horizon_s must be a number >= 0"),
    ('defer = "on"\ndefer_scan = 0', [], "defer_scan must be a positive integer"),
    ('defer = "on"', ["--policy-param", "defer_aging=soon"], "defer_aging must be a number"),  # the flag wins
    ('', ["--policy-param", "defer"], "expected KEY=VALUE"),
])
@slow
def test_bad_defer_parameters_are_one_line_and_exit_2(tmp_path, params, flags, words):
    path = tmp_path / "c.toml"
    path.write_text(f"[policy_params]\n{params}\n")
    r = subprocess.run([sys.executable, "-m", "gateway.cli", "serve", "--config", str(path), *flags], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and words in r.stderr and "Traceback" not in r.stderr


@slow
def test_a_request_waiting_when_the_server_stops_gets_503():
    config = CONFIG.replace('policy = "conductor"\n', 'policy = "conductor"\nshutdown_timeout_s = 2.0\n')
    with gateway(config) as g:
        g["model"] = requests.get(g["url"] + "/v1/models").json()["data"][0]["id"]

        async def go():
            async with aiohttp.ClientSession() as s:
                head = asyncio.ensure_future(post(s, g, body(g["model"], 6000, 60)))
                await asyncio.to_thread(until, lambda: cluster(g)["totals"]["reservations"] >= 1, "the head placed")
                waiter = asyncio.ensure_future(post(s, g, body(g["model"], 500, 61), {"x-request-id": "stays"}))
                await asyncio.to_thread(until, lambda: cluster(g)["wait_room"]["waiting"] == 1, "the request to wait")
                g["proc"].terminate()  # SIGTERM: the graceful half (1 s) ends before the queue drains
                return await asyncio.gather(head, waiter)

        (_, _, _), (status, headers, err) = asyncio.run(go())
        assert status == 503 and err["error"]["code"] == "shutting_down", err
        assert headers["x-request-id"] == "stays" and int(headers["retry-after"]) >= 1
        g["proc"].wait(timeout=30)  # (it stops: uvicorn re-raises the SIGTERM once shut down)
