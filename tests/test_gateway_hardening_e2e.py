"""Request-level hardening of `conductor serve`, from the outside: keys and the admin token, SLO
headers that cannot switch admission off, bad input answered 4xx and recorded, PD usage."""
from __future__ import annotations

import json

import openai
import pytest
import requests

from predictors.telemetry import RequestRecord
from tests.servers import gateway

pytestmark = pytest.mark.slow

AUTH = """
[slo]
ttft_ms = 1
[auth]
admin_token = "adm-1"
engine_api_key = "engine-key-1"
[auth.api_keys.plain]
key = "sk-plain"
[auth.api_keys.bench]
key = "sk-bench"
trust_slo_headers = true
[embedded]
prefill = 1
decode = 1
time_scale = 0.1
"""


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def secured():
    with gateway(AUTH) as g:
        g["model"] = requests.get(g["url"] + "/v1/models", headers=bearer("sk-plain")).json()["data"][0]["id"]
        yield g


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    telemetry = tmp_path_factory.mktemp("telemetry") / "t.jsonl"
    cfg = f'telemetry_path = "{telemetry}"\n[slo]\nttft_ms = 600000\n[embedded]\nprefill = 1\ndecode = 1\n'
    with gateway(cfg) as g:
        g["model"] = requests.get(g["url"] + "/v1/models").json()["data"][0]["id"]
        g["telemetry"] = telemetry
        yield g


def test_v1_needs_a_client_key_and_engines_get_theirs(secured):
    url, model = secured["url"], secured["model"]
    r = requests.get(url + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert requests.post(url + "/v1/chat/completions", json=body, headers=bearer("sk-nope")).status_code == 401
    # the SDK's api_key is the Bearer token; the embedded engines demand engine-key-1 and get it
    c = openai.OpenAI(base_url=url + "/v1", api_key="sk-bench", max_retries=0)
    out = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                    extra_headers={"x-slo-ttft-ms": "600000"})
    assert out.usage.completion_tokens >= 1
    view = requests.get(url + "/admin/cluster", headers=bearer("adm-1")).json()
    engine = view["instances"][0]["url"]
    assert requests.get(engine + "/v1/models").status_code == 401  # nobody else gets in
    assert requests.get(engine + "/v1/models", headers=bearer("engine-key-1")).status_code == 200


@pytest.mark.parametrize("path", ["/admin/cluster", "/admin/decisions", "/metrics"])
def test_admin_needs_the_admin_token(secured, path):
    url = secured["url"]
    assert requests.get(url + path).status_code == 401
    assert requests.get(url + path, headers=bearer("sk-plain")).status_code == 403
    assert requests.get(url + path, headers=bearer("adm-1")).status_code == 200


def test_refusals_at_the_edge_are_counted(secured):
    requests.get(secured["url"] + "/v1/models", headers=bearer("sk-wrong"))
    text = requests.get(secured["url"] + "/metrics", headers=bearer("adm-1")).text
    assert 'conductor_refused_at_edge_total{reason="invalid_api_key"}' in text
    # the connection guard's counters (serve wires them in), not only its log lines
    assert 'conductor_client_connection_events_total{reason="evicted"}' in text
    assert "conductor_client_connections_open" in text


def test_slo_headers_tighten_only_unless_the_key_is_trusted(secured):
    """The configured TTFT SLO is 1 ms: every request misses it. A client asking for 10 minutes
    must not switch admission off (the key "plain"); a key trusted with its SLO headers may."""
    url, model = secured["url"], secured["model"]
    body = {"model": model, "messages": [{"role": "user", "content": "slo " * 200}], "max_tokens": 2}
    loose = {"x-slo-ttft-ms": "600000", "x-slo-tbt-ms": "600000"}
    r = requests.post(url + "/v1/chat/completions", json=body, headers={**bearer("sk-plain"), **loose})
    assert r.status_code == 429, r.text
    r = requests.post(url + "/v1/chat/completions", json=body, headers={**bearer("sk-bench"), **loose})
    assert r.status_code == 200, r.text


