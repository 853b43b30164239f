"""The vLLM two-step driver against real sim-engine processes, reporting to a real request
lifecycle; and the flavour registry."""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from engines_adapters.drivers import (
    FLAVORS,
    Pair,
    PairRequest,
    UpstreamHTTPError,
    UpstreamUnavailable,
    driver_for,
    flavor,
    kv_event_decoder,
    parse_metrics,
)
from engines_adapters.engine_client import EngineClient
from engines_adapters.kv_wire import BlockStored, encode_batch
from engines_adapters.net import free_port
from predictors.telemetry import RequestRecord
from scheduler import Instance, RequestFacts, Scheduler
from scheduler.hashing import block_hashes
from scheduler.lifecycle import Phase, RequestLifecycle
from tests.sched_helpers import toks
from tests.sim_helpers import SimEngineProcess

pytestmark = pytest.mark.slow  # starts sim engine processes

PATH = "/v1/chat/completions"


@pytest.fixture(scope="module")
def engines():
    # a prefill instance whose unpulled KV expires after 2 modelled s (0.1 s wall at the 0.05 time scale)
    with SimEngineProcess("--noise", "0", "--kv-hold-timeout", "2", role="prefill") as p, \
            SimEngineProcess("--noise", "0", role="decode") as d, SimEngineProcess("--noise", "0", role="both") as b:
        yield {"p0": p.url, "d0": d.url, "b0": b.url}


def lifecycle(rid: str, prefill: str, decode: str, cls: type[RequestLifecycle] = RequestLifecycle) -> RequestLifecycle:
    """A lifecycle placed on exactly (prefill, decode) by a real scheduler that knows only them."""
    insts = [Instance(prefill, "both")] if prefill == decode else [Instance(prefill, "prefill"),
                                                                   Instance(decode, "decode")]
    sched = Scheduler(insts, block_size=16, clock=time.monotonic)
    lc = cls(sched, RequestRecord(rid, time.monotonic()), time.monotonic)
    d = lc.decide(RequestFacts(rid, 300, block_hashes(toks(3, 300), 16), 8))
    assert (d.prefill, d.decode) == (prefill, decode)
    return lc


def request(rid: str, text: str = "Drive me through the pair. " * 40, **kw) -> PairRequest:
    body = {"model": "llama3-8b", "messages": [{"role": "user", "content": text}], "max_tokens": 8,
            "ignore_eos": True, **kw}
    return PairRequest(rid, PATH, body, {"x-request-id": rid})


async def drive(urls: dict[str, str], prefill: str, decode: str, req: PairRequest, hooks=None):
    async with aiohttp.ClientSession() as s:
        clients = {i: EngineClient(s, i, u) for i, u in urls.items()}
        pair = Pair(clients[prefill], clients[decode])
        hooks = hooks or lifecycle(req.request_id, prefill, decode)
        resp = await driver_for("vllm").open(pair, req, hooks)
        try:
            return hooks, resp.status, await resp.read()
        finally:
            resp.close()


def test_disaggregated_pair_reports_the_prefill_then_decodes(engines):
    lc, status, data = asyncio.run(drive(engines, "p0", "d0", request("drv-1")))
    assert status == 200 and lc.phase is Phase.HANDED_OVER
    rec = lc.record
    assert rec.prefill_start_s < rec.prefill_end_s == rec.decode_start_s
    assert rec.cached_tokens == 0  # the prefill instance's own report: a cold cache
    assert not lc.scheduler.ledger.get("drv-1").prefill_pending  # prefill_done reached the ledger
    answer = json.loads(data)
    assert answer["usage"]["completion_tokens"] == 8
    lc.finish("ok", 200, usage=answer["usage"], token_times=[time.monotonic()])
    assert lc.scheduler.ledger.is_idle()


def test_colocated_instance_is_one_leg(engines):
    lc, status, data = asyncio.run(drive(engines, "b0", "b0", request("drv-2", stream=True)))
    assert status == 200 and lc.phase is Phase.HANDED_OVER
    assert lc.record.prefill_start_s is None and lc.record.decode_start_s is not None
    assert data.rstrip().endswith(b"data: [DONE]")


def test_decode_refused_for_lost_kv_is_the_pairs_failure(engines):
    class SlowHandover(RequestLifecycle):
        """The KV hold expires while the request is between its legs."""

        def prefill_finished(self, cached_tokens=None):
            super().prefill_finished(cached_tokens)
            time.sleep(0.6)

    slow = lifecycle("drv-3", "p0", "d0", SlowHandover)
    with pytest.raises(UpstreamHTTPError) as e:
        asyncio.run(drive(engines, "p0", "d0", request("drv-3"), slow))
    assert e.value.status == 410 and e.value.kv_lost and e.value.retryable and e.value.engine == "d0"
    slow.retry(e.value.engine)
    assert slow.scheduler.ledger.is_idle()


def test_engine_refusing_the_request_is_not_retryable(engines):
    long_prompt = "word " * 200_000  # beyond the model's context
    with pytest.raises(UpstreamHTTPError) as e:
        asyncio.run(drive(engines, "p0", "d0", request("drv-4", long_prompt)))
    assert 400 <= e.value.status < 500 and not e.value.retryable and e.value.engine == "p0"


def test_unreachable_prefill_is_retryable(engines):
    urls = {**engines, "gone": f"http://127.0.0.1:{free_port()}"}
    with pytest.raises(UpstreamUnavailable) as e:
        asyncio.run(drive(urls, "gone", "d0", request("drv-5")))
    assert e.value.retryable and e.value.engine == "gone"


def test_flavour_registry():
    assert set(FLAVORS) == {"vllm", "sglang", "vllm-mooncake"} and driver_for("vllm").flavor == "vllm"
    assert driver_for("sglang").flavor == "sglang" and driver_for("vllm-mooncake").flavor == "vllm-mooncake"
    with pytest.raises(ValueError, match="known: vllm, sglang, vllm-mooncake"):
        flavor("trtllm")
    sample = parse_metrics("vllm", "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 2\n")
    assert sample.running == 2 and sample.waiting == 0
    ev = BlockStored([1, 2], None, list(range(32)), 16, None, "GPU", None)
    ts, events, dp = kv_event_decoder("vllm")(encode_batch(5.0, [ev]))
    assert (ts, dp) == (5.0, 0) and events == [ev]
