"""The SGLang driver (dual dispatch with a bootstrap room) against real `--flavor sglang` sim-engine
processes, reporting to a real request lifecycle: success, and every way a leg can fail leaves
neither engine holding anything."""
from __future__ import annotations

import asyncio
import json
import random

import aiohttp
import pytest

from engines_adapters.drivers import Pair, UpstreamError, UpstreamHTTPError, UpstreamUnavailable, parse_metrics
from engines_adapters.drivers.sglang import SGLangDriver
from engines_adapters.engine_client import EngineClient
from engines_adapters.net import free_port
from scheduler.lifecycle import Phase
from tests.sim_helpers import SimEngineProcess, wait_until
from tests.test_drivers import lifecycle, request

pytestmark = pytest.mark.slow  # starts sim engine processes


@pytest.fixture(scope="module")
def engines():
    boot = free_port()
    # KV nobody takes is held for 100 s wall: only an abort frees it within the tests' waits
    with SimEngineProcess("--flavor", "sglang", "--noise", "0", "--disaggregation-bootstrap-port", str(boot),
                          "--kv-hold-timeout", "2000", role="prefill") as p, \
            SimEngineProcess("--flavor", "sglang", "--noise", "0", "--disaggregation-waiting-timeout", "3",
                             role="decode") as d, \
            SimEngineProcess("--flavor", "sglang", "--noise", "0", "--page-size", "32", role="decode") as odd:
        yield {"p0": (p, boot), "d0": (d, None), "odd": (odd, None)}


async def drive(engines, prefill: str, decode: str, req, driver=None, *, hooks=None, urls=None):
    async with aiohttp.ClientSession() as s:
        def client(i):
            proc, boot = engines[i]
            return EngineClient(s, i, (urls or {}).get(i, proc.url), flavor="sglang", bootstrap_port=boot)

        pair = Pair(client(prefill), client(decode))
        hooks = hooks or lifecycle(req.request_id, prefill, decode)
        resp = await (driver or SGLangDriver()).open(pair, req, hooks)
        try:
            return hooks, resp.status, await resp.read()
        finally:
            resp.close()


def idle(engines):
    p, d = engines["p0"][0], engines["d0"][0]
    wait_until(lambda: p.stats()["held"] == 0 and p.stats()["running"] == 0 and p.stats()["waiting"] == 0,
               what="the prefill instance idle")
    wait_until(lambda: d.metric("sglang:num_decode_prealloc_queue_reqs") == 0 and d.stats()["running"] == 0,
               what="the decode instance idle")


def test_dual_dispatch_streams_from_the_decode_and_reports_the_prefill(engines):
    lc, status, data = asyncio.run(drive(engines, "p0", "d0", request("sg-1", stream=True)))
    assert status == 200 and lc.phase is Phase.HANDED_OVER
    assert lc.record.cached_tokens == 0 and lc.record.prefill_start_s <= lc.record.prefill_end_s
    assert data.rstrip().endswith(b"data: [DONE]") and data.count(b'"content"') >= 8
    lc2, status, data = asyncio.run(drive(engines, "p0", "d0", request("sg-2")))  # same prompt: the prefill's hit
    assert status == 200 and lc2.record.cached_tokens > 0
    assert json.loads(data)["usage"]["completion_tokens"] == 8
    idle(engines)


def test_decode_leg_failing_aborts_the_prefill_leg(engines):
    # the decode refuses the pair (page sizes differ): a 5xx, retryable; the prefill must not hold on
    with pytest.raises(UpstreamHTTPError) as e:
        asyncio.run(drive(engines, "p0", "odd", request("sg-3")))
    assert e.value.status == 500 and e.value.retryable and e.value.engine == "odd"
    idle(engines)


def test_unreachable_prefill_aborts_the_waiting_decode(engines):
    gone = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(UpstreamUnavailable) as e:
        asyncio.run(drive(engines, "p0", "d0", request("sg-4"), urls={"p0": gone}))
    assert e.value.retryable and e.value.engine == "p0"
    idle(engines)


def test_a_room_taken_on_the_prefill_is_the_pairs_failure(engines):
    class Fixed(random.Random):
        def randint(self, a, b):
            return 777

    p, boot = engines["p0"]
    holder = {"model": "llama3-8b", "messages": [{"role": "user", "content": "holding room 777"}], "max_tokens": 1,
              "bootstrap_host": "127.0.0.1", "bootstrap_port": boot, "bootstrap_room": 777}

    async def go():
        async with aiohttp.ClientSession() as s:
            hold = asyncio.ensure_future(s.post(p.url + "/v1/chat/completions", json=holder))
            await asyncio.get_running_loop().run_in_executor(
                None, lambda: wait_until(lambda: p.stats()["held"] == 1, what="room 777 held"))
            try:
                with pytest.raises(UpstreamHTTPError) as e:
                    await drive(engines, "p0", "d0", request("sg-5"), SGLangDriver(Fixed()))
            finally:
                hold.cancel()  # the holder leaves: its KV is freed
                await asyncio.gather(hold, return_exceptions=True)
            return e.value

    err = asyncio.run(go())
    assert err.status == 409 and err.retryable and err.engine == "p0"
    idle(engines)


def test_client_leaving_mid_handover_aborts_both_legs(engines):
    p = engines["p0"][0]

    def prefill_has_it():
        st = p.stats()
        return st["running"] + st["waiting"] + st["held"] > 0

    async def go():
        task = asyncio.ensure_future(drive(engines, "p0", "d0", request("sg-6", "long prompt " * 2000)))
        # the handover is under way once the prefill instance has the request (bounded wait, no sleep)
        await asyncio.get_running_loop().run_in_executor(
            None, lambda: wait_until(prefill_has_it, interval=0.002, what="the prefill leg"))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
    idle(engines)


def test_the_driver_never_reuses_a_room_in_flight():
    class Repeating(random.Random):
        def __init__(self):
            super().__init__()
            self.seq = iter([5, 5, 6])

        def randint(self, a, b):
            return next(self.seq)

    drv = SGLangDriver(Repeating())
    first = drv.new_room()
    drv._rooms.add(first)
    assert (first, drv.new_room()) == (5, 6)


def test_sglang_metrics_parse():
    text = ("# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{dp_rank=\"0\"} 3\n"
            "sglang:num_running_reqs{dp_rank=\"1\"} 2\n# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs 4\n"
            "# TYPE sglang:num_decode_prealloc_queue_reqs gauge\nsglang:num_decode_prealloc_queue_reqs 1\n"
            "# TYPE sglang:token_usage gauge\nsglang:token_usage{dp_rank=\"0\"} 0.25\n"
            "sglang:token_usage{dp_rank=\"1\"} 0.5\n# TYPE sglang:max_total_num_tokens gauge\n"
            "sglang:max_total_num_tokens{dp_rank=\"0\"} 1000\nsglang:max_total_num_tokens{dp_rank=\"1\"} 1000\n")
    s = parse_metrics("sglang", text)
    assert (s.running, s.waiting, s.kv_usage, s.kv_capacity_tokens) == (5, 5, 0.5, 2000)
    assert isinstance(UpstreamUnavailable("x"), UpstreamError)