def _counts(url: str) -> dict[str, float]:
    out = {}
    for line in requests.get(url + "/metrics").text.splitlines():
        if line.startswith("conductor_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels] = float(value)
    return out


def test_bad_input_is_4xx_recorded_and_leaves_nothing_in_flight(plain):
    url, model = plain["url"], plain["model"]
    ok = {"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    raw_ok = json.dumps(ok).encode()
    cases = [
        (raw_ok.replace(b'"x"', b'"\\ud800"'), {}, 400, None),
        (raw_ok[:-1] + b', "x": ' + b"[" * 5000 + b"]" * 5000 + b"}", {}, 400, None),
        (raw_ok[:-1] + b', "temperature": NaN}', {}, 400, None),
        (json.dumps({**ok, "temperature": -1}).encode(), {}, 400, "temperature"),
        (json.dumps({**ok, "top_p": 0}).encode(), {}, 400, "top_p"),
        (json.dumps({**ok, "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "127.0.0.1",
                                                  "remote_port": 1, "remote_request_id": "r"}}).encode(), {}, 400,
         "kv_transfer_params"),
        (raw_ok, {"x-request-id": "r" * 4096}, 400, "x-request-id"),
        (raw_ok, {"x-request-id": "caf\u00e9".encode()}, 400, "x-request-id"),
        (json.dumps({**ok, "messages": [{"role": "user", "content": "y" * 140_000}]}).encode(), {}, 400, "messages"),
    ]
    before = _counts(url)
    for raw, headers, status, param in cases:
        r = requests.post(url + "/v1/chat/completions", data=raw,
                          headers={"content-type": "application/json", **headers})
        assert r.status_code == status, (raw[:80], r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param, err
        assert r.headers["x-request-id"]  # ours when the client's was refused
    after = _counts(url)
    key = 'conductor_requests_total{reason="",status="error"}'
    assert after.get(key, 0) - before.get(key, 0) == len(cases)  # each one finished and counted
    # nothing is left in flight: the same id is free again, and the ledger is empty
    r = requests.post(url + "/v1/chat/completions", json=ok, headers={"x-request-id": "again-1"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "again-1"
    view = requests.get(url + "/admin/cluster").json()
    assert all(i["active_requests"] == 0 and i["reserved_prefill_tokens"] == 0 for i in view["instances"])
    records = [RequestRecord.from_dict(json.loads(x)) for x in plain["telemetry"].read_text().splitlines()]
    assert sum(1 for rec in records if rec.status == "error" and rec.http_status == 400) >= len(cases)
    assert not any(rec.http_status == 500 for rec in records)


def test_405_is_a_client_error(plain):
    r = requests.put(plain["url"] + "/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


def test_decisions_are_paged(plain):
    r = requests.get(plain["url"] + "/admin/decisions", params={"limit": 10_000})
    page = r.json()
    assert r.status_code == 200 and page["limit"] == 100 and len(page["decisions"]) <= 100
    if page["decisions"]:
        assert page["decisions"][-1]["seq"] == page["total"] - 1


@pytest.mark.parametrize("stream", [False, True])
def test_pd_usage_reports_what_the_prefill_side_reused(plain, stream):
    """A cold prompt: the decode engine pulled all of its KV (and counts it as cached), the
    prefill instance found none of it. Clients read the latter."""
    url, model = plain["url"], plain["model"]
    text = f"cold prompt {stream} " + "q" * 3000
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 3, "ignore_eos": True,
            "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
    r = requests.post(url + "/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if stream:
        events = [json.loads(line[6:]) for line in r.text.split("\n") if line.startswith("data: {")]
        usage = [e for e in events if e.get("usage")][-1]["usage"]
    else:
        usage = r.json()["usage"]
    prefill_cached = int(r.headers["x-conductor-prefill-cached-tokens"])
    assert usage["prompt_tokens_details"]["cached_tokens"] == prefill_cached
    assert prefill_cached < usage["prompt_tokens"] // 2  # cold: the decode side would say prompt_tokens - 1
