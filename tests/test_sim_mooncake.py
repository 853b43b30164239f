"""`conductor sim-engine --kv-connector mooncake`: vLLM 0.33's MooncakeConnector flow (a bootstrap
server on the prefill, transfer ids, both legs at once), and the gateway's driver for it against
real engine processes."""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import urllib.request

import aiohttp
import pytest

from engines_adapters.drivers import Pair, UpstreamHTTPError
from engines_adapters.drivers.vllm_mooncake import VLLMMooncakeDriver
from engines_adapters.engine_client import EngineClient
from engines_adapters.net import free_port
from scheduler.lifecycle import Phase
from tests.sim_helpers import SimEngineProcess, run_cli, wait_until
from tests.test_drivers import lifecycle, request

pytestmark = pytest.mark.slow  # starts sim engine processes


@pytest.fixture(scope="module")
def pd():
    boot = free_port()
    # KV nobody takes is held for 100 s wall: only a decode or an abort frees it within the tests
    with SimEngineProcess("--kv-connector", "mooncake", "--mooncake-bootstrap-port", str(boot), "--noise", "0",
                          "--kv-hold-timeout", "2000", role="prefill") as p, \
            SimEngineProcess("--kv-connector", "mooncake", "--kv-transfer-timeout", "1.5", "--noise", "0",
                             role="decode") as d:
        with urllib.request.urlopen(f"http://127.0.0.1:{boot}/query", timeout=5) as r:
            ranks = json.loads(r.read())
        yield p, d, boot, ranks["0"]["engine_id"]


def chat(text: str, **kv) -> dict:
    body = {"model": "llama3-8b", "messages": [{"role": "user", "content": text}], "max_tokens": 6, "ignore_eos": True}
    if kv:
        body["kv_transfer_params"] = kv
    return body


def legs(boot: int, eid: str, tid: str) -> tuple[dict, dict]:
    return ({"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid},
            {"do_remote_decode": False, "do_remote_prefill": True, "transfer_id": tid, "remote_engine_id": eid,
             "remote_bootstrap_addr": f"http://127.0.0.1:{boot}"})


def test_bootstrap_server_answers_vllms_routes(pd):
    p, _, boot, eid = pd
    assert eid.startswith("sim-")
    req = urllib.request.Request(f"http://127.0.0.1:{boot}/register", method="POST", data=json.dumps(
        {"engine_id": "other", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": "tcp://127.0.0.1:1"}).encode(),
        headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:  # dp rank 0 belongs to this engine
        urllib.request.urlopen(req, timeout=5)
    assert e.value.code == 400


def test_both_legs_at_once_hand_the_kv_over_by_transfer_id(pd):
    p, d, boot, eid = pd
    text = "mooncake connector " * 30
    pre, dec = legs(boot, eid, "xfer-1")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        fd = pool.submit(d.post, "/v1/chat/completions", chat(text, **dec))  # the decode may well come first
        fp = pool.submit(p.post, "/v1/chat/completions", chat(text, **pre))
        (ps, _, pb), (ds, _, db) = fp.result(), fd.result()
    assert ps == 200 and "kv_transfer_params" not in pb and pb["usage"]["completion_tokens"] == 1
    assert ds == 200 and db["usage"]["completion_tokens"] == 6
    assert db["usage"]["prompt_tokens_details"]["cached_tokens"] == db["usage"]["prompt_tokens"] - 1  # pulled
    wait_until(lambda: p.stats()["held"] == 0, what="the prefill's KV released")


def test_what_vllm_ignores_or_refuses(pd):
    p, d, boot, eid = pd
    # a prefill leg without a transfer id: vLLM warns and sends nothing, so nothing is held
    st, _, _ = p.post("/v1/chat/completions", chat("no transfer id", do_remote_decode=True))
    assert st == 200 and p.stats()["held"] == 0
    # a decode leg missing remote_engine_id: "invalid KVTransferParams", computed locally
    text = "recomputed locally " * 20
    st, _, body = d.post("/v1/chat/completions", chat(text, do_remote_prefill=True, transfer_id="x"))
    assert st == 200 and body["usage"]["prompt_tokens_details"]["cached_tokens"] < body["usage"]["prompt_tokens"] - 1
    # an engine id the bootstrap server does not serve
    _, dec = legs(boot, "sim-nobody", "xfer-2")
    st, _, body = d.post("/v1/chat/completions", chat(text, **dec))
    assert st == 400 and "sim-nobody" in body["error"]["message"]
    # a transfer id no prefill ever had: the decode times out cleanly and holds nothing
    _, dec = legs(boot, eid, "xfer-never")
    st, _, body = d.post("/v1/chat/completions", chat(text, **dec))
    assert st == 504 and "transfer id 'xfer-never'" in body["error"]["message"]
    assert d.stats()["running"] == 0 and d.stats()["waiting"] == 0
    # a transfer id still held by another request on the prefill: refused
    pre, dec = legs(boot, eid, "xfer-3")
    assert p.post("/v1/chat/completions", chat("first " * 20, **pre))[0] == 200
    assert p.post("/v1/chat/completions", chat("second " * 20, **pre))[0] == 409
    assert d.post("/v1/chat/completions", chat("first " * 20, **dec))[0] == 200  # the holder's decode gets it
    wait_until(lambda: p.stats()["held"] == 0, what="the prefill's KV released")


def test_kv_connector_mooncake_is_vllms():
    r = run_cli("--role", "both", "--port", "0", "--flavor", "sglang", "--kv-connector", "mooncake")
    assert r.returncode == 2 and "--flavor vllm" in r.stderr and len(r.stderr.strip().splitlines()) == 1


async def _drive(p, d, boot, req, driver=None):
    async with aiohttp.ClientSession() as s:
        pair = Pair(EngineClient(s, "p0", p.url, flavor="vllm-mooncake", bootstrap_port=boot),
                    EngineClient(s, "d0", d.url, flavor="vllm-mooncake"))
        lc = lifecycle(req.request_id, "p0", "d0")
        resp = await (driver or VLLMMooncakeDriver()).open(pair, req, lc)
        try:
            return lc, resp.status, await resp.read()
        finally:
            resp.close()


def test_the_gateway_driver_runs_the_flow(pd):
    p, d, boot, _ = pd
    lc, status, data = asyncio.run(_drive(p, d, boot, request("mc-1", stream=True)))
    assert status == 200 and lc.phase is Phase.HANDED_OVER and lc.record.cached_tokens == 0
    assert data.rstrip().endswith(b"data: [DONE]") and data.count(b'"content"') >= 8
    lc, status, _ = asyncio.run(_drive(p, d, boot, request("mc-2")))  # the same prompt: the prefill's own hit
    assert status == 200 and lc.record.cached_tokens > 0
    wait_until(lambda: p.stats()["held"] == 0, what="the prefill's KV released")


def test_a_request_the_engines_refuse_is_passed_on_and_leaves_nothing_held(pd):
    p, d, boot, _ = pd
    long_prompt = "word " * 200_000  # beyond the context: both legs refuse it, the prefill's answer is passed on
    with pytest.raises(UpstreamHTTPError) as e:
        asyncio.run(_drive(p, d, boot, request("mc-3", long_prompt)))
    assert e.value.status == 400 and not e.value.retryable
    wait_until(lambda: p.stats()["held"] == 0 and d.stats()["waiting"] == 0, what="both idle")
