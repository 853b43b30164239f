"""The vLLM two-step PD protocol between two real sim-engine processes over loopback."""
from __future__ import annotations

import openai
import pytest

from engines_adapters.sim.profiles import load_profile
from tests.sim_helpers import SimEngineProcess, wait_until

# starts real servers or subprocesses: `make test-fast` skips these
pytestmark = pytest.mark.slow

PROFILE = load_profile("llama3-8b-h200")
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


@pytest.fixture(scope="module")
def pair():
    with SimEngineProcess("--noise", "0", "--kv-hold-timeout", "600", role="prefill") as p, \
            SimEngineProcess("--noise", "0", role="decode") as d:
        yield p, d


def body(text: str, **kw) -> dict:
    return {"model": "llama3-8b", "messages": [{"role": "user", "content": text}], **kw}


def test_two_step_flow_streams_from_decode_and_frees_prefill_kv(pair):
    prefill, decode = pair
    text = "Disaggregated prefill then decode. " * 100
    status, hdrs, pre = prefill.post("/v1/chat/completions", body(text, max_tokens=1, stream=False,
                                                                 kv_transfer_params=PREFILL_PARAMS),
                                     headers={"X-Request-Id": "pd-1"})
    assert status == 200 and hdrs["X-Request-Id"] == "pd-1"
    kvp = pre["kv_transfer_params"]
    assert kvp["do_remote_prefill"] is True and kvp["do_remote_decode"] is False
    assert (kvp["remote_host"], kvp["remote_port"], kvp["remote_request_id"]) == ("127.0.0.1", prefill.port, "pd-1")
    assert pre["usage"]["completion_tokens"] == 1
    n = pre["usage"]["prompt_tokens"]
    assert prefill.stats()["held"] == 1

    client = openai.OpenAI(base_url=decode.url + "/v1", api_key="unused", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="llama3-8b", messages=[{"role": "user", "content": text}], max_tokens=30, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "kv_transfer_params": kvp},
        extra_headers={"X-Request-Id": "pd-1"})
    transfer_ms = float(raw.headers["x-sim-transfer-ms"])
    out, usage = "", None
    for chunk in raw.parse():
        out += "".join(c.delta.content or "" for c in chunk.choices)
        usage = chunk.usage or usage
    assert len(out) == 30 and usage.completion_tokens == 30 and usage.prompt_tokens == n
    assert usage.prompt_tokens_details.cached_tokens == n - 1  # only the last prompt token was recomputed
    expected_ms = 1e3 * (PROFILE.efficiency["transfer_latency_ms"] / 1e3 + n * PROFILE.kv_bytes_per_token
                         / PROFILE.net_bytes_per_s)
    assert transfer_ms == pytest.approx(expected_ms, rel=0.05)
    st = wait_until(lambda: (s := prefill.stats())["held"] == 0 and s, what="the prefill to release the KV")
    assert st["kv_usage"] == 0
    assert decode.stats()["prefix_queries"] >= n


def test_decode_with_gone_kv_fails_fast(pair):
    prefill, decode = pair
    kvp = {"do_remote_prefill": True, "do_remote_decode": False, "remote_host": "127.0.0.1",
           "remote_port": prefill.port, "remote_request_id": "never-prefilled"}
    status, _, err = decode.post("/v1/chat/completions", body("hi", max_tokens=5, kv_transfer_params=kvp), timeout=5)
    assert status == 410 and "never-prefilled" in err["error"]["message"]
    assert decode.stats()["running"] == 0 and decode.stats()["waiting"] == 0


def test_unreachable_prefill_is_a_bad_gateway(pair):
    _, decode = pair
    kvp = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1, "remote_request_id": "x"}
    status, _, err = decode.post("/v1/chat/completions", body("hi", kv_transfer_params=kvp), timeout=15)
    assert status == 502 and "cannot reach" in err["error"]["message"]


def test_roles_refuse_the_wrong_side(pair):
    prefill, decode = pair
    status, _, err = decode.post("/v1/chat/completions", body("x", kv_transfer_params=PREFILL_PARAMS))
    assert status == 400 and "decode instance" in err["error"]["message"]


def test_unpulled_kv_expires_after_the_hold_timeout():
    with SimEngineProcess("--kv-hold-timeout", "2", role="prefill", time_scale=0.05) as prefill, \
            SimEngineProcess(role="decode") as decode:
        text = "Nobody will pull this in time. " * 20
        _, _, pre = prefill.post("/v1/chat/completions", body(text, max_tokens=1, kv_transfer_params=PREFILL_PARAMS))
        assert prefill.stats()["held"] == 1
        wait_until(lambda: prefill.stats()["held"] == 0, timeout=10, what="the hold to expire")
        assert prefill.stats()["kv_usage"] == 0
        status, _, err = decode.post("/v1/chat/completions", body(text, kv_transfer_params=pre["kv_transfer_params"]))
        assert status == 410 and "expired" in err["error"]["message"]
