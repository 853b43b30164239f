"""Tenants end to end (issue 14): per-key cache isolation that both the gateway's hit index and
the engines honour, per-key rate limits with Retry-After from the bucket, per-key metrics and
decision records filtered by tenant."""
from __future__ import annotations

import random
import threading

import pytest
import requests

from tests.servers import gateway

pytestmark = pytest.mark.slow

CONFIG = """
[embedded]
prefill = 1
decode = 1
[auth]
admin_token = "adm-token"
cache_salt_secret = "a-secret-of-the-operator"
[auth.api_keys.alice]
key = "key-alice"
cache = "isolated"
[auth.api_keys.bob]
key = "key-bob"
cache = "isolated"
priority = "critical"
[auth.api_keys.team]
key = "key-team"
cache = "shared"
[auth.api_keys.trial]
key = "key-trial"
requests_per_minute = 6
request_burst = 2
priority = "sheddable"
[auth.api_keys.capped]
key = "key-capped"
max_concurrent = 2
"""


@pytest.fixture(scope="module")
def gw():
    with gateway(CONFIG) as g:
        g["model"] = requests.get(g["url"] + "/v1/models", headers=auth("key-alice")).json()["data"][0]["id"]
        yield g


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def ask(gw, key: str, prompt: str, salt: str | None = None) -> tuple[int, int]:
    body = {"model": gw["model"], "prompt": prompt, "max_tokens": 2}
    if salt is not None:
        body["cache_salt"] = salt
    r = requests.post(gw["url"] + "/v1/completions", json=body, headers=auth(key))
    assert r.status_code == 200, r.text
    return int(r.headers["x-conductor-hit-tokens"]), int(r.headers["x-conductor-prefill-cached-tokens"])


def wait_cached(gw, blocks: int) -> None:
    """The prefill instance's KV events reach the index asynchronously: wait until it holds ``blocks``."""
    for _ in range(200):
        inst = requests.get(gw["url"] + "/admin/cluster", headers=auth("adm-token")).json()["instances"]
        if sum(i["cached_blocks"]["device"] for i in inst if i["role"] == "prefill") >= blocks:
            return
        threading.Event().wait(0.05)
    raise AssertionError(f"the index never held {blocks} blocks")


def test_isolated_keys_never_see_each_others_hits_and_the_client_cannot_opt_out(gw):
    prompt = "".join(random.Random(21).choice("uvwxyz ") for _ in range(3000))
    assert ask(gw, "key-alice", prompt) == (0, 0)
    wait_cached(gw, 3000 // 16)
    # one prefill instance: bob lands on the instance holding alice's blocks, and finds none
    assert ask(gw, "key-bob", prompt) == (0, 0)
    # a client value changes nothing: the gateway sets an isolated key's salt, so bob's own
    # blocks (and not alice's, already shown) are found whatever salt bob sends
    wait_cached(gw, 2 * (3000 // 16))
    predicted, served = ask(gw, "key-bob", prompt, salt="anything")
    assert predicted >= 3000 - 32 and served >= 3000 - 32
    predicted, served = ask(gw, "key-alice", prompt, salt="a-client-value")
    assert predicted >= 3000 - 32 and served >= 3000 - 32  # the same tenant hits, predicted and served


def test_shared_key_drops_the_clients_salt(gw):
    prompt = "".join(random.Random(22).choice("ghijk ") for _ in range(2000))
    ask(gw, "key-team", prompt, salt="one")
    wait_cached(gw, 2 * (3000 // 16) + 2000 // 16)
    predicted, served = ask(gw, "key-team", prompt, salt="two")  # another salt, the same (no) namespace
    assert predicted >= 2000 - 32 and served >= 2000 - 32


def test_rate_limit_is_429_with_retry_after_from_the_bucket_and_per_key_metrics(gw):
    body = {"model": gw["model"], "prompt": "hi", "max_tokens": 1}
    codes = [requests.post(gw["url"] + "/v1/completions", json=body, headers=auth("key-trial")) for _ in range(3)]
    assert [r.status_code for r in codes[:2]] == [200, 200]
    r = codes[2]
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limited"
    assert r.headers["x-conductor-reject-reason"] == "rate_limited"
    assert 9 <= int(r.headers["retry-after"]) <= 10  # one request every 10 s, the bucket just emptied
    # another key is not limited by trial's bucket
    assert requests.post(gw["url"] + "/v1/completions", json=body, headers=auth("key-team")).status_code == 200
    text = requests.get(gw["url"] + "/metrics", headers=auth("adm-token")).text
    assert 'conductor_api_key_requests_total{api_key="trial",reason="rate_limited",status="rejected"} 1.0' in text
    assert 'conductor_api_key_requests_total{api_key="trial",reason="",status="ok"} 2.0' in text


def test_decisions_carry_tenant_model_and_priority_and_filter_by_them(gw):
    prompt = "".join(random.Random(23).choice("abc ") for _ in range(200))
    ask(gw, "key-bob", prompt)
    ask(gw, "key-alice", prompt)
    page = requests.get(gw["url"] + "/admin/decisions", params={"tenant": "bob", "limit": 100},
                        headers=auth("adm-token")).json()
    assert page["decisions"] and page["filters"] == {"tenant": "bob"}
    assert all(d["tenant"] == "bob" and d["priority"] == "critical" and d["model"] == gw["model"]
               for d in page["decisions"])
    everyone = requests.get(gw["url"] + "/admin/decisions", params={"limit": 100}, headers=auth("adm-token")).json()
    assert {d.get("tenant") for d in everyone["decisions"]} >= {"alice", "bob"}
    assert requests.get(gw["url"] + "/admin/decisions", params={"tenant": "bob"},
                        headers=auth("key-bob")).status_code == 403  # a client key is no admin token


def test_concurrency_cap_frees_its_slots_however_requests_end(gw):
    body = {"model": gw["model"], "prompt": "go", "max_tokens": 2000, "stream": True, "ignore_eos": True}
    url, h = gw["url"] + "/v1/completions", auth("key-capped")
    for _ in range(5):  # finished requests give their slot back
        assert requests.post(url, json={**body, "max_tokens": 1, "stream": False}, headers=h).status_code == 200
    held = [requests.post(url, json=body, headers=h, stream=True) for _ in range(2)]
    assert [r.status_code for r in held] == [200, 200]
    third = requests.post(url, json=body, headers=h)
    assert third.status_code == 429 and third.json()["error"]["code"] == "rate_limited"
    assert third.headers["retry-after"] == "1" and "in flight" in third.json()["error"]["message"]
    for r in held:  # the clients leave mid-stream: the gateway aborts them and frees the slots
        r.close()
    for _ in range(200):
        r = requests.post(url, json={**body, "max_tokens": 1, "stream": False}, headers=h)
        if r.status_code == 200:
            break
        threading.Event().wait(0.05)
    assert r.status_code == 200
